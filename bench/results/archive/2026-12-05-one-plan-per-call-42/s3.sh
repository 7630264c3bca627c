#!/bin/bash
# on the device: `umbp bench transfer`'s Granite rows (auto and dma paths) at the engine before (_base:
# e601908) and now, alternating processes, twice each: the steady-state path the one-plan change touched
# (a later call, asked for as an H200: an H100 machine came, pinned copies 54.7-55.2 GB/s each way, 89.6-92.7 both)
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
(cd _base && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
mkdir -p /tmp/t
for i in 1 2; do
  (cd _base && PYTHONPATH=$PWD/src timeout 140 python3 -m umbp bench transfer --only granite --paths dma,auto --sweep-ctas "" --sweep-blocks "" --no-staged --out /tmp/t/b$i.json > $OUT/transfer-base-$i.txt 2>&1); echo base $i; grep -i "baseline\|granite" $OUT/transfer-base-$i.txt | cut -c1-200
  PYTHONPATH=$PWD/src timeout 140 python3 -m umbp bench transfer --only granite --paths dma,auto --sweep-ctas "" --sweep-blocks "" --no-staged --out /tmp/t/n$i.json > $OUT/transfer-new-$i.txt 2>&1; echo new $i; grep -i "baseline\|granite" $OUT/transfer-new-$i.txt | cut -c1-200
done
