# reserve+commit one key at a time vs reserve_many of B keys then B commits (the vLLM scheduler saves a job's keys
# with reserve_many), n objects filled, no eviction: us per key. python many.py N B
import time, sys
from umbp.pool.dram.index import DramIndex
n=int(sys.argv[1]); B=int(sys.argv[2]); ALIGN=4096
cap = -(-n * 100 // 94) * ALIGN
keys=[f"umbp/g0/{i:064x}" for i in range(n)]
pc=time.perf_counter
for mode in ("single","many"):
    ix=DramIndex(cap, alignment=ALIGN, keep_keys=False, max_evict_objects=1024, expected_objects=cap//ALIGN)
    t=pc()
    if mode=="single":
        for k in keys: ix.reserve(k,ALIGN); ix.commit(k)
    else:
        for lo in range(0,n,B):
            ks=keys[lo:lo+B]; ix.reserve_many(ks,ALIGN)
            for k in ks: ix.commit(k)
    print(mode, B, round((pc()-t)/n*1e6,3))
