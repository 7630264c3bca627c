#!/bin/bash
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
for t in .gpuwt/*/src; do for so in $(find src -name '_*.so'); do c=${so%%.cpython*}.c; [ -f $t/${c#src/} ] && cp $so $t/${so#src/}; done; done
export PYTHONUNBUFFERED=1
for i in 1 2 3 4; do for t in src main; do p=$PWD/.gpuwt/$t/src; [ $t = src ] && p=$PWD/src
  echo "== restore $t run $i"; PYTHONPATH=$p timeout 50 python3 -m umbp bench restore --reps 15 --out /tmp/r-$t-$i.json | tail -n +4 | head -n 7 | cut -c1-112
done; done 2>&1 | tee $OUT/restore-ab.txt
