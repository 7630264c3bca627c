"""Probe: the engine's zero-copy kernel at other BLOCK x num_warps, 16 KiB and 64 KiB pages, scattered and
runs; save / load / both, 2 rounds alternated, 1 GiB per direction, median of 5."""
import torch
from umbp.pool import Arena
from umbp.tools import bench_transfer as bt

KiB, MiB = 1 << 10, 1 << 20
payload, reps = 1024 * MiB, 5
base = bt.baseline(reps)
print("baseline", {k: round(v, 1) for k, v in base.items()}, flush=True)
arena = Arena(2 * payload + 64 * MiB, pinned=True, prefault=False)
for page, slots in ((16 * KiB, "scattered"), (16 * KiB, "runs"), (64 * KiB, "scattered")):
    nobj = payload // (4 * page)
    groups = bt._layouts(page, 2 * nobj + 8, "cuda")
    case = bt.Case(f"{page // KiB} KiB {slots}", groups, arena, payload, 4, seed=page, slots=slots)
    cfgs = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16))
    engs = {c: bt._engine(arena, groups, "zero-copy", None, block=c[0], num_warps=c[1]) for c in cfgs}
    for rnd in range(2):
        for c in cfgs:
            r = bt.measure(engs[c], case, reps, ("save", "load", "load_verified", "both"))
            print(f"{case.name:18s} {c[0]}x{c[1]:<2d} save {r['save'] / base['d2h']:.3f}  load {r['load'] / base['h2d']:.3f}  "
                  f"ver {r['load_verified'] / base['h2d']:.3f}  both {r['both']:.1f}  x4 {r['both_sustained']:.1f}  ok {r['sample_ok']}",
                  flush=True)
    del engs, groups, case
    torch.cuda.empty_cache()
