#!/bin/bash
# the engine as committed (head-first-run.patch not adopted: s1's A/B saw no gain): the save head's size
# side by side (4, 8, 32 MiB beside the default 16), 31 interleaved calls per size, and an 8K queued
# timeline (the device's own share of a save, and where the copy engine idles)
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "build failed"
PYTHONPATH=$PWD/src timeout 200 python3 bench/probes/restore_ab_gpu.py 8192,16384,131072 31 head4=save_head_bytes:4194304 head8=save_head_bytes:8388608 head32=save_head_bytes:33554432 2>&1 | grep -v Warn | tee $OUT/2-ab.txt | grep "==\|save"
PYTHONPATH=$PWD/src timeout 120 python3 bench/probes/restore_timeline_gpu.py 8192 queued 2>&1 | grep -v Warn > $OUT/2-timeline-queued.txt; grep -A40 "save" $OUT/2-timeline-queued.txt | head -45
