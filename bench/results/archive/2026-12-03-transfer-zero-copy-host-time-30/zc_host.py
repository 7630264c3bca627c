import statistics, time, torch
from umbp.pool import Arena
from umbp.tools import bench_transfer as bt
GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
arena = Arena(2 * GiB + 64 * MiB, pinned=True, prefault=False)
page = 16 * KiB
groups = bt._layouts(page, 2 * (GiB // (4 * page)) + 8, "cuda")
base = bt.baseline(5)
print("baseline", {k: round(v, 1) for k, v in base.items()}, flush=True)
for slots in ("runs", "scattered"):
    case = bt.Case("16 KiB " + slots, groups, arena, GiB, 4, seed=page, slots=slots)
    for batches in (1, 4, 16):
        case._cut = None
        c2 = bt.Case("16 KiB " + slots, groups, arena, GiB, batches, seed=page, slots=slots)
        eng = bt._engine(arena, groups, "zero-copy", None)
        saves = c2.sets[0]
        for _ in range(3):
            hs = [eng.save(b) for b in saves]
            [h.wait() for h in hs]
        rows = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hs, ts = [], []
            for b in saves:
                hs.append(eng.save(b))
                ts.append(time.perf_counter() - t0)
            ev = torch.cuda.Event(); ev.record(eng.streams[0])
            [h.wait() for h in hs]
            t1 = time.perf_counter() - t0
            rows.append((t1, ts[0], ts[-1]))
        t1, first, last = (statistics.median(x) for x in zip(*rows))
        print(f"{slots:9s} batches {batches:2d}: {GiB / t1 / 1e9:.1f} GB/s ({GiB / t1 / 1e9 / base['d2h']:.3f}); host: first call returned "
              f"{first * 1e3:.2f} ms, last {last * 1e3:.2f} ms, total {t1 * 1e3:.2f} ms", flush=True)
