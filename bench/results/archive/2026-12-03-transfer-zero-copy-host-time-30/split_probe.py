"""Probe: one direction's batch split between the zero-copy kernel (SMs) and the dma path (copy engine),
both at once, for scattered arena slots. Same process, same case, fractions alternated."""
import sys
import time

import torch

from umbp.pool import Arena
from umbp.transfer import Moves, make_engine
from umbp.tools import bench_transfer as bt

KiB, MiB = 1 << 10, 1 << 20
payload = 1024 * MiB
reps = 5
ctas_zc = int(sys.argv[1]) if len(sys.argv) > 1 else 66
base = bt.baseline(reps)
print("baseline", {k: round(v, 1) for k, v in base.items()}, flush=True)
arena = Arena(2 * payload + 64 * MiB, pinned=True, prefault=False)


def cut(m: Moves, f: float) -> tuple[Moves, Moves]:
    k = int(round(len(m.block_ids) * f))
    a = Moves(m.group, m.block_ids[:k], m.offsets[:k], None if m.digests is None else m.digests[:k], m.slot_bytes)
    b = Moves(m.group, m.block_ids[k:], m.offsets[k:], None if m.digests is None else m.digests[k:], m.slot_bytes)
    return a, b


for page in (16 * KiB, 64 * KiB):
    nobj = payload // (4 * page)
    groups = bt._layouts(page, 2 * nobj + 8, "cuda")
    case = bt.Case(f"kv-first {page // KiB} KiB scattered", groups, arena, payload, 4, seed=page)
    zc = make_engine(arena, groups, backend="kernel", save_path="zero-copy", load_path="zero-copy", ctas=ctas_zc)
    dm = make_engine(arena, groups, backend="kernel", save_path="dma", load_path="dma")
    saves, loads = case.sets
    digests = [dm.save(b).result() for b in loads]
    verified = bt._with_digests(loads, digests)

    def fn(sets, f, op):
        def go():
            hs = []
            for batch in sets:
                pa, pb = [], []
                for m in batch:
                    a, b = cut(m, f)
                    pa.append(a)
                    pb.append(b)
                if f > 0:
                    hs.append(getattr(zc, op)(pa))
                if f < 1:
                    hs.append(getattr(dm, op)(pb))
            for h in hs:
                h.wait()
        return go

    fracs = (0.0, 0.3, 0.45, 0.6, 0.75, 1.0)
    res = {(op, f): [] for op in ("save", "load", "load_v") for f in fracs}
    for _ in range(3):
        for f in fracs:
            res[("save", f)].append(payload / bt._wall(fn(saves, f, "save"), reps) / 1e9)
            res[("load", f)].append(payload / bt._wall(fn(loads, f, "load"), reps) / 1e9)
            res[("load_v", f)].append(payload / bt._wall(fn(verified, f, "load"), reps) / 1e9)
    for op, key in (("save", "d2h"), ("load", "h2d"), ("load_v", "h2d")):
        line = " ".join(f"f={f}: {max(res[(op, f)]):.1f}/{sorted(res[(op, f)])[1]:.1f} ({sorted(res[(op, f)])[1] / base[key]:.3f})"
                        for f in fracs)
        print(f"{page // KiB} KiB {op:6s} [zero-copy fraction f: max/median GB/s (median ratio)] {line}", flush=True)
    ok = bt.check_sample(dm, case, verified)
    print("sample ok", ok, flush=True)
    del zc, dm, groups, case
    torch.cuda.empty_cache()
