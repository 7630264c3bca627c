#!/bin/bash
# a save head's copies and a restore's early copies over two copy streams (head_streams / early_streams
# 2: one copy's setup overlapping the other's transfer) beside one stream (the default then), interleaved
set -u
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "build failed"
PYTHONPATH=$PWD/src timeout 300 python3 bench/probes/restore_ab_gpu.py 8192,16384,131072 61 h2=.head_streams:2 e2=.early_streams:2 both=.head_streams:2,.early_streams:2 2>&1 | grep -v Warn | tee $OUT/8-ab.txt | grep "==\|save\|load"
PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/unit/test_transfer_copies.py tests/unit/test_transfer_roundtrip.py -k "cuda or copies" > $OUT/8-pytest.txt 2>&1; tail -1 $OUT/8-pytest.txt
