#!/usr/bin/env bash
# the 2026-12-03 work, device call: SSD format 2 (group heads) vs format 1 (1db80bc), bench ssd rows alternated
PY=python3
INC=$($PY -c "import sysconfig;print(sysconfig.get_paths()['include'])")
SUF=$($PY -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
for d in src scratch_gpu/old15/src; do
  cc -O3 -std=c11 -shared -fPIC -I"$INC" $d/umbp/pool/_native.c -o $d/umbp/pool/_native$SUF || { echo BUILD FAILED; exit 1; }
done
export UMBP_REQUIRE_NATIVE=1
nproc; uptime; df -T /tmp | tail -1
SIZES=${SIZES:-64,256}
RUNS=${RUNS:-"old new old new old new old new"}
k=0
for v in $RUNS; do
  k=$((k+1))
  if [ $v = old ]; then P=scratch_gpu/old15/src; else P=src; fi
  echo "== $v (run $k)"
  PYTHONPATH=$P timeout 150 $PY scratch_gpu/ab15.py $SIZES $OUT/ab-$v-$k.json 2>&1 | grep -E "^write|^read|disk =|rror"
done
