#!/bin/bash
# on the device: GPU transfer tests; new engine (src) vs the tree before (.gpuwt/old as umbp_old) and tail
# settings, interleaved call by call; queued timeline and host steps at 8K; the official restore run
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
for so in $(find src -name '_*.so'); do cp $so .gpuwt/old/src/umbp_old/${so#src/umbp/}; done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/.gpuwt/old/src
A=bench/results/archive/2026-12-05-restore-tail-round-39
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_transfer_roundtrip.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_geometry.py 2>&1 | tail -2 | tee $OUT/1-gpu-tests.txt
timeout 150 python3 bench/probes/restore_ab_gpu.py 8192,16384,32768,131072 61 old=@umbp_old tail0=tail_round_bytes:0 tail8=tail_round_bytes:8388608 2>&1 | grep -v Warn | tee $OUT/1-ab.txt
timeout 60 python3 bench/probes/restore_timeline_gpu.py 8192,16384 queued 2>&1 | grep -v "Warn\|warn" > $OUT/1-queued-timeline.txt
timeout 60 python3 bench/probes/restore_timeline_gpu.py 8192 host 2>&1 | grep -v "Warn\|warn" > $OUT/1-host-steps.txt
grep "first copy\|wall" $OUT/1-host-steps.txt
timeout 100 python3 -m umbp bench restore --out $OUT/restore.json > $OUT/1-restore.txt 2>&1; tail -8 $OUT/1-restore.txt | cut -c1-112
