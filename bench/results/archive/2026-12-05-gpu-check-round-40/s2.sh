#!/bin/bash
# on the device, with test_worker_cuda's loads given distinct blocks per group, and a cold dma save's head
# copied by the copy engines straight from its KV pages (head.py; save_head_bytes, default 8 MiB; the
# zero-copy head of s1.sh dropped): GPU tests; the head against none, 4 and 16 MiB, and whole batches under
# 128 MiB zero-copy, interleaved call by call; the official restore and transfer runs
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py tests/unit/test_cuda_timing.py > $OUT/pytest.txt 2>&1
tail -1 $OUT/pytest.txt; grep "FAILED\|Error" $OUT/pytest.txt | head -20
timeout 150 python3 bench/probes/restore_ab_gpu.py 8192,16384,32768,131072 41 head0=save_head_bytes:0 head4=save_head_bytes:4194304 head16=save_head_bytes:16777216 zc=dma_min_batch_bytes:134217728 2>&1 | grep -v Warn | tee $OUT/ab.txt | grep "==\|save\|load zc"
timeout 100 python3 -m umbp bench restore --out $OUT/restore.json > $OUT/restore.txt 2>&1; tail -8 $OUT/restore.txt | cut -c1-112
timeout 260 python3 -m umbp bench transfer --out $OUT/transfer.json --sweep-blocks "" > $OUT/transfer.txt 2>&1; grep -i "baseline\|granite\|error" $OUT/transfer.txt | cut -c1-220
