"""Timing on a CUDA device, shared by the GPU benchmarks: wall time between device synchronizations,
time of work queued behind a busy stream, the plain page-locked copy every GPU figure is a ratio to, and
the description of the device a figure came from. torch is imported inside each function, so the
benchmarks' argument parsing and CPU-side checks run without it."""

from __future__ import annotations

import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

GiB = 1 << 30
QUEUE_CYCLES = 50_000_000  # the sleep kernel queued() issues behind: ~25 ms at the H200's clock


def wall(fn: Callable[[], None], reps: int, warmup: int = 2) -> float:
    """Median wall seconds of fn() between two device synchronizations."""
    return statistics.median(interleaved({"fn": fn}, reps, warmup)["fn"])


def interleaved(
    calls: dict[str, Callable[[], Any]], reps: int, warmup: int = 2, seed: int = 0
) -> dict[str, list[float]]:
    """Wall seconds of each call, between two device synchronizations, `reps` times: every repetition
    runs every call once, in a fresh random order. Compared figures (a transfer and the pinned copy of
    the same bytes) then see the same host and link conditions: timed one after the other, a copy once
    read 4.5 ms where the 145 MB it moved take 2.7, and the restore beside it read 1.5x the link."""
    import torch

    for fn in calls.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in calls}
    rng = random.Random(seed)
    for _ in range(reps):
        order = list(calls)
        rng.shuffle(order)
        for k in order:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            calls[k]()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    return times


def queued(
    issue: Callable[[], list], reps: int, warmup: int = 1, hold: Sequence[Any] = ()
) -> tuple[float, float]:
    """Median seconds from the end of a sleep kernel queued on the current stream to the completion of
    the transfers issue() submitted behind it, and the fraction of repetitions in which the host had
    issued everything before the sleep ended (1.0: the figure holds no host time). A handle already done
    while the sleep still runs means the engine did not order its work after the caller's stream (the
    figure would read above the link): that is an error, not a result. `hold`: more streams made to wait
    for the sleep (the engine's own: a load's copies into its staging are not ordered after the caller's
    stream, and would otherwise run during the sleep and out of the figure; see engine_streams)."""
    import torch

    for _ in range(warmup):
        for h in issue():
            h.wait()
    times, ahead = [], 0
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(QUEUE_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for stream in hold:
            stream.wait_event(start)
        handles = issue()
        ahead += not start.query()
        if any(h.done() for h in handles) and not start.query():  # done, and the sleep still runs
            raise RuntimeError("umbp: a transfer completed while the caller's stream was still busy")
        for h in handles:
            h.wait()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), ahead / reps


def engine_streams(engine: Any) -> tuple:
    """A transfer engine's own CUDA streams (none for the staged path): for queued()'s `hold`."""
    return (*(getattr(engine, "streams", None) or ()), *(getattr(engine, "aux", None) or ()))


def baseline(reps: int, nbytes: int = GiB) -> dict[str, float]:
    """GB/s of plain page-locked copies: D2H, H2D, and both at once on two streams."""
    import torch

    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256) for _ in range(2)]
    host[1].copy_(dev[1])
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(s1):
            host[0].copy_(dev[0], non_blocking=True)
        with torch.cuda.stream(s2):
            dev[1].copy_(host[1], non_blocking=True)

    out = {
        "d2h": nbytes / wall(lambda: host[0].copy_(dev[0], non_blocking=True), reps) / 1e9,
        "h2d": nbytes / wall(lambda: dev[1].copy_(host[1], non_blocking=True), reps) / 1e9,
        "both": 2 * nbytes / wall(both, reps) / 1e9,
    }
    return out


def device_env() -> dict[str, Any]:
    """What a GPU figure was measured on, stored beside it."""
    import torch

    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": tv,
        "python": platform.python_version(),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
