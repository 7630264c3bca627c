"""Host clock of an idle 8K restore and save: when each engine step starts and ends, us from the call's
start (medians of 41 calls, the device idle before each; perf_counter stamps, ~0.1 us each, no CUDA
events on the way). Each step's k-th call is its own row."""

import collections
import statistics
import sys
import time

import torch

from umbp.tools import bench_restore as B

STEPS = ("_early", "_checked", "_laid_out", "_stage_in", "_copy_runs", "_copy_one", "_after", "_caller",
         "_plan", "_fetch", "_verify_scatter", "_copy", "_host_buffer", "_finish", "_head", "_head_count",
         "_path", "_staging", "_event", "_idle", "_sm_copy", "_head_sums", "_save_dma", "_load_dma")
r = B.Restore(8192)
e = r.engine
save_batch, batch, nbytes = r.prepare(8192)
stamps: list[tuple[str, float, float]] = []
t0 = [0.0]


def wrap(name):
    real = getattr(e, name)

    def step(*a, **k):
        s = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            stamps.append((name, s - t0[0], time.perf_counter() - t0[0]))

    setattr(e, name, step)


for name in STEPS:
    if hasattr(e, name):
        wrap(name)
print(torch.cuda.get_device_name())
for what, call in (("load", lambda: e.load(batch)), ("save", lambda: e.save(save_batch))):
    rows = collections.defaultdict(list)
    ends = []
    for rep in range(46):
        torch.cuda.synchronize()
        stamps.clear()
        t0[0] = time.perf_counter()
        h = call()
        ends.append(time.perf_counter() - t0[0])
        h.result()
        if rep < 5:
            continue
        seen = collections.Counter()
        for name, a, b in stamps:
            seen[name] += 1
            rows[(name, seen[name])].append((a, b))
    print(f"\n-- {what}: submit {statistics.median(ends) * 1e6:.1f} us; step (k-th call): start .. end (us)")
    order = sorted(rows, key=lambda k: statistics.median(a for a, _ in rows[k]))
    for key in order:
        v = rows[key]
        if len(v) < 20:
            continue
        a = statistics.median(x for x, _ in v) * 1e6
        b = statistics.median(y for _, y in v) * 1e6
        print(f"  {key[0]:<16} #{key[1]:<2} {a:8.1f} .. {b:8.1f}  ({b - a:6.1f})")
sys.stdout.flush()
