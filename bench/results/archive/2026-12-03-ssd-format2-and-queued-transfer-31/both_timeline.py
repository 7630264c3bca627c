"""Probe (the 2026-12-03 work): where a queued both-ways pass loses time, Granite-4.0-H vs attention 16 KiB, slots in
runs, auto path. One pass (1 GiB each way in 4 batches, saves and loads issued alternately) behind a sleep
kernel, under torch.profiler: per direction, when its copy engine starts and ends relative to the sleep's
end, how busy it is, its gaps; the kernels' total time."""
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from umbp.pool import Arena
from umbp.tools import bench_transfer as bt
from umbp.transfer import layouts as L

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
payload = GiB
arena = Arena(2 * payload + 64 * MiB, pinned=True, prefault=False)
print("baseline", {k: round(v, 1) for k, v in bt.baseline(5).items()})


def cases():
    groups = bt._layouts(16 * KiB, 2 * (payload // (64 * KiB)) + 8, "cuda")
    yield bt.Case("attention 16 KiB runs", groups, arena, payload, 4, seed=16, slots="runs")
    s = L.granite_sizes()
    nobj = payload // (s["page_bytes"] * s["attention_layers"])
    groups, _ = L.granite_hybrid(2 * nobj + 16, device="cuda")
    yield bt.Case("granite runs", groups, arena, payload, 4, seed=7, slots="runs")


for case in cases():
    eng = bt._engine(arena, case.groups, "auto", None)
    saves, loads = case.sets
    for b in loads:
        eng.save(b).result()
    print(f"== {case.name}: groups {len(case.groups)}, moves per batch {[len(b) for b in saves]}, "
          f"objects/batch {sum(len(m.block_ids) for m in saves[0])}")

    def issue():
        hs = []
        for k in range(max(len(saves), len(loads))):
            hs += [eng.save(saves[k]), eng.load(loads[k])]
        return hs

    for _ in range(2):
        for h in issue():
            h.wait()
    # plain queued timings first (no profiler)
    ts = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(bt.QUEUE_CYCLES)
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for h in issue():
            h.wait()
        z.record()
        z.synchronize()
        ts.append(a.elapsed_time(z))
    print(f"queued both: {2 * case.payload / statistics.median(ts) / 1e6:.1f} GB/s (median of {ts})")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(bt.QUEUE_CYCLES)
        for h in issue():
            h.wait()
        torch.cuda.synchronize()
    import os
    prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "/tmp"), case.name.replace(" ", "_") + ".json"))
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    sleep = [e for e in evs if "sleep" in e.name.lower()]
    t0 = max(e.time_range.end for e in sleep) if sleep else min(e.time_range.start for e in evs)
    kinds = {}
    for e in evs:
        if e in sleep:
            continue
        n = e.name
        key = "DtoH" if "DtoH" in n else "HtoD" if "HtoD" in n else n[:40]
        kinds.setdefault(key, []).append((e.time_range.start - t0, e.time_range.end - t0))
    for key, iv in sorted(kinds.items(), key=lambda kv: -sum(e - s for s, e in kv[1])):
        iv.sort()
        busy = sum(e - s for s, e in iv)
        gaps = [(round(iv[i][1] / 1e3, 2), round((iv[i + 1][0] - iv[i][1]) / 1e3, 3)) for i in range(len(iv) - 1)
                if iv[i + 1][0] - iv[i][1] > 30]
        print(f"  {key:40s} n={len(iv):4d} first {iv[0][0] / 1e3:7.2f} ms  last end {max(e for _, e in iv) / 1e3:7.2f} ms"
              f"  busy {busy / 1e3:7.2f} ms  gaps>30us {len(gaps)} sum {sum(g for _, g in gaps):.2f} ms {gaps[:8]}")
    del eng
    torch.cuda.empty_cache()
