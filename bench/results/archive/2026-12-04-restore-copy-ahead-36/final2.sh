#!/bin/bash
# on the device: GPU tests, restore beside the previous engine (3 alternations), the official restore run
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
for t in .gpuwt/*/src; do cp src/umbp/pool/_native*.so $t/umbp/pool/; done
export PYTHONUNBUFFERED=1
N=$PWD/src; O=$PWD/.gpuwt/old/src
PYTHONPATH=$N timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py 2>&1 | tail -2 | tee $OUT/gpu-tests.txt
for i in 1 2 3; do for t in old src; do p=$O; [ $t = src ] && p=$N
  echo "== restore $t run $i"; PYTHONPATH=$p timeout 120 python3 -m umbp bench restore --reps 15 --out /tmp/r-$t-$i.json | tail -n +4 | head -n 7 | cut -c1-200
done; done 2>&1 | tee $OUT/restore-ab.txt
PYTHONPATH=$N timeout 150 python3 -m umbp bench restore --out $OUT/restore.json 2>&1 | tail -9 | tee $OUT/restore.txt
