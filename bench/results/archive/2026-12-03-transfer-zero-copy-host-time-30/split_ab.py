"""A/B in one process: dma copies of a round on 1 vs 2 streams per direction (copy_streams)."""
import torch
from umbp.pool import Arena
from umbp.tools import bench_transfer as bt

KiB, MiB = 1 << 10, 1 << 20
payload, reps = 1024 * MiB, 5
base = bt.baseline(reps)
print("baseline", {k: round(v, 1) for k, v in base.items()}, flush=True)
arena = Arena(2 * payload + 64 * MiB, pinned=True, prefault=False)
cases = []
for page, slots in ((16 * KiB, "scattered"), (64 * KiB, "scattered"), (16 * KiB, "runs"), (64 * KiB, "runs")):
    nobj = payload // (4 * page)
    groups = bt._layouts(page, 2 * nobj + 8, "cuda")
    case = bt.Case(f"kv-first {page // KiB} KiB {slots}", groups, arena, payload, 4, seed=page, slots=slots)
    for rnd in range(2):
        for path in ("dma", "auto"):
            for k in (1, 2):
                eng = bt._engine(arena, groups, path, None, copy_streams=k)
                r = bt.measure(eng, case, reps, ("save", "load", "load_verified", "both"))
                print(f"{case.name:28s} {path:5s} streams={k}  save {r['save'] / base['d2h']:.3f}  load {r['load'] / base['h2d']:.3f}  "
                      f"ver {r['load_verified'] / base['h2d']:.3f}  both {r['both']:.1f}  x4 {r['both_sustained']:.1f}  ok {r['sample_ok']}", flush=True)
                del eng
    del groups, case
    torch.cuda.empty_cache()
