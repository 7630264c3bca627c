"""Several threads put/get/remove concurrently under eviction pressure: every successful get is
byte-exact, and the bookkeeping ends balanced (no pins, no reservations, capacity respected)."""

import threading

import numpy as np
import pytest

from umbp.pool import DramPool

KiB = 1024
NKEYS = 48


def _size(k: int) -> int:
    return (4 + 37 * k % 300) * KiB + k  # 4 KiB .. ~300 KiB, odd tails, several copy chunks for some


def _content(k: int) -> np.ndarray:
    return np.random.default_rng(k).integers(0, 256, _size(k), dtype=np.uint8)


CONTENT = [_content(k) for k in range(NKEYS)]


def _worker(pool: DramPool, seed: int, errors: list, ops: int) -> None:
    rng = np.random.default_rng(seed)
    try:
        for _ in range(ops):
            ks = [int(k) for k in rng.integers(0, NKEYS, rng.integers(1, 4))]
            keys = [f"k{k}" for k in ks]
            roll = rng.random()
            if roll < 0.45:
                pool.put(keys, [CONTENT[k] for k in ks])
            elif roll < 0.95:
                outs = [np.empty(_size(k), np.uint8) for k in ks]
                for k, out, ok in zip(ks, outs, pool.get_into(keys, outs), strict=True):
                    if ok and not np.array_equal(out, CONTENT[k]):
                        errors.append(f"k{k}: bytes differ")
            else:
                pool.remove(keys[:1])
    except Exception as exc:  # surfaced by the main thread
        errors.append(repr(exc))


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_concurrent_put_get_remove_is_byte_exact(copy_threads):
    pool = DramPool(
        capacity_bytes=2 << 20, high_watermark=0.9, low_watermark=0.6, pinned=False, copy_threads=copy_threads
    )
    errors: list[str] = []
    threads = [threading.Thread(target=_worker, args=(pool, seed, errors, 600)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = pool.stats()
    assert stats["pinned"] == 0 and stats["reserved"] == 0 and stats["deferred_frees"] == 0
    assert stats["used_bytes"] <= stats["capacity_bytes"]
    assert stats["checksum_failures"] == 0
    assert stats["hits"] > 0 and stats["evictions"] > 0  # the test did exercise hits and eviction
    for k in range(NKEYS):  # whatever survived is intact
        out = np.empty(_size(k), np.uint8)
        if pool.get_into([f"k{k}"], [out])[0]:
            assert np.array_equal(out, CONTENT[k])
    pool.close()
