#!/bin/bash
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
for t in .gpuwt/*/src; do for so in $(find src -name '_*.so'); do c=${so%%.cpython*}.c; [ -f $t/${c#src/} ] && cp $so $t/${so#src/}; done; done
export PYTHONUNBUFFERED=1
N=$PWD/src; M=$PWD/.gpuwt/main/src
for t in src main src; do p=$M; [ $t = src ] && p=$N; echo "=== $t"
PYTHONPATH=$p timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_worker_cuda.py 2>&1 | tail -80
done > $OUT/worker.txt
PYTHONPATH=$N timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py 2>&1 | tail -30 > $OUT/gpu-tests.txt
tail -5 $OUT/gpu-tests.txt; grep -E "passed|failed|error|^E " $OUT/worker.txt | head -40
