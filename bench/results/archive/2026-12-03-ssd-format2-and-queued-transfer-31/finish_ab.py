"""A/B in one process (the 2026-12-03 work): a call's results reach the host by SM stores (new _finish) vs a
copy-engine copy on the call's last stream (old). Rows of umbp bench transfer (1 GiB per direction in 4
batches), auto path; variants alternated per round, 3 rounds; ratios to the pinned copies."""
import statistics

import torch

from umbp.pool import Arena
from umbp.tools import bench_transfer as bt
from umbp.transfer import kernel as K
from umbp.transfer import layouts as L

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
payload = GiB
new_finish = K.KernelEngine._finish


def old_finish(self, batch, values, keep, mix, stream):
    sizes = [ids.size for _g, _m, ids, _o in batch]
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return K.DeviceHandle(sizes, event, host, keep, mix)


arena = Arena(2 * payload + 64 * MiB, pinned=True, prefault=False)
base = bt.baseline(5)
print("baseline", {k: round(v, 1) for k, v in base.items()})


def cases():
    for page, slots in ((16 * KiB, "runs"), (64 * KiB, "runs"), (64 * KiB, "scattered")):
        groups = bt._layouts(page, 2 * (payload // (4 * page)) + 8, "cuda")
        yield f"{page // KiB} KiB {slots}", bt.Case("c", groups, arena, payload, 4, seed=page, slots=slots)
    s = L.granite_sizes()
    groups, _ = L.granite_hybrid(2 * (payload // (s["page_bytes"] * s["attention_layers"])) + 16, device="cuda")
    for slots in ("runs", "scattered"):
        yield f"granite {slots}", bt.Case("g", groups, arena, payload, 4, seed=7, slots=slots)


for name, case in cases():
    eng = bt._engine(arena, case.groups, "auto", None)
    res = {"old": [], "new": []}
    for _ in range(3):
        for v, fn in (("old", old_finish), ("new", new_finish)):
            K.KernelEngine._finish = fn
            res[v].append(bt.measure(eng, case, 5, ("save", "load", "both")))
    K.KernelEngine._finish = new_finish
    for v, rs in res.items():
        cells = []
        for key, ref in (("save", "d2h"), ("save_queued", "d2h"), ("load", "h2d"), ("load_queued", "h2d"),
                         ("both", "both"), ("both_queued", "both"), ("both_sustained", "both")):
            vals = [r[key] / base[ref] for r in rs]
            cells.append(f"{key} {statistics.median(vals):.3f} [{min(vals):.2f}-{max(vals):.2f}]")
        print(f"{name:18s} {v}: " + "  ".join(cells) + f"  ok {all(r['sample_ok'] for r in rs)}")
    del eng
    torch.cuda.empty_cache()
