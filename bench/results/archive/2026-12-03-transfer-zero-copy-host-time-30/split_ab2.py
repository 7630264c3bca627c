"""A/B in one process, alternated 5x: dma path on 1 vs 2 copy streams per direction; both-ways focus."""
import statistics
import torch
from umbp.pool import Arena
from umbp.tools import bench_transfer as bt

KiB, MiB = 1 << 10, 1 << 20
payload, reps = 1024 * MiB, 5
base = bt.baseline(reps)
print("baseline", {k: round(v, 1) for k, v in base.items()}, flush=True)
arena = Arena(2 * payload + 64 * MiB, pinned=True, prefault=False)
for page in (16 * KiB, 64 * KiB, 256 * KiB):
    nobj = payload // (4 * page)
    groups = bt._layouts(page, 2 * nobj + 8, "cuda")
    case = bt.Case(f"kv-first {page // KiB} KiB scattered", groups, arena, payload, 4, seed=page)
    engs = {k: bt._engine(arena, groups, "dma", None, copy_streams=k) for k in (1, 2)}
    res = {k: {} for k in (1, 2)}
    for rnd in range(5):
        for k in (1, 2):
            r = bt.measure(engs[k], case, reps, ("save", "load", "both"))
            for m in ("save", "load", "both", "both_sustained"):
                res[k].setdefault(m, []).append(r[m])
            assert r["sample_ok"] == 1.0
    for k in (1, 2):
        print(f"{case.name:26s} dma streams={k}: " + "  ".join(
            f"{m} med {statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]" for m, v in res[k].items()), flush=True)
    del engs, groups, case
    torch.cuda.empty_cache()
