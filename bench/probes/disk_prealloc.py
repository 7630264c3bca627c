"""Probe (not a test; see bench/results/archive/29-the 2026-12-03 work.txt): does preallocating segment files help
O_DIRECT appends? The disk's write rate for 192 MiB in 8 MiB writes, alternated over rounds:

* one fresh file, 1 or 3 writes in flight (the bench's baseline is the first);
* one file fallocate()d to its final size first (the allocation is timed too), 1 or 3 in flight;
* the SSD tier's shape: 28 MiB segment files opened one after another, 3 writes in flight, each full
  segment fdatasync()ed on another thread (its seal) while the next one is written; fresh or fallocated.

Every variant ends with fdatasync and is timed from its first open to its last sync.

    python3 bench/probes/disk_prealloc.py /tmp/umbp-prealloc
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MiB = 1 << 20
TOTAL = 192 * MiB
IO = 8 * MiB
SEG = 28 * MiB


def _open(path: str, falloc: int) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    if falloc:
        os.posix_fallocate(fd, 0, falloc)
    return fd


def segments(root: str, buf: np.ndarray, seg: int, qd: int, falloc: bool) -> float:
    """Files of `seg` bytes opened one after another, `qd` writes in flight, each file fdatasync()ed on
    another thread once its writes have landed (the tier's seal) while the next one is written. One file
    of the whole pass (seg=TOTAL) is the bench's baseline shape."""
    pool, sealer = ThreadPoolExecutor(qd), ThreadPoolExecutor(1)
    t = time.perf_counter()
    pending, seals, fds = [], [], []
    for s in range(0, TOTAL, seg):
        fd = _open(os.path.join(root, f"seg-{s // seg}"), seg if falloc else 0)
        fds.append(fd)
        for off in range(0, min(seg, TOTAL - s), IO):
            n = min(IO, seg - off)
            pending.append(pool.submit(os.pwritev, fd, [buf[:n]], off))
            if len(pending) >= qd:
                pending.pop(0).result()
        mine = list(pending)
        seals.append(sealer.submit(lambda fd=fd, mine=mine: ([f.result() for f in mine], os.fdatasync(fd))))
    for f in pending + seals:
        f.result()
    dt = time.perf_counter() - t
    for fd in fds:
        os.close(fd)
    pool.shutdown()
    sealer.shutdown()
    return TOTAL / dt / 1e6


VARIANTS = {
    "fresh file, qd 1 (baseline)": lambda r, b: segments(r, b, TOTAL, 1, False),
    "fresh file, qd 3": lambda r, b: segments(r, b, TOTAL, 3, False),
    "fallocated file, qd 1": lambda r, b: segments(r, b, TOTAL, 1, True),
    "fallocated file, qd 3": lambda r, b: segments(r, b, TOTAL, 3, True),
    "28 MiB segments, qd 3, sealed": lambda r, b: segments(r, b, SEG, 3, False),
    "28 MiB segments fallocated, qd 3, sealed": lambda r, b: segments(r, b, SEG, 3, True),
}


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/umbp-prealloc"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    buf = np.frombuffer(mmap.mmap(-1, IO), np.uint8)
    buf[:] = 7
    res: dict[str, list[float]] = {k: [] for k in VARIANTS}
    names = list(VARIANTS)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            os.sync()
            res[name].append(VARIANTS[name](root, buf))
    shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(res[names[0]])
    for name, xs in res.items():
        m = statistics.median(xs)
        print(f"{name:42s} median {m:5.0f} MB/s ({m / base:.2f} of baseline)  " + " ".join(f"{x:.0f}" for x in xs))


if __name__ == "__main__":
    main()
