#!/bin/bash
# the Granite transfer rows again, new / before / new / before, to see whether the second run's low
# slots-in-runs rows (86-88 GB/s both ways) repeat
# (the next call, same H100 machine as s3.sh: 5-transfer-*-3/4.txt)
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
(cd _base && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
mkdir -p /tmp/t
for i in 3 4; do
  PYTHONPATH=$PWD/src timeout 140 python3 -m umbp bench transfer --only granite --paths dma,auto --sweep-ctas "" --sweep-blocks "" --no-staged --out /tmp/t/n$i.json > $OUT/transfer-new-$i.txt 2>&1; echo new $i; grep -i "baseline\|granite" $OUT/transfer-new-$i.txt | cut -c1-200
  (cd _base && PYTHONPATH=$PWD/src timeout 140 python3 -m umbp bench transfer --only granite --paths dma,auto --sweep-ctas "" --sweep-blocks "" --no-staged --out /tmp/t/b$i.json > $OUT/transfer-base-$i.txt 2>&1); echo base $i; grep -i "baseline\|granite" $OUT/transfer-base-$i.txt | cut -c1-200
done
