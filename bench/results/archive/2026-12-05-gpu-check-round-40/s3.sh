#!/bin/bash
# on the device, at the code to land (no save head; umbp bench restore times every call of a size
# interleaved, copies included): GPU tests; the official restore run; the transfer run's Granite rows
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py tests/unit/test_cuda_timing.py > $OUT/pytest.txt 2>&1
tail -1 $OUT/pytest.txt; grep "FAILED\|Error" $OUT/pytest.txt | head -20
timeout 150 python3 -m umbp bench restore --out $OUT/restore.json > $OUT/restore.txt 2>&1; tail -8 $OUT/restore.txt | cut -c1-112
timeout 150 python3 -m umbp bench transfer --only granite --out $OUT/transfer.json --sweep-blocks "" > $OUT/transfer.txt 2>&1; grep -i "baseline\|granite\|error" $OUT/transfer.txt | cut -c1-220

