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


def test_close_under_a_threaded_copy_reports_the_pool_closed(monkeypatch):
    """close() shuts the copy threads down; a put or get that reaches its copy after that raises the
    pool's own 'closed' error, not the executor's RuntimeError, and leaves no reservation behind."""
    import umbp.pool.dram.tier as tier_module
    from umbp.pool.errors import UmbpError

    pool = DramPool(capacity_bytes=64 << 20, pinned=False, copy_threads=3)
    real = tier_module.copy_many

    def close_first(*args):
        closer = threading.Thread(target=pool.close)
        closer.start()
        closer.join()
        return real(*args)

    monkeypatch.setattr(tier_module, "copy_many", close_first)
    blobs = [np.full(4 << 20, i, np.uint8) for i in range(4)]
    with pytest.raises(UmbpError, match="this DramPool is closed"):
        pool.put([f"k{i}" for i in range(4)], blobs)
    assert pool.stats()["reserved"] == 0


def test_a_failed_submit_still_waits_for_the_shares_already_running():
    """run_split: when the executor refuses a share (shut down mid-call), the shares it already took
    finish before the error reaches the caller, who may then free the memory they write."""
    from concurrent.futures import ThreadPoolExecutor

    from umbp.pool.checksum import run_split

    finished = []

    class RefusesSecond(ThreadPoolExecutor):
        taken = 0

        def submit(self, fn, *args):
            self.taken += 1
            if self.taken > 1:
                raise RuntimeError("cannot schedule new futures after shutdown")
            return super().submit(fn, *args)

    def work(share):
        if share == 1:
            threading.Event().wait(0.2)
        finished.append(share)

    executor = RefusesSecond(2)
    try:
        with pytest.raises(RuntimeError, match="after shutdown"):
            run_split(executor, work, [0, 1, 2])
        assert finished == [1]  # the taken share had ended; the caller's own share never started
    finally:
        executor.shutdown()
