"""Probe (not a test; see bench/results/archive/27-the 2026-12-03 work-host-limits.txt and 28-the 2026-12-03 work-native.txt):
the client's CPU per value of RedisTier.get_into (batches of 16, 256 MiB of values) against a
redis-server the probe starts on 127.0.0.1 (or REDIS_URL's, which it fills and leaves filled), beside the
wall time per value. Repetitions alternate the C extension's read loop and the pure-Python one (when the
extension is built) and print user and system CPU apart. The first repetition pays the destination's
page faults.

    SIZE=65536 PYTHONPATH=$PWD/src python3 bench/probes/remote_get_cpu.py 6
"""

import os
import resource
import sys
import time

import numpy as np

from umbp.pool import native
from umbp.pool.remote.tier import RedisTier, RemoteConfig
from umbp.tools.local_redis import LocalRedis


def main() -> None:
    size = int(os.environ.get("SIZE", 65536))
    n, batch = (256 << 20) // size, 16
    url = os.environ.get("REDIS_URL")
    server = None if url else LocalRedis("remote_get_cpu", "REDIS_URL=redis://host:port/0")
    lib = native.lib
    try:
        tier = RedisTier(RemoteConfig.from_options({"url": url or server.url, "key_prefix": "p:",
                                                    "quarantine_s": 0, "timeout_s": 30}))
        src = np.random.default_rng(0).integers(0, 256, n * size, dtype=np.uint8)
        keys = [f"k/{i:08d}/" + "x" * 100 for i in range(n)]
        for i in range(0, n, batch):
            assert all(tier.put(keys[i : i + batch], [src[j * size : (j + 1) * size] for j in range(i, i + batch)]))
        dst = np.empty(n * size, np.uint8)
        views = [dst[j * size : (j + 1) * size] for j in range(n)]
        for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
            native.lib = lib if rep % 2 == 0 else None
            dst.fill(0)
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for i in range(0, n, batch):
                assert all(tier.get_into(keys[i : i + batch], views[i : i + batch]))
            dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            assert np.array_equal(dst, src)
            print(f"rep {rep} {'native' if native.lib else 'python'}: {n * size / dt / 1e9:.2f} GB/s, client CPU "
                  f"user {(r1.ru_utime - r0.ru_utime) / n * 1e6:.1f} + sys {(r1.ru_stime - r0.ru_stime) / n * 1e6:.1f} "
                  f"us/value, wall {dt / n * 1e6:.1f} us/value", flush=True)
        tier.close()
    finally:
        native.lib = lib
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
