"""Host time per stage of the engine's zero-copy save calls (4 batches of 256 MiB, 16 KiB pages,
scattered), first call vs later ones, after a synchronize as in the bench."""
import statistics, time, collections, torch
from umbp.pool import Arena
from umbp.tools import bench_transfer as bt
from umbp.transfer import kernel as K, api as A
GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
arena = Arena(2 * GiB + 64 * MiB, pinned=True, prefault=False)
page = 16 * KiB
groups = bt._layouts(page, 2 * (GiB // (4 * page)) + 8, "cuda")
case = bt.Case("16 KiB scattered", groups, arena, GiB, 4, seed=page)
eng = bt._engine(arena, groups, "zero-copy", None)
acc = collections.defaultdict(list)
cur = {"call": 0}
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **kw):
        t0 = time.perf_counter()
        try:
            return f(*a, **kw)
        finally:
            acc[(cur["call"], name)].append(time.perf_counter() - t0)
    setattr(cls, name, g)
for n in ("_checked", "_path", "_plan", "_fetch", "_copy", "_finish", "_save", "_host_buffer"):
    wrap(K.KernelEngine if hasattr(K.KernelEngine, n) else A.TransferEngine, n)
wrap(A.TransferEngine, "save")
saves = case.sets[0]
for rep in range(8):
    torch.cuda.synchronize()
    time.sleep(0.01)
    t0 = time.perf_counter()
    hs = []
    for i, b in enumerate(saves):
        cur["call"] = i if rep >= 3 else -1
        hs.append(eng.save(b))
    [h.wait() for h in hs]
    if rep >= 3:
        acc[("total", "wall")].append(time.perf_counter() - t0)
for i in range(4):
    print(f"call {i}: " + "  ".join(f"{n} {statistics.median(acc[(i, n)]) * 1e3:.3f}" for n in
          ("save", "_checked", "_path", "_host_buffer", "_plan", "_fetch", "_copy", "_finish") if acc[(i, n)]), flush=True)
print("wall ms", statistics.median(acc[("total", "wall")]) * 1e3)
