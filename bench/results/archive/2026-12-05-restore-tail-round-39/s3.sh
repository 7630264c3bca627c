#!/bin/bash
# on the device, at the early-saves commit: GPU tests; the official restore run; the engine (early loads
# and saves) vs 66d4dd3 (.gpuwt/old as umbp_old) and 04d100e (early loads only; .gpuwt/prev as umbp_prev),
# interleaved call by call; the official transfer run; host steps and a queued timeline at 8K; the Granite
# rows with paths repeated, with and without gc.freeze before each row (bench/probes/transfer_gc_gpu.py)
set -u
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
for t in old prev; do for so in $(find src -name '_*.so'); do cp $so .gpuwt/$t/src/umbp_$t/${so#src/umbp/}; done; done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/.gpuwt/old/src:$PWD/.gpuwt/prev/src
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_roundtrip.py tests/unit/test_transfer_geometry.py tests/unit/test_worker_cuda.py tests/unit/test_transfer_plan_shapes.py tests/unit/test_transfer_checks.py tests/unit/test_gpu_stand_in.py > $OUT/pytest.txt 2>&1
tail -1 $OUT/pytest.txt
timeout 100 python3 -m umbp bench restore --out $OUT/restore.json > $OUT/restore.txt 2>&1; tail -8 $OUT/restore.txt | cut -c1-112
timeout 150 python3 bench/probes/restore_ab_gpu.py 8192,16384,32768,65536,131072 41 old=@umbp_old prev=@umbp_prev 2>&1 | grep -v Warn | tee $OUT/3-probes.txt | grep "==\|load\|save"
timeout 230 python3 -m umbp bench transfer --out $OUT/transfer.json --sweep-blocks "" > $OUT/transfer.txt 2>&1; grep -i "baseline\|granite" $OUT/transfer.txt | cut -c1-220
timeout 60 python3 bench/probes/restore_timeline_gpu.py 8192 host 2>&1 | grep -v "Warn\|warn" > /tmp/steps.txt
grep "first copy\|wall" /tmp/steps.txt; cat /tmp/steps.txt >> $OUT/3-probes.txt
timeout 60 python3 bench/probes/restore_timeline_gpu.py 8192 queued 2>&1 | grep -v "Warn\|warn" >> $OUT/3-probes.txt
for f in "" freeze; do echo "== gc probe ${f:-plain}"; timeout 90 python3 bench/probes/transfer_gc_gpu.py $f -- --only granite --no-staged --paths dma,auto,dma,auto --sweep-ctas "" --sweep-blocks "" --out /tmp/gc$f.json 2>&1 | grep -i "\[gc\]\|granite" | cut -c1-220; done 2>&1 | tee -a $OUT/3-probes.txt
