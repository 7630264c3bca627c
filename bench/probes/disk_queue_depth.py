"""Probe (not a test; see bench/results/archive/26-the 2026-12-02 work-probes.txt): the disk's own O_DIRECT write
rate into one fresh file for several queue depths (threads writing at planned, increasing offsets, as
the SSD tier's writer does) and write sizes, alternated over rounds. Tells whether the tier's I/O shape
(three writes in flight, ~6 MiB each) costs anything against the bench's baseline (one 8 MiB write at a
time).

    python3 bench/probes/disk_queue_depth.py /tmp/umbp-qd
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MiB = 1 << 20
TOTAL = 192 * MiB
VARIANTS = [(1, 8), (2, 8), (3, 8), (3, 4), (1, 4), (4, 8), (3, 16)]  # (queue depth, MiB per write)


def run(path: str, buf: np.ndarray, qd: int, io: int) -> float:
    p = os.path.join(path, "f")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    pool = ThreadPoolExecutor(qd)
    t = time.perf_counter()
    futures = []
    for off in range(0, TOTAL, io):
        futures.append(pool.submit(os.pwritev, fd, [buf[:io]], off))
        if len(futures) >= qd:
            futures.pop(0).result()
    for f in futures:
        f.result()
    os.fdatasync(fd)
    dt = time.perf_counter() - t
    os.close(fd)
    pool.shutdown()
    os.unlink(p)
    os.sync()  # the delete's discard lands before the next variant's timed window
    return TOTAL / dt / 1e6


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/umbp-qd"
    os.makedirs(path, exist_ok=True)
    buf = np.frombuffer(mmap.mmap(-1, 16 * MiB), np.uint8)
    buf[:] = 7
    res: dict[tuple[int, int], list[float]] = {v: [] for v in VARIANTS}
    for r in range(6):
        for qd, io in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            res[(qd, io)].append(run(path, buf, qd, io * MiB))
    for (qd, io), xs in res.items():
        print(f"qd {qd} io {io:2d} MiB: median {statistics.median(xs):.0f} MB/s  " + " ".join(f"{x:.0f}" for x in xs))


if __name__ == "__main__":
    main()
