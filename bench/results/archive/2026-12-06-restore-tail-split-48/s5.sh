#!/bin/bash
# a restore's early copies: 4 MiB / 4 objects (default) beside 6, 8 and 12 MiB (more objects), and the
# engine of d819186 (umbp_base), interleaved
set -u
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "build failed"
(cd _base && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
rm -rf /tmp/ab && mkdir -p /tmp/ab && cp -r _base/src/umbp /tmp/ab/umbp_base
find /tmp/ab/umbp_base -name "*.py" -print0 | xargs -0 sed -i -E 's/\bumbp\./umbp_base./g; s/^(\s*)from umbp import/\1from umbp_base import/; s/^(\s*)import umbp$/\1import umbp_base/'
PYTHONPATH=$PWD/src:/tmp/ab timeout 300 python3 bench/probes/restore_ab_gpu.py 8192,16384,131072 61 base=@umbp_base e6=early_bytes:6291456 e8=early_bytes:8388608,early_objects:6 e12=early_bytes:12582912,early_objects:8 2>&1 | grep -v Warn | tee $OUT/5-ab.txt | grep "==\|load"
