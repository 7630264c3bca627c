"""Probe (not a test; see bench/results/archive/2026-12-01-ssd-23-write-pipeline.txt): where a stream of small SSD
puts loses time, with the disk taken out of the picture. The real SsdTier runs `umbp bench ssd`'s write
loop (192 MiB of 64 KiB objects, 16 MiB per put call, a refused put retried when there is room), but its
`io_hooks.pwritev` is a simulated queued device of --rate bytes/s: each write starts when the previous one ends
and sleeps, without the GIL, until it would finish. Per pass it prints the write ratio (the 4 KiB header
per record caps it at 0.94), how long the disk sat idle after the first write, how often puts were
refused (the writer behind), and each thread's CPU per object (from /proc/self/task/*/schedstat).

Variants, to tell the GIL from the work itself: --switch sets sys.setswitchinterval, --depth the writes
kept in flight, --copy-threads the put's copy threads, --refused how the loop handles a refused put.

    PYTHONPATH=$PWD/src python3 bench/probes/ssd_write_sim.py --switch 0.005 0.001 --copy-threads 1 2
"""

from __future__ import annotations

import argparse
import itertools
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


class QueuedDisk:
    """A device that serves writes one after another at `rate` bytes/s; callers sleep outside the GIL."""

    def __init__(self, rate: float) -> None:
        self.rate, self.lock = rate, threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.free_at, self.idle, self.first = time.perf_counter(), 0.0, None

    def __call__(self, fd: int, iov: list, offset: int) -> int:
        n = sum(memoryview(a).nbytes for a in iov)
        with self.lock:
            now = time.perf_counter()
            if self.first is None:  # idle time counts from the first write on
                self.first = self.free_at = now
            if self.free_at < now:
                self.idle += now - self.free_at
            end = self.free_at = max(now, self.free_at) + n / self.rate
        time.sleep(max(0.0, end - time.perf_counter()))
        return n


def thread_cpu_ns() -> dict[str, int]:
    out: dict[str, int] = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError):
            continue
        name = t.name.split("_")[0].rstrip("-0123456789") or t.name
        out[name] = out.get(name, 0) + ns
    return out


def run(disk: QueuedDisk, size: int, ws: int, passes: int, depth: int, copy_threads: int, switch: float,
        refused: str) -> None:
    sys.setswitchinterval(switch)
    ssd_io.WRITE_DEPTH = depth
    src = aligned_buffer(ws)
    src.view(np.uint64)[:] = np.arange(ws // 8, dtype=np.uint64)
    n, batch = ws // size, max(1, 16 * MiB // size)
    objs = [src[i * size : (i + 1) * size] for i in range(n)]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        tier = ssd.SsdTier(d, capacity_bytes=2 * ws + 64 * MiB, queue_bytes=min(ws, 64 * MiB), direct_io=False,
                           copy_threads=copy_threads)
        print(f"switch {switch} s, depth {depth}, copy_threads {copy_threads}, refused puts {refused}:")
        for p in range(passes):
            tier.clear()
            keys = [f"sim/{p}/{i}" for i in range(n)]
            refused0 = tier.stats()["dropped_backpressure"]
            disk.reset()
            cpu0, t0 = thread_cpu_ns(), time.perf_counter()
            put_all(tier, keys, objs, batch, refused)
            tier.flush()
            dt, cpu1 = time.perf_counter() - t0, thread_cpu_ns()
            cpu = {k: (cpu1[k] - cpu0.get(k, 0)) / n / 1e3 for k in cpu1}
            print(f"  pass {p}: ratio {ws / dt / disk.rate:.2f}, first write after {(disk.first - t0) * 1e3:.1f} ms, "
                  f"then idle {disk.idle * 1e3:.1f} of {dt * 1e3:.1f} ms, refused puts "
                  f"{tier.stats()['dropped_backpressure'] - refused0}; CPU us/object: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items()) if v >= 0.05))
        tier.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1.8e9, help="simulated disk bytes/s (default 1.8e9)")
    ap.add_argument("--size-kib", type=int, default=64)
    ap.add_argument("--working-set-mib", type=int, default=192)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--switch", type=float, nargs="+", default=[0.005])
    ap.add_argument("--depth", type=int, nargs="+", default=[ssd_io.WRITE_DEPTH])
    ap.add_argument("--copy-threads", type=int, nargs="+", default=[2])
    ap.add_argument("--refused", nargs="+", default=["wait"], choices=("wait", "poll"),
                    help="a refused put waits for room (wait_for_room) or retries every 0.2 ms")
    args = ap.parse_args()
    disk = QueuedDisk(args.rate)
    ssd_io.pwritev = disk
    for switch, depth, copies, refused in itertools.product(args.switch, args.depth, args.copy_threads,
                                                             args.refused):
        run(disk, args.size_kib << 10, args.working_set_mib * MiB, args.passes, depth, copies, switch, refused)


if __name__ == "__main__":
    main()
