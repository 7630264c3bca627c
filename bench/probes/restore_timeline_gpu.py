"""Probe (not a test; CUDA): one verified restore and one save of the `umbp bench restore` layout, host and
device on one clock. The engine's host steps (validation, layouts, staging, copy calls, plans, launches,
handle) are wrapped in profiler ranges; the device's copies and kernels come from the same profile. It
prints every host range and device op in start order, in microseconds from the call's start, so that
idle copy engine time and the host step it waited for line up.

    PYTHONPATH=$PWD/src python3 bench/probes/restore_timeline_gpu.py [tokens,...] [host|queued]

`host`: no profiler (it slows the host steps several-fold); each step timed with perf_counter instead,
printed as the median over calls of its summed time per call, with when the first copy was issued and
when the call returned (submit) and completed (wall).
`queued`: the profiled call issued behind a ~25 ms sleep kernel, so the device runs it with no host time in
between; device ops are printed from the sleep's end, with the idle time before each op (the device's
own share of a restore, and where it is idle).
"""

from __future__ import annotations

import functools
import sys

STEPS = (
    "_checked",
    "flat",
    "_laid_out",
    "_staging",
    "_copy_runs",
    "_plan",
    "_copy",
    "_sm_copy",
    "_finish",
    "_path",
    "_early_copy",  # a restore's early copies, one call (engines with early.py's C call)
    "_head",  # a cold save's head copies (engines with head.py)
    "_head_sums",
)


def _steps(engine):
    """(name, bound step) for each of STEPS the engine has: older engines lack _early_copy, and on CPU it is None."""
    for name in STEPS:
        inner = getattr(engine, name, None)
        if inner is not None:
            yield name, inner


def wrap(engine) -> None:
    from torch.profiler import record_function

    for name, inner in _steps(engine):

        @functools.wraps(inner)
        def step(*a, _inner=inner, _name=name, **k):
            with record_function("host " + _name):
                return _inner(*a, **k)

        setattr(engine, name, step)


def wrap_timed(engine, spans: dict) -> None:
    import time

    for name, inner in _steps(engine):

        @functools.wraps(inner)
        def step(*a, _inner=inner, _name=name, **k):
            t = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                spans.setdefault(_name, []).append((t, time.perf_counter()))

        setattr(engine, name, step)


def host(engine, fn, label: str, spans: dict, reps: int = 31) -> None:
    """Median per call: each step's summed host time, the first copy call's return, submit and wall."""
    import statistics
    import time

    import torch

    for _ in range(3):
        fn().result()
    rows: dict[str, list[float]] = {}
    for _ in range(reps):
        torch.cuda.synchronize()
        spans.clear()
        t0 = time.perf_counter()
        h = fn()
        t1 = time.perf_counter()
        h.result()
        t2 = time.perf_counter()
        for name, s in spans.items():
            rows.setdefault(name, []).append(sum(b - a for a, b in s) * 1e6)
        copies = [s[0][1] for name, s in spans.items() if name in ("_copy_runs", "_early_copy", "_head")]
        first = min(copies, default=t0)
        rows.setdefault("= first copy issued at", []).append((first - t0) * 1e6)
        rows.setdefault("= submit", []).append((t1 - t0) * 1e6)
        rows.setdefault("= wall", []).append((t2 - t0) * 1e6)
    print(f"\n-- {label}: host us per call, median of {reps} (steps nest: _plan holds flat)")
    for name, v in rows.items():
        print(f"  {name:<24} {statistics.median(v):8.1f}")


def one(engine, fn, label: str, queued: bool = False) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from umbp.tools.cuda_timing import QUEUE_CYCLES, engine_streams

    for _ in range(3):
        fn().result()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if queued:  # the engine's streams held too: a load's copies do not wait for the caller's stream
            torch.cuda._sleep(QUEUE_CYCLES)
            slept = torch.cuda.Event()
            slept.record()
            for stream in engine_streams(engine):
                stream.wait_event(slept)
        with record_function("call"):
            h = fn()
        with record_function("wait"):
            h.result()
        torch.cuda.synchronize()
    events = [
        e
        for e in prof.events()
        if e.name.startswith(("host ", "call", "wait")) or e.device_type.name == "CUDA"
    ]
    if queued:
        gpu = sorted((e for e in events if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        sleep = max(gpu, key=lambda e: e.time_range.elapsed_us())
        t0, last = sleep.time_range.end, sleep.time_range.end
        print(f"\n-- {label}, queued: device ops, us from the sleep's end (idle before each op)")
        for e in gpu:
            if e is sleep or e.time_range.start < t0:
                continue
            idle = e.time_range.start - last
            last = max(last, e.time_range.end)
            print(
                f"  {e.time_range.start - t0:8.1f} +{e.time_range.elapsed_us():7.1f} (idle {idle:6.1f})  {e.name[:60]}"
            )
        print(f"  device busy to {last - t0:.1f} us after the sleep")
        return
    t0 = min(e.time_range.start for e in events if e.name == "call")
    print(f"\n-- {label}: host ranges and device ops, us from the call's start")
    for e in sorted(events, key=lambda e: e.time_range.start):
        where = "GPU " if e.device_type.name == "CUDA" else "    "
        print(f"  {where}{e.time_range.start - t0:8.1f} +{e.time_range.elapsed_us():7.1f}  {e.name[:70]}")


def main(tokens: list[int], timed: bool, queued: bool = False) -> None:
    from umbp.tools import bench_restore as B
    from umbp.tools.cuda_timing import wall

    r = B.Restore(max(tokens))
    spans: dict = {}
    wrap_timed(r.engine, spans) if timed else wrap(r.engine)
    for n in tokens:
        save_batch, batch, nbytes = r.prepare(n)
        copies = B.pinned_copies(nbytes)
        h2d, d2h = (wall(copies[k], 9) for k in ("h2d", "d2h"))
        print(
            f"\n== {n} tokens, {nbytes / 1e6:.1f} MB; pinned copy H2D {h2d * 1e3:.3f} ms, D2H {d2h * 1e3:.3f} ms"
        )
        for what, fn in (
            ("verified load", lambda b=batch: r.engine.load(b)),
            ("save", lambda b=save_batch: r.engine.save(b)),
        ):
            if timed:
                host(r.engine, fn, f"{what}, {n} tokens", spans)
            else:
                one(r.engine, fn, f"{what}, {n} tokens", queued)


if __name__ == "__main__":
    main(
        [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "8192,32768").split(",")],
        "host" in sys.argv[2:],
        "queued" in sys.argv[2:],
    )
