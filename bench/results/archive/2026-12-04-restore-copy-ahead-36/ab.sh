#!/bin/bash
# A/B of restore trees on the device: $@ = names of trees under .gpuwt (src = this tree)
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
for t in .gpuwt/*/src; do cp src/umbp/pool/_native*.so $t/umbp/pool/; done
export PYTHONUNBUFFERED=1
TOK=${TOK:-8192,16384,32768,65536,131072}
ROUNDS=${ROUNDS:-2}
for i in $(seq $ROUNDS); do
  for t in "$@"; do
    p=$PWD/.gpuwt/$t/src; [ "$t" = src ] && p=$PWD/src
    echo "== $t run $i"
    PYTHONPATH=$p timeout 120 python3 -m umbp bench restore --reps 15 --tokens $TOK --out $OUT/$t-$i.json | tail -n +4 | head -n 7 | cut -c1-200
  done
done
