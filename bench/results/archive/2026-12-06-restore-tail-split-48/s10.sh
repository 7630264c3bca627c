#!/bin/bash
# the code as committed at the end (5f4a8ae): the official restore run and the GPU tests; on an H200
# also the Granite rows of umbp bench transfer
set -u
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "build failed"
PYTHONPATH=$PWD/src timeout 100 python3 -m umbp bench restore --out $OUT/10-restore.json > $OUT/10-restore.txt 2>&1; tail -9 $OUT/10-restore.txt | cut -c1-112
PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py tests/unit/test_cuda_timing.py tests/unit/test_transfer_copies.py > $OUT/10-pytest.txt 2>&1
tail -1 $OUT/10-pytest.txt; grep "FAILED\|Error" $OUT/10-pytest.txt | head -20
case "$GPU" in *H200*)
PYTHONPATH=$PWD/src timeout 150 python3 -m umbp bench transfer --only granite --no-staged --out $OUT/10-transfer-granite.json > $OUT/10-transfer-granite.txt 2>&1; grep -i "baseline\|granite" $OUT/10-transfer-granite.txt | cut -c1-200;;
esac
