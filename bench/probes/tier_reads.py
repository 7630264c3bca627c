"""Probe (not a test; see bench/results/archive/2026-12-01-worker-22-tier-reads.txt): reading a restore's objects from the
SSD tier (O_DIRECT) and from a loopback redis-server, as the worker's I/O thread does, into DRAM slots:
* one by one: one get_into per object into a fresh buffer, then a copy into the slot (before the 2026-12-01 work);
* batched: one get_into for all of them into fresh buffers, then the copies (the 2026-12-01 work, first change);
* into slots: one get_into straight into the (aligned) slots, then a checksum of each (second change).
Medians of 7 alternated rounds.

    PYTHONPATH=$PWD/src python3 bench/probes/tier_reads.py      # needs redis-server on PATH
"""

from __future__ import annotations

import statistics
import tempfile
import time

import numpy as np

from umbp.pool import Arena
from umbp.pool.checksum import checksum
from umbp.pool.remote.tier import RedisTier
from umbp.pool.ssd.tier import SsdTier
from umbp.tools.local_redis import LocalRedis

SHAPES = ((24, 1600 << 10), (64, 256 << 10))  # Granite-sized objects; smaller ones


def bench(tier, name: str, n: int, size: int) -> None:
    src = np.random.default_rng(0).integers(0, 255, size * n, dtype=np.uint8)
    objs = [src[i * size : (i + 1) * size] for i in range(n)]
    keys = [f"ns{size}/tp0:pcp0:dcp0:pp0/g0/{i:064x}" for i in range(n)]
    assert all(tier.put(keys, objs))
    tier.flush()
    arena = Arena(n * size, pinned=False)
    slots = [arena.view(i * size, size) for i in range(n)]
    times: dict[str, list[float]] = {"one by one": [], "batched": [], "into slots": []}
    for _rep in range(7):
        for mode, got in times.items():
            t0 = time.perf_counter()
            if mode == "into slots":
                ok = tier.get_into(keys, slots)
                sums = [checksum(v) for v in slots]
            else:
                bufs = [np.empty(size, np.uint8) for _ in range(n)]
                if mode == "batched":
                    ok = tier.get_into(keys, bufs)
                else:
                    ok = [tier.get_into([k], [b])[0] for k, b in zip(keys, bufs, strict=True)]
                sums = [arena.write(i * size, b) for i, b in enumerate(bufs)]
            got.append(time.perf_counter() - t0)
            assert all(ok) and len(sums) == n
    print(name, {m: f"{1e3 * statistics.median(v):.1f} ms" for m, v in times.items()}, f"({n} x {size >> 10} KiB)")


def main() -> None:
    ssd = SsdTier(tempfile.mkdtemp(dir="/tmp"), capacity_bytes=4 << 30, direct_io="auto")
    for n, size in SHAPES:
        bench(ssd, "ssd (O_DIRECT)", n, size)
    ssd.close()
    server = LocalRedis("probe", "--url")
    try:
        remote = RedisTier.from_options({"url": server.url})
        for n, size in SHAPES:
            bench(remote, "redis (loopback)", n, size)
        remote.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
