#!/usr/bin/env bash
# the 2026-12-03 work: the committed code's umbp bench ssd, 3 full runs (and which kind of host: memprobe)
PY=python3
INC=$($PY -c "import sysconfig;print(sysconfig.get_paths()['include'])")
SUF=$($PY -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
cc -O3 -std=c11 -shared -fPIC -I"$INC" src/umbp/pool/_native.c -o src/umbp/pool/_native$SUF || { echo BUILD FAILED; exit 1; }
export UMBP_REQUIRE_NATIVE=1 PYTHONPATH=$PWD/src
git log --oneline -1 2>/dev/null; nproc; uptime; df -T /tmp | tail -1
timeout 60 $PY bench/probes/memprobe.py 2>&1 | grep -E "threads 1|python" | head -3
for k in ${RUNS:-1 2 3}; do echo "== bench ssd $k"; timeout 150 $PY -m umbp bench ssd --dir /tmp/umbp-ssd --out $OUT/ssd-$k.json 2>&1 | grep -E "^write|^read|disk =|umbp bench ssd:"; done
