#!/bin/bash
# where an idle 8K-128K save's and load's wall time goes on the device's own clock (timing events, no
# profiler): bench/probes/save_events_gpu.py, 31 calls per size
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "build failed"
PYTHONPATH=$PWD/src timeout 200 python3 bench/probes/save_events_gpu.py 8192,16384,131072 31 2>&1 | grep -v Warn | tee $OUT/3-events.txt
