#!/bin/bash
# on the device, lead-copies checked out: GPU tests; restore A/B main (.gpuwt/main) vs branch (src);
# the branch's official restore run; granite both ways in both path orders; host steps
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
for t in .gpuwt/*/src; do for so in $(find src -name '_*.so'); do c=${so%%.cpython*}.c; [ -f $t/${c#src/} ] && cp $so $t/${so#src/}; done; done
export PYTHONUNBUFFERED=1
N=$PWD/src; M=$PWD/.gpuwt/main/src
PYTHONPATH=$N timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py 2>&1 | tail -3 | tee $OUT/gpu-tests.txt
for i in 1 2 3; do for t in main src; do p=$M; [ $t = src ] && p=$N
  echo "== restore $t run $i"; PYTHONPATH=$p timeout 90 python3 -m umbp bench restore --reps 15 --out /tmp/r-$t-$i.json | tail -n +4 | head -n 7 | cut -c1-200
done; done 2>&1 | tee $OUT/restore-ab.txt
PYTHONPATH=$N timeout 100 python3 -m umbp bench restore --out $OUT/restore.json 2>&1 | tee $OUT/restore.txt | tail -9
for i in 1 2; do for order in dma,auto auto,dma; do
  echo "== transfer order $order run $i"; PYTHONPATH=$N timeout 100 python3 -m umbp bench transfer --only granite --no-staged --paths $order --out /tmp/t-$order-$i.json 2>&1 | grep -i "baseline\|granite" | cut -c1-220
done; done 2>&1 | tee $OUT/transfer-order.txt
for t in main src; do p=$M; [ $t = src ] && p=$N
  echo "=== host steps $t"; PYTHONPATH=$p timeout 60 python3 bench/probes/restore_timeline_gpu.py 8192,32768 host 2>&1 | grep -v Warn
done > $OUT/host-steps.txt 2>&1
