#!/bin/bash
# a cold restore's last verify + scatter on the copy stream, and launches between KV pages and staging
# in parts of pieces (hbm_split), beside the engine of d819186 (umbp_base) and each change alone,
# interleaved; where an 8K restore's time goes (queued device timeline, device-clock events, host steps);
# the official restore run; the GPU tests; on an H200 also the Granite rows of umbp bench transfer
set -u
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
export PYTHONUNBUFFERED=1
A=bench/results/archive/2026-12-06-restore-tail-split-48
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "build failed"
(cd _base && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
rm -rf /tmp/ab && mkdir -p /tmp/ab && cp -r _base/src/umbp /tmp/ab/umbp_base
find /tmp/ab/umbp_base -name "*.py" -print0 | xargs -0 sed -i -E 's/\bumbp\./umbp_base./g; s/^(\s*)from umbp import/\1from umbp_base import/; s/^(\s*)import umbp$/\1import umbp_base/'
PYTHONPATH=$PWD/src:/tmp/ab timeout 240 python3 bench/probes/restore_ab_gpu.py 8192,16384,131072 41 base=@umbp_base tailwork=.cold_tail_on_copy:0 split1=hbm_split:1 split2=hbm_split:2 split8=hbm_split:8 2>&1 | grep -v Warn | tee $OUT/1-ab.txt | grep "==\|save\|load"
PYTHONPATH=$PWD/src timeout 60 python3 $A/steps.py > $OUT/1-steps.txt 2>&1; cat $OUT/1-steps.txt | grep -v Warn
PYTHONPATH=$PWD/src timeout 60 python3 bench/probes/save_events_gpu.py 8192 31 2>&1 | grep -v Warn > $OUT/1-events.txt; grep "load\|h2d" $OUT/1-events.txt
PYTHONPATH=$PWD/src timeout 60 python3 bench/probes/restore_timeline_gpu.py 8192 queued 2>&1 | grep -v Warn > $OUT/1-timeline-queued.txt; grep -A40 "verified load" $OUT/1-timeline-queued.txt | grep -v "host " | tail -14
PYTHONPATH=$PWD/src timeout 100 python3 -m umbp bench restore --out $OUT/1-restore.json > $OUT/1-restore.txt 2>&1; tail -9 $OUT/1-restore.txt | cut -c1-112
PYTHONPATH=$PWD/src timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py tests/unit/test_cuda_timing.py tests/unit/test_transfer_copies.py > $OUT/1-pytest.txt 2>&1
tail -1 $OUT/1-pytest.txt; grep "FAILED\|Error" $OUT/1-pytest.txt | head -20
case "$GPU" in *H200*)
PYTHONPATH=$PWD/src timeout 200 python3 -m umbp bench transfer --only granite --no-staged --out $OUT/1-transfer-granite.json > $OUT/1-transfer-granite.txt 2>&1; grep -i "baseline\|granite" $OUT/1-transfer-granite.txt | cut -c1-200;;
esac
