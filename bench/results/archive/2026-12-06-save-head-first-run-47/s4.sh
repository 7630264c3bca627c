#!/bin/bash
# the engine as committed: the official restore run, the Granite rows of umbp bench transfer (item 2: both
# ways >= 95 GB/s where the machine's own both-ways copy allows), the GPU tests
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "build failed"
PYTHONPATH=$PWD/src timeout 100 python3 -m umbp bench restore --out $OUT/4-restore.json > $OUT/4-restore.txt 2>&1; tail -9 $OUT/4-restore.txt | cut -c1-112
PYTHONPATH=$PWD/src timeout 240 python3 -m umbp bench transfer --only granite --no-staged --out $OUT/4-transfer-granite.json > $OUT/4-transfer-granite.txt 2>&1; grep -i "baseline\|granite" $OUT/4-transfer-granite.txt | cut -c1-220
PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py tests/unit/test_cuda_timing.py tests/unit/test_transfer_copies.py > $OUT/4-pytest.txt 2>&1
tail -1 $OUT/4-pytest.txt; grep "FAILED\|Error" $OUT/4-pytest.txt | head -20
