#!/bin/bash
# on the device: a cold dma save's head (head.py, save_head_bytes default 8 MiB) against none, 4 and
# 16 MiB, interleaved call by call in one process (31 repetitions per size); then the GPU tests
set -u
nvidia-smi --query-gpu=name,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
timeout 230 python3 bench/probes/restore_ab_gpu.py 8192,16384,32768,131072 31 head0=save_head_bytes:0 head4=save_head_bytes:4194304 head16=save_head_bytes:16777216 2>&1 | grep -v Warn | tee $OUT/1-ab.txt | grep "==\|save"
timeout 260 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py tests/unit/test_cuda_timing.py tests/unit/test_transfer_copies.py > $OUT/1-pytest.txt 2>&1
tail -1 $OUT/1-pytest.txt; grep "FAILED\|Error" $OUT/1-pytest.txt | head -20
