#!/bin/bash
# official GPU results of the branch, then an A/B of two tuning variants (v1: 8 MiB min round, v2: 8 MiB lead)
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
for t in .gpuwt/*/src; do for so in $(find src -name '_*.so'); do c=${so%%.cpython*}.c; [ -f $t/${c#src/} ] && cp $so $t/${so#src/}; done; done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py > $OUT/pytest.txt 2>&1
tail -1 $OUT/pytest.txt
timeout 100 python3 -m umbp bench restore --out $OUT/restore.json > $OUT/restore.txt 2>&1; tail -8 $OUT/restore.txt | cut -c1-112
timeout 200 python3 -m umbp bench transfer --out $OUT/transfer.json --sweep-blocks "" > $OUT/transfer.txt 2>&1; grep -i "baseline\|granite" $OUT/transfer.txt | cut -c1-220
for i in 1 2; do for t in src v1 v2; do p=$PWD/.gpuwt/$t/src; [ $t = src ] && p=$PWD/src
  echo "== restore $t run $i"; PYTHONPATH=$p timeout 60 python3 -m umbp bench restore --reps 15 --out /tmp/r-$t-$i.json | tail -n +4 | head -n 7 | cut -c1-112
done; done > $OUT/variants-ab.txt 2>&1
