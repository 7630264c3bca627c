#!/bin/bash
# the head's default now 16 MiB, its copy sizes cached: against none, 8 and 32 MiB (31 repetitions);
# the GPU tests; the host timeline of an 8K save; the official restore and transfer runs
set -u
nvidia-smi --query-gpu=name,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
timeout 100 python3 bench/probes/restore_ab_gpu.py 8192,16384,32768,131072 31 head0=save_head_bytes:0 head8=save_head_bytes:8388608 head32=save_head_bytes:33554432 2>&1 | grep -v Warn | tee $OUT/4-ab.txt | grep "==\|save"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py tests/unit/test_cuda_timing.py tests/unit/test_transfer_copies.py > $OUT/4-pytest.txt 2>&1
tail -1 $OUT/4-pytest.txt; grep "FAILED\|Error" $OUT/4-pytest.txt | head -20
timeout 40 python3 bench/probes/restore_timeline_gpu.py 8192 host 2>&1 | grep -v Warn | grep -A15 "save, 8192"
timeout 110 python3 -m umbp bench restore --out $OUT/restore.json > $OUT/restore.txt 2>&1; tail -9 $OUT/restore.txt | cut -c1-150
timeout 230 python3 -m umbp bench transfer --out $OUT/transfer.json --sweep-blocks "" > $OUT/transfer.txt 2>&1; grep -i "baseline\|granite\|error" $OUT/transfer.txt | cut -c1-220
