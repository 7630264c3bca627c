#!/bin/bash
# the same machine: larger heads (64 MiB; everything but the call's last object), against none and 16 MiB
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
timeout 230 python3 bench/probes/restore_ab_gpu.py 8192,16384,32768,131072 31 head0=save_head_bytes:0 head16=save_head_bytes:16777216 head64=save_head_bytes:67108864 headall=save_head_bytes:1099511627776 2>&1 | grep -v Warn | tee $OUT/2-ab.txt | grep "==\|save"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py -k "damage" > $OUT/2-pytest.txt 2>&1; tail -1 $OUT/2-pytest.txt
