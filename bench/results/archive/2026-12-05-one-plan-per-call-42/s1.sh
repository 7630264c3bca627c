#!/bin/bash
# on the device, with _base/ = `git archive e601908 src setup.py pyproject.toml` (the engine before) beside the tree:
# GPU tests, then `umbp bench restore` at the engine before and now, alternating processes, twice; the
# 8K profile. Run at the one-plan engine without the C copy call (1-*: its test list had no
# test_transfer_copies.py and its bench wrote into $OUT, whose file limit dropped new-2.txt, pytest.txt
# and the timeline) and at the code committed (2-*)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
(cd _base && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
PYTHONPATH=$PWD/src timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py tests/unit/test_cuda_timing.py tests/unit/test_transfer_copies.py > $OUT/pytest.txt 2>&1
tail -1 $OUT/pytest.txt; grep "FAILED\|Error" $OUT/pytest.txt | head -20
mkdir -p /tmp/r
for i in 1 2; do
  (cd _base && PYTHONPATH=$PWD/src timeout 100 python3 -m umbp bench restore > $OUT/base-$i.txt 2>&1); echo base $i; tail -8 $OUT/base-$i.txt | cut -c1-200 | head -7
  PYTHONPATH=$PWD/src timeout 100 python3 -m umbp bench restore --out /tmp/r/new-$i.json > $OUT/new-$i.txt 2>&1; echo new $i; tail -8 $OUT/new-$i.txt | cut -c1-200 | head -7
done
cp /tmp/r/new-2.json $OUT/
PYTHONPATH=$PWD/src python3 bench/probes/restore_cprofile_gpu.py 8192 200 2>&1 | grep -v Warn > $OUT/cprofile-8k.txt
