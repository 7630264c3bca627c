#!/bin/bash
# a later call (another H100 machine, noisier: its both-ways pinned copy read 72 and 50 GB/s in the two
# processes): the Granite slots-in-runs "both ways" cells of the engine before and now side by side
# in one process (bench/probes/transfer_ab_gpu.py): 6-ab-runs-dma.txt, 6-ab-runs-auto.txt
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
(cd _base && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
rm -rf /tmp/ab && mkdir -p /tmp/ab && cp -r _base/src/umbp /tmp/ab/umbp_base
find /tmp/ab/umbp_base -name "*.py" -print0 | xargs -0 sed -i -E 's/\bumbp\./umbp_base./g; s/^(\s*)from umbp import/\1from umbp_base import/; s/^(\s*)import umbp$/\1import umbp_base/'
PYTHONPATH=$PWD/src:/tmp/ab timeout 250 python3 bench/probes/transfer_ab_gpu.py 11 runs dma base=@umbp_base 2>&1 | grep -v Warn | tee $OUT/ab-runs-dma.txt
PYTHONPATH=$PWD/src:/tmp/ab timeout 200 python3 bench/probes/transfer_ab_gpu.py 9 runs auto base=@umbp_base 2>&1 | grep -v Warn | tee $OUT/ab-runs-auto.txt
