"""Probe (not a test; see docs/ssd.md, "The DRAM eviction hook"): what DRAM-to-SSD demotion costs a
TieredPool put, with the disk taken out of the picture (the SSD tier's writes return at once), against a
DRAM-only pool. 1 GiB of objects put 16 MiB per call through a 256 MiB DRAM tier, so most of them are
evicted and demoted; prints GB/s of the puts and the demotion counters, twice each, alternated.

    PYTHONPATH=$PWD/src python3 bench/probes/tiered_demotion.py 65536
"""

from __future__ import annotations

import sys
import tempfile
import time

import numpy as np

import umbp.pool.ssd.io_hooks as ssd_io
from umbp.pool import DramPool, SsdTier, TieredPool

MiB = 1 << 20


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 64 * 1024
    ssd_io.pwritev = lambda fd, iov, offset: sum(memoryview(a).nbytes for a in iov)
    src = np.random.default_rng(0).integers(0, 255, 64 * MiB, dtype=np.uint8)
    per, n = 64 * MiB // size, 1024 * MiB // size
    keys, batch = [f"k{i}" for i in range(n)], max(1, 16 * MiB // size)
    for mode in ("dram only", "tiered", "dram only", "tiered"):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
            dram = DramPool(capacity_bytes=256 * MiB, pinned=False)
            ssd = SsdTier(d, capacity_bytes=4096 * MiB, queue_bytes=256 * MiB, direct_io=False)
            pool = TieredPool([dram, ssd]) if mode == "tiered" else dram
            t = time.perf_counter()
            for b in range(0, n, batch):
                pool.put(keys[b : b + batch], [src[(i % per) * size : (i % per + 1) * size]
                                               for i in range(b, min(b + batch, n))])
            dt = time.perf_counter() - t
            ssd.flush()
            st = pool.stats() if mode == "tiered" else {}
            print(f"{mode:9s} {size >> 10} KiB objects: put {n * size / dt / 1e9:.2f} GB/s; demotions "
                  f"{st.get('demotions', '-')}, dropped {st.get('demotions_dropped', '-')}")
            pool.close()
            ssd.close()


if __name__ == "__main__":
    main()
