"""Probe (not a test; see bench/results/archive/27-the 2026-12-03 work-host-limits.txt): where a pass of 64 KiB SSD puts
spends its time, per thread, with the disk simulated as infinitely fast. For each of the put path's and
the writer's main functions it prints wall time (inside the call) and CPU time (thread_time): wall well
above CPU means the thread waited, for the GIL or for a lock, inside that call. Nested calls (put >
_copy_run) are listed separately, not subtracted.

    CT=2 PYTHONPATH=$PWD/src python3 bench/probes/timeline.py 4      # CT: the tier's copy_threads
"""

import collections
import functools
import os
import sys
import tempfile
import threading
import time

import numpy as np

import umbp.pool.ssd.io_hooks as ssd_io
import umbp.pool.ssd.tier as ssd
from umbp.pool.buffers import aligned_buffer
from umbp.tools.bench_ssd import put_all

MiB = 1 << 20
EVENTS: list[tuple[str, str, int, int, int]] = []  # thread, function, start, end, cpu ns


def timed(name: str) -> None:
    inner = getattr(ssd.SsdTier, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        t, c = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            EVENTS.append((threading.current_thread().name.split("_")[0], name, t, time.perf_counter_ns(),
                           time.thread_time_ns() - c))

    setattr(ssd.SsdTier, name, wrapper)


def main() -> None:
    for name in ("put", "_copy_run", "_enqueue_staged", "_stage", "_commit", "_images", "_write_batch", "_settle"):
        timed(name)
    ssd_io.pwritev = lambda fd, iov, off: sum(memoryview(a).nbytes for a in iov)  # an infinitely fast disk
    ws, size = 192 * MiB, 64 << 10
    src = aligned_buffer(ws)
    src.view(np.uint64)[:] = np.arange(ws // 8, dtype=np.uint64)
    n = ws // size
    objs = [src[i * size : (i + 1) * size] for i in range(n)]
    copy_threads = int(os.environ.get("CT", "2"))
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        tier = ssd.SsdTier(d, capacity_bytes=4 << 30, queue_bytes=256 * MiB, direct_io=False,
                           copy_threads=copy_threads)
        for p in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
            tier.clear()
            EVENTS.clear()
            keys = [f"sim/{p}/{i}" for i in range(n)]
            t0 = time.perf_counter_ns()
            put_all(tier, keys, objs, 256, "wait")
            tier.flush()
            t1 = time.perf_counter_ns()
            busy: dict[tuple[str, str], float] = collections.defaultdict(float)
            cpu: dict[tuple[str, str], float] = collections.defaultdict(float)
            for thread, name, a, b, c in EVENTS:
                busy[thread, name] += (b - a) / 1e6
                cpu[thread, name] += c / 1e6
            print(f"pass {p}: {(t1 - t0) / 1e6:.1f} ms ({ws / (t1 - t0):.2f} GB/s); wall ms (cpu ms) per thread/function:")
            for k in sorted(busy):
                print(f"   {k[0]:>22} {k[1]:<16} {busy[k]:7.1f} ({cpu[k]:6.1f})")
        tier.close()


if __name__ == "__main__":
    main()
