#!/bin/bash
# on the device: GPU tests; new engine (early copies + tail round) vs the tree before (.gpuwt/old as
# umbp_old), without early copies, and with 8 MiB of them, interleaved call by call; host steps and a
# queued timeline at 8K; the official restore and transfer runs
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
for so in $(find src -name '_*.so'); do cp $so .gpuwt/old/src/umbp_old/${so#src/umbp/}; done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/.gpuwt/old/src
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py > $OUT/pytest.txt 2>&1
tail -1 $OUT/pytest.txt
timeout 150 python3 bench/probes/restore_ab_gpu.py 8192,16384,32768,131072 61 old=@umbp_old noearly=.early_bytes:0 early8=.early_bytes:8388608 2>&1 | grep -v Warn | tee $OUT/2-probes.txt | grep "==\|load"
timeout 60 python3 bench/probes/restore_timeline_gpu.py 8192 host 2>&1 | grep -v "Warn\|warn" > /tmp/steps.txt
grep "first copy\|wall" /tmp/steps.txt; cat /tmp/steps.txt >> $OUT/2-probes.txt
timeout 60 python3 bench/probes/restore_timeline_gpu.py 8192 queued 2>&1 | grep -v "Warn\|warn" >> $OUT/2-probes.txt
timeout 100 python3 -m umbp bench restore --out $OUT/restore.json > $OUT/restore.txt 2>&1; tail -8 $OUT/restore.txt | cut -c1-112
timeout 230 python3 -m umbp bench transfer --out $OUT/transfer.json --sweep-blocks "" > $OUT/transfer.txt 2>&1; grep -i "baseline\|granite" $OUT/transfer.txt | cut -c1-220
