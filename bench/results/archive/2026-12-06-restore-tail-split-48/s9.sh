#!/bin/bash
# a cold save's head: its copies' addresses worked out and issued in one C call (batchcopy.native_head)
# beside the same engine with the numpy twin (python_head: umbp_py) and d819186 (umbp_base), interleaved;
# 8K device-clock events; the official restore run; the GPU tests; on an H200 also the Granite rows of
# umbp bench transfer
set -u
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "build failed"
(cd _base && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
rm -rf /tmp/ab && mkdir -p /tmp/ab && cp -r _base/src/umbp /tmp/ab/umbp_base && cp -r src/umbp /tmp/ab/umbp_py
sed -i 's/batchcopy.load_head() if cuda/batchcopy.python_head(batchcopy.load_one(), batchcopy.load()) if cuda/' /tmp/ab/umbp_py/transfer/kernel_engine.py
grep -c "python_head(batchcopy.load_one()" /tmp/ab/umbp_py/transfer/kernel_engine.py
for p in umbp_base umbp_py; do find /tmp/ab/$p -name "*.py" -print0 | xargs -0 sed -i -E "s/\bumbp\./$p./g; s/^(\s*)from umbp import/\1from $p import/; s/^(\s*)import umbp$/\1import $p/"; done
PYTHONPATH=$PWD/src:/tmp/ab timeout 240 python3 bench/probes/restore_ab_gpu.py 8192,16384,131072 61 py=@umbp_py base=@umbp_base 2>&1 | grep -v Warn | tee $OUT/9-ab.txt | grep "==\|save\|load"
PYTHONPATH=$PWD/src timeout 60 python3 bench/probes/save_events_gpu.py 8192 31 2>&1 | grep -v Warn > $OUT/9-events.txt; grep "save\|d2h" $OUT/9-events.txt
PYTHONPATH=$PWD/src timeout 100 python3 -m umbp bench restore --out $OUT/9-restore.json > $OUT/9-restore.txt 2>&1; tail -9 $OUT/9-restore.txt | cut -c1-112
PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py tests/unit/test_cuda_timing.py tests/unit/test_transfer_copies.py > $OUT/9-pytest.txt 2>&1
tail -1 $OUT/9-pytest.txt; grep "FAILED\|Error" $OUT/9-pytest.txt | head -20
case "$GPU" in *H200*)
PYTHONPATH=$PWD/src timeout 150 python3 -m umbp bench transfer --only granite --no-staged --out $OUT/9-transfer-granite.json > $OUT/9-transfer-granite.txt 2>&1; grep -i "baseline\|granite" $OUT/9-transfer-granite.txt | cut -c1-200;;
esac
