#!/bin/bash
# the ends of an idle 8K restore (edges.py); the engine with hbm_split (the copy-stream tail of s1.sh
# dropped) beside d819186 (umbp_base), interleaved
set -u
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
export PYTHONUNBUFFERED=1
A=bench/results/archive/2026-12-06-restore-tail-split-48
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "build failed"
(cd _base && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
rm -rf /tmp/ab && mkdir -p /tmp/ab && cp -r _base/src/umbp /tmp/ab/umbp_base
find /tmp/ab/umbp_base -name "*.py" -print0 | xargs -0 sed -i -E 's/\bumbp\./umbp_base./g; s/^(\s*)from umbp import/\1from umbp_base import/; s/^(\s*)import umbp$/\1import umbp_base/'
PYTHONPATH=$PWD/src timeout 90 python3 $A/edges.py 2>&1 | grep -v Warn | tee $OUT/2-edges.txt
PYTHONPATH=$PWD/src:/tmp/ab timeout 200 python3 bench/probes/restore_ab_gpu.py 8192,16384,131072 61 base=@umbp_base split8=hbm_split:8 2>&1 | grep -v Warn | tee $OUT/2-ab.txt | grep "==\|save\|load"
