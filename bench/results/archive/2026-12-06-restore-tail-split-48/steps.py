"""Host microseconds of the steps in front of an 8K restore's first copy, on the device's host (medians of
201, the device idle before each timed step): what a C path for the early copies could save."""

import statistics
import time

import numpy as np
import torch

from umbp.tools import bench_restore as B
from umbp.transfer.ring import StagingRing
from umbp.transfer.rounds import LOAD


def med(fn, reps=201, sync=True):
    out = []
    for i in range(reps + 20):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= 20:
            out.append(dt)
    torch.cuda.synchronize()
    return statistics.median(out) * 1e6


r = B.Restore(8192)
e = r.engine
save_batch, batch, nbytes = r.prepare(8192)
e.load(batch).result()
copy = e._main(LOAD)
ev = torch.cuda.Event()
ev.record(copy)
torch.cuda.synchronize()
slot = e.ring.take(LOAD, e._ring_bytes)
nb, offs = e._early_offsets(batch)
base = slot[0].data_ptr() + e._early_at
rows = base + np.arange(len(offs), dtype=np.int64) * nb
src = np.asarray(offs, dtype=np.int64)
size = np.full(len(offs), nb, dtype=np.int64)
h = copy.cuda_stream
print(torch.cuda.get_device_name(), f"early objects {len(offs)} x {nb} B")
steps = {
    "_early_offsets": lambda: e._early_offsets(batch),
    "_idle (event query)": lambda: e._idle(LOAD),
    "event.query passed": ev.query,
    "_main": lambda: e._main(LOAD),
    "ring.take": lambda: e.ring.take(LOAD, e._ring_bytes),
    "stream.wait_event passed": lambda: copy.wait_event(ev),
    "StagingRing.acquire": lambda: StagingRing.acquire(slot, copy),
    "copy.cuda_stream": lambda: copy.cuda_stream,
    "data_ptr": lambda: slot[0].data_ptr(),
    "np.arange rows": lambda: base + np.arange(len(offs), dtype=np.int64) * nb,
    "_copy_one x1": lambda: e._copy_one(int(rows[0]), e.arena_base + offs[0], nb, h),
    "_copy_one x all": lambda: [e._copy_one(int(a), e.arena_base + o, nb, h) for a, o in zip(rows, offs)],
    "_runs_copy all (C, one by one)": lambda: e._runs_copy(0, rows, e.arena_base, src, size, h, False, False),
    "_early (whole)": lambda: e._early(batch),
    "_checked load": lambda: e._checked(batch, load=True),
    "_checked save": lambda: e._checked(save_batch, load=False),
    "load submit": lambda: e.load(batch),
    "load wall": lambda: e.load(batch).result(),
    "save submit": lambda: e.save(save_batch),
    "save wall": lambda: e.save(save_batch).result(),
}
for name, fn in steps.items():
    try:
        print(f"  {name:<34} {med(fn):8.1f} us")
    except Exception as exc:  # a step this tree lacks: say so, go on
        print(f"  {name:<34} failed: {exc!r}"[:160])
