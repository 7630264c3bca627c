"""Where an idle 8K restore loses time at its two ends, on the device's clock (medians of 41): (1) a copy
of the early objects' bytes issued on the engine's copy stream right after a start event on the caller's
stream vs on the caller's stream itself (does a second stream's first copy start later?); one copy of
three objects' bytes vs three copies; (2) the host time of a load's completion: waiting for its event
vs reading its result once the event is done, and the caching allocator's alloc/free of a plan buffer."""

import statistics
import time

import numpy as np
import torch

from umbp.tools import bench_restore as B
from umbp.transfer.rounds import LOAD

r = B.Restore(8192)
e = r.engine
save_batch, batch, nbytes = r.prepare(8192)
e.load(batch).result()
copy = e._main(LOAD)
nb, offs = e._early_offsets(batch)
stg = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
caller = torch.cuda.current_stream()
print(torch.cuda.get_device_name(), f"early objects {len(offs)} x {nb} B")


def span(stream, pieces, reps=41):
    out = []
    for i in range(reps + 5):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(caller)
        h = stream.cuda_stream
        for k, (o, n) in enumerate(pieces):
            e._copy_one(stg.data_ptr() + k * n, e.arena_base + o, n, h)
        b.record(stream)
        b.synchronize()
        if i >= 5:
            out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


three = [(o, nb) for o in offs]
one = [(offs[0], nb * len(offs))]
for name, stream in (("caller stream", caller), ("engine copy stream", copy)):
    for what, pieces in (("3 copies", three), ("1 copy, same bytes", one), ("1 object", three[:1])):
        print(f"  {name:<20} {what:<20} start -> copied {span(stream, pieces):8.1f} us")


def host(fn, reps=201):
    out = []
    for i in range(reps + 20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if i >= 20:
            out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def finish(part):
    """Host time of the completion step alone, the device done and the host hot (no sleep: spinning on
    the event's query instead)."""
    h = e.load(batch)
    while not h._event.query():
        pass
    t0 = time.perf_counter()
    if part == "wait":
        h.wait()
    elif part == "flat":
        h.wait()
        t0 = time.perf_counter()
        h._flat()
    else:
        h.result()
    return time.perf_counter() - t0


for part in ("wait", "flat", "result"):
    got = statistics.median(finish(part) for _ in range(101)) * 1e6
    print(f"  load {part} after its event is done: {got:6.1f} us")
plan_host = torch.empty(256, dtype=torch.int64, pin_memory=True)
print(f"  plan buffer alloc+free on the device  {host(lambda: torch.empty_like(plan_host, device='cuda')):6.1f} us")
ev = torch.cuda.Event()
ev.record(caller)
torch.cuda.synchronize()
print(f"  event.synchronize (done)              {host(ev.synchronize):6.1f} us")
print(f"  torch.cuda.Event()                     {host(torch.cuda.Event):6.1f} us")
print(f"  Event().record(copy)                   {host(lambda: torch.cuda.Event().record(copy)):6.1f} us")
