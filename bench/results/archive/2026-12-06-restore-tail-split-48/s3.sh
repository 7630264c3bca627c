#!/bin/bash
# the engine as it stands (hbm_split 4, no copy-stream tail): an 8K restore's device-clock events with a
# mark before its first early copy; the ends of a restore (edges.py, completion without a sleep); the
# official restore run; the GPU tests
set -u
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
export PYTHONUNBUFFERED=1
A=bench/results/archive/2026-12-06-restore-tail-split-48
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "build failed"
PYTHONPATH=$PWD/src timeout 60 python3 bench/probes/save_events_gpu.py 8192 31 2>&1 | grep -v Warn > $OUT/3-events.txt; grep "load\|h2d" $OUT/3-events.txt
PYTHONPATH=$PWD/src timeout 90 python3 $A/edges.py 2>&1 | grep -v Warn | tee $OUT/3-edges.txt
PYTHONPATH=$PWD/src timeout 100 python3 -m umbp bench restore --out $OUT/3-restore.json > $OUT/3-restore.txt 2>&1; tail -9 $OUT/3-restore.txt | cut -c1-112
PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py tests/unit/test_cuda_timing.py tests/unit/test_transfer_copies.py > $OUT/3-pytest.txt 2>&1
tail -1 $OUT/3-pytest.txt; grep "FAILED\|Error" $OUT/3-pytest.txt | head -20
