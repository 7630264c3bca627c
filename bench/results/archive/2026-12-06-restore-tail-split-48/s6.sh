#!/bin/bash
# the engine as committed (hbm_split 4, early copies 8 MiB / 6 objects): beside d819186 (umbp_base),
# interleaved; the official restore run; 8K device-clock events; the GPU tests; on an H200 also the
# Granite rows of umbp bench transfer
set -u
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "build failed"
(cd _base && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
rm -rf /tmp/ab && mkdir -p /tmp/ab && cp -r _base/src/umbp /tmp/ab/umbp_base
find /tmp/ab/umbp_base -name "*.py" -print0 | xargs -0 sed -i -E 's/\bumbp\./umbp_base./g; s/^(\s*)from umbp import/\1from umbp_base import/; s/^(\s*)import umbp$/\1import umbp_base/'
PYTHONPATH=$PWD/src:/tmp/ab timeout 200 python3 bench/probes/restore_ab_gpu.py 8192,16384,131072 61 base=@umbp_base e4=early_bytes:4194304,early_objects:4 2>&1 | grep -v Warn | tee $OUT/6-ab.txt | grep "==\|save\|load"
PYTHONPATH=$PWD/src timeout 100 python3 -m umbp bench restore --out $OUT/6-restore.json > $OUT/6-restore.txt 2>&1; tail -9 $OUT/6-restore.txt | cut -c1-112
PYTHONPATH=$PWD/src timeout 60 python3 bench/probes/save_events_gpu.py 8192 31 2>&1 | grep -v Warn > $OUT/6-events.txt; grep "load\|h2d" $OUT/6-events.txt
PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py tests/unit/test_cuda_timing.py tests/unit/test_transfer_copies.py > $OUT/6-pytest.txt 2>&1
tail -1 $OUT/6-pytest.txt; grep "FAILED\|Error" $OUT/6-pytest.txt | head -20
case "$GPU" in *H200*)
PYTHONPATH=$PWD/src timeout 150 python3 -m umbp bench transfer --only granite --no-staged --out $OUT/6-transfer-granite.json > $OUT/6-transfer-granite.txt 2>&1; grep -i "baseline\|granite" $OUT/6-transfer-granite.txt | cut -c1-200;;
esac
