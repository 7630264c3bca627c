"""A/B in one process: KernelEngine._headed on (HEAD_BYTES 64 MiB) vs off (HEAD_BYTES huge), rows of
umbp bench transfer (1 GiB per direction in 4 batches, median of 5), 3 rounds alternated."""
import statistics
import torch
from umbp.pool import Arena
from umbp.tools import bench_transfer as bt
from umbp.transfer import kernel as K

KiB, MiB = 1 << 10, 1 << 20
payload, reps = 1024 * MiB, 5
base = bt.baseline(reps)
print("baseline", {k: round(v, 1) for k, v in base.items()}, flush=True)
arena = Arena(2 * payload + 64 * MiB, pinned=True, prefault=False)
for page, slots, path in ((16 * KiB, "scattered", "auto"), (16 * KiB, "runs", "zero-copy"), (64 * KiB, "scattered", "zero-copy"),
                          (16 * KiB, "runs", "auto")):
    nobj = payload // (4 * page)
    groups = bt._layouts(page, 2 * nobj + 8, "cuda")
    case = bt.Case(f"{page // KiB} KiB {slots} {path}", groups, arena, payload, 4, seed=page, slots=slots)
    eng = bt._engine(arena, groups, path, None)
    res = {v: {} for v in ("head", "whole")}
    for rnd in range(3):
        for v, hb in (("head", 64 << 20), ("whole", 1 << 62)):
            K.HEAD_BYTES = hb
            r = bt.measure(eng, case, reps, ("save", "load", "load_verified", "both"))
            assert r["sample_ok"] == 1.0
            for m in ("save", "load", "load_verified", "both", "both_sustained"):
                res[v].setdefault(m, []).append(r[m])
    for v in res:
        d = res[v]
        print(f"{case.name:26s} {v:5s}: save {statistics.median(d['save']) / base['d2h']:.3f}  load {statistics.median(d['load']) / base['h2d']:.3f}  "
              f"ver {statistics.median(d['load_verified']) / base['h2d']:.3f}  both {statistics.median(d['both']):.1f}  "
              f"x4 {statistics.median(d['both_sustained']):.1f}   saves {[round(x / base['d2h'], 3) for x in d['save']]}", flush=True)
    del eng, groups, case
    torch.cuda.empty_cache()
