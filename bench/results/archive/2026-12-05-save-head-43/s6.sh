#!/bin/bash
# the next call on the same H200 machine as s5.sh: the Granite rows of umbp bench transfer
export PYTHONPATH=$PWD/src; nvidia-smi --query-gpu=name --format=csv,noheader; timeout 140 python3 -m umbp bench transfer --only granite --sweep-ctas "" --sweep-blocks "" --no-staged --out /tmp/t.json > $OUT/7-transfer-granite.txt 2>&1; grep -i "baseline\|granite" $OUT/7-transfer-granite.txt | cut -c1-200
