#!/bin/bash
# the next call, same machine: the engine before imported as umbp_base beside the engine now, and round-size
# knobs, interleaved call by call in one process (3-ab.txt)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
(cd _base && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
rm -rf /tmp/ab && mkdir -p /tmp/ab && cp -r _base/src/umbp /tmp/ab/umbp_base
find /tmp/ab/umbp_base -name "*.py" -print0 | xargs -0 sed -i -E 's/\bumbp\./umbp_base./g; s/^(\s*)from umbp import/\1from umbp_base import/; s/^(\s*)import umbp$/\1import umbp_base/'
grep -rn "from umbp \|import umbp\b\|\"umbp\.\|'umbp\." /tmp/ab/umbp_base | grep -v umbp_base | head -5
PYTHONPATH=$PWD/src:/tmp/ab timeout 500 python3 bench/probes/restore_ab_gpu.py 8192,16384,32768,131072 31 base=@umbp_base r8=min_round_bytes:8388608 r4=min_round_bytes:4194304 r32=min_round_bytes:33554432 2>&1 | grep -v Warn | tee $OUT/ab.txt
# the next two calls, same machine: device-only and host-side timelines of an 8K restore and save (4-*)
#   PYTHONPATH=$PWD/src python3 bench/probes/restore_timeline_gpu.py 8192 queued   # -> 4-timeline-queued.txt
#   PYTHONPATH=$PWD/src python3 bench/probes/restore_timeline_gpu.py 8192 host     # -> 4-timeline-host.txt
# before any change (0-*), on the first machine of the day, at e601908:
#   python3 bench/probes/restore_cprofile_gpu.py 8192 200; python3 bench/probes/restore_timeline_gpu.py 8192 host
