"""Probe (not a test; see bench/results/archive/27-the 2026-12-03 work-host-limits.txt): how fast this host's cores
move 64 KiB pages — numpy copies from a cold 192 MiB source into a 256 MiB ring (what an SSD put does),
with and without the psum64 row sums (numpy, and the C extension when built), on 1-4 threads — and a rough Python speed figure. The H200 device
hosts differ here by ~1.5x per core, and that sets the SSD tier's 64 KiB ceiling.

    python3 bench/probes/memprobe.py
"""

import threading
import time
import timeit

import numpy as np

from umbp.pool import native

MiB = 1 << 20
WS, SIZE = 192 * MiB, 64 << 10


def job(src: np.ndarray, ring: np.ndarray, lo: int, hi: int, sums: bool | str) -> None:
    if sums == "native":  # the C extension: copy + psum64 of the whole share in one call, no GIL
        dsts = [ring[(i * SIZE) % (ring.size - SIZE) :][:SIZE] for i in range(lo, hi)]
        native.lib.psum_copy(dsts, [src[i * SIZE : (i + 1) * SIZE] for i in range(lo, hi)])
        return
    for i in range(lo, hi):
        d = ring[(i * SIZE) % (ring.size - SIZE) :][:SIZE]
        np.copyto(d, src[i * SIZE : (i + 1) * SIZE])
        if sums:
            np.add.reduce(d.view(np.uint64).reshape(-1, 512), axis=1)


def main() -> None:
    src = np.ones(WS, np.uint8)
    ring = np.zeros(256 * MiB, np.uint8)
    n = WS // SIZE
    for sums in (False, True, "native") if native.lib is not None else (False, True):
        for t in (1, 2, 3, 4):
            best = 0.0
            for _ in range(3):
                threads = [threading.Thread(target=job, args=(src, ring, k * n // t, (k + 1) * n // t, sums))
                           for k in range(t)]
                t0 = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                best = max(best, WS / (time.perf_counter() - t0) / 1e9)
            label = {False: "copy", True: "copy+sum", "native": "native copy+sum"}[sums]
            print(f"{label} threads {t}: {best:.2f} GB/s", flush=True)
    d: dict = {}
    print("python: dict set+pop x1e6", timeit.timeit("d['k'+str(1)] = 1; d.pop('k1')", globals={"d": d}, number=1000000), "s")
    print("python: empty loop 1e7", timeit.timeit("for i in range(10000000): pass", number=1), "s")


if __name__ == "__main__":
    main()
