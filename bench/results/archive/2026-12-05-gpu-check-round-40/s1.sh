#!/bin/bash
# on the device, at main after the integrity fixes (ring fix, transfer batch checks, queued-order check in
# the transfer bench): GPU tests, the official restore and transfer runs, host steps of an 8K restore/save
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
timeout 170 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py > $OUT/pytest.txt 2>&1
tail -1 $OUT/pytest.txt; grep "FAILED\|Error" $OUT/pytest.txt | head -20
timeout 100 python3 -m umbp bench restore --out $OUT/restore.json > $OUT/restore.txt 2>&1; tail -8 $OUT/restore.txt | cut -c1-112
timeout 230 python3 -m umbp bench transfer --out $OUT/transfer.json --sweep-blocks "" > $OUT/transfer.txt 2>&1; grep -i "baseline\|granite\|error\|order" $OUT/transfer.txt | cut -c1-220
timeout 60 python3 bench/probes/restore_timeline_gpu.py 8192 host 2>&1 | grep -v "Warn\|warn" > $OUT/host-steps.txt
grep "first copy\|wall" $OUT/host-steps.txt
