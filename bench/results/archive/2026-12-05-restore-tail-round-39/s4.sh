#!/bin/bash
# on the device, at the commit that gives oversized rounds a one-off buffer (early saves reverted): GPU
# tests, then the official restore run
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py > $OUT/pytest.txt 2>&1
tail -1 $OUT/pytest.txt; grep FAILED $OUT/pytest.txt
timeout 90 python3 -m umbp bench restore --out $OUT/restore.json > $OUT/restore.txt 2>&1; tail -8 $OUT/restore.txt | cut -c1-112
