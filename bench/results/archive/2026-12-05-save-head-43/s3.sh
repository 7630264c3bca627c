#!/bin/bash
# the same machine: where an 8K save's time goes with the head (host steps timed; device ops queued
# behind a sleep), and cProfile's own time per function
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
timeout 120 python3 bench/probes/restore_timeline_gpu.py 8192,32768 host 2>&1 | grep -v Warn > $OUT/3-timeline-host.txt
timeout 120 python3 bench/probes/restore_timeline_gpu.py 8192 queued 2>&1 | grep -v Warn > $OUT/3-timeline-queued.txt
timeout 150 python3 bench/probes/restore_cprofile_gpu.py 8192 300 2>&1 | grep -v Warn > $OUT/3-cprofile.txt
grep -A14 "save, 8192" $OUT/3-timeline-host.txt
