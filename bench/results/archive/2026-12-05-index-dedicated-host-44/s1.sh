#!/bin/bash
# umbp bench index on the device's host (16 cores, no other jobs; no GPU involved), the command of
# bench/results/index.txt: are the wall-clock pauses seen on the shared 2-core VM the VM's preemption?
set -u
nproc; cat /proc/loadavg; lscpu | grep -i "model name"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
/usr/bin/time -v python3 -m umbp.cli bench index --objects 1000000,10000000,30000000 --out $OUT/index.json > $OUT/index.txt 2> $OUT/time.txt
cat /proc/loadavg
cat $OUT/index.txt; grep -i "maximum resident\|elapsed" $OUT/time.txt
