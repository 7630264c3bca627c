#!/bin/bash
# a later call, on a quieter H100 machine (both-ways pinned copy 94 GB/s): the same side-by-side cells,
# slots in runs (17 repetitions) and scattered (11), dma path (7-ab-*.txt)
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
(cd _base && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
rm -rf /tmp/ab && mkdir -p /tmp/ab && cp -r _base/src/umbp /tmp/ab/umbp_base
find /tmp/ab/umbp_base -name "*.py" -print0 | xargs -0 sed -i -E 's/\bumbp\./umbp_base./g; s/^(\s*)from umbp import/\1from umbp_base import/; s/^(\s*)import umbp$/\1import umbp_base/'
PYTHONPATH=$PWD/src:/tmp/ab timeout 300 python3 bench/probes/transfer_ab_gpu.py 17 runs dma base=@umbp_base 2>&1 | grep -v Warn | tee $OUT/ab-runs-dma-2.txt
PYTHONPATH=$PWD/src:/tmp/ab timeout 200 python3 bench/probes/transfer_ab_gpu.py 11 scattered dma base=@umbp_base 2>&1 | grep -v Warn | tee $OUT/ab-scattered-dma.txt
