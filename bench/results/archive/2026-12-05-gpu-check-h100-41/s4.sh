#!/bin/bash
# on the device (warm after s3.sh of archive 40, same H100 host, same tree): round-size, tail-round and
# early-copy knobs against the defaults, interleaved call by call; two more official restore runs; the
# host-side and queued timelines of an 8K restore
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1  # (already built by s3.sh on that machine)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
python3 bench/probes/restore_ab_gpu.py 8192,16384 41 r8=min_round_bytes:8388608 r32=min_round_bytes:33554432 tail0=tail_round_bytes:0 noearly=.early_bytes:0 2>&1 | grep -v Warn > $OUT/ab-1.txt
python3 bench/probes/restore_ab_gpu.py 8192,16384,32768,131072 41 r32=min_round_bytes:33554432 r32t0=min_round_bytes:33554432,tail_round_bytes:0 r32t0ne=min_round_bytes:33554432,tail_round_bytes:0,.early_bytes:0 r64t0=min_round_bytes:67108864,tail_round_bytes:0 2>&1 | grep -v Warn > $OUT/ab-2.txt
for i in 2 3; do python3 -m umbp bench restore --out $OUT/restore-$i.json > $OUT/restore-$i.txt 2>&1; done
python3 bench/probes/restore_timeline_gpu.py 8192,32768 host 2>&1 | grep -v Warn > $OUT/timeline-host.txt
python3 bench/probes/restore_timeline_gpu.py 8192 queued 2>&1 | grep -v Warn > $OUT/timeline-queued.txt
# a later call, on another H100 machine, at dd59e08 (the bench's host column): GPU timing tests, one restore run
#   python3 -m pytest -q -p no:cacheprovider tests/unit/test_cuda_timing.py   # 6 passed
#   python3 -m umbp bench restore --out $OUT/restore.json > $OUT/restore.txt   # -> restore-host-column.*
