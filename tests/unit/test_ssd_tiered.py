"""TieredPool (DRAM over SSD): demotion on DRAM eviction (verified, never blocking), promotion of SSD hits,
objects too large for DRAM, restart from the SSD tier, and the DramIndex hook it relies on."""

import time

import numpy as np
import pytest

from umbp.pool import DramIndex, DramPool, InvalidKeyError, ObjectTooLargeError, Pool
from umbp.pool.ssd.tier import SsdTier
from umbp.pool.tiered import TieredPool, install_evict_hook

KiB, MiB = 1024, 1 << 20


def _blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _pool(path, dram_kib=64, **ssd_kw) -> TieredPool:
    ssd_kw.setdefault("capacity_bytes", 16 * MiB)
    ssd_kw.setdefault("queue_bytes", 4 * MiB)
    dram = DramPool(capacity_bytes=dram_kib * KiB, pinned=False, high_watermark=1.0, low_watermark=0.75)
    return TieredPool([dram, SsdTier(str(path), **ssd_kw)])


def _get(pool, key: str, n: int) -> np.ndarray | None:
    out = np.empty(n, np.uint8)
    return out if pool.get_into([key], [out])[0] else None


def test_eviction_demotes_and_ssd_hits_are_promoted(tmp_path):
    blobs = {f"k{i}": _blob(8 * KiB, i) for i in range(16)}
    with _pool(tmp_path) as pool:
        assert isinstance(pool, Pool)
        for k, v in blobs.items():  # 128 KiB through a 64 KiB DRAM tier
            assert pool.put([k], [v]) == [True]
        dram, ssd = pool.tiers
        s = pool.stats()
        assert s["demotions"] == s["tiers"][0]["evictions"] > 0 and s["demotions_dropped"] == 0
        assert all(pool.exists(list(blobs)))
        assert not dram.exists(["k0"])[0] and ssd.exists(["k0"])[0]
        assert np.array_equal(_get(pool, "k0", 8 * KiB), blobs["k0"])  # served by the SSD tier ...
        assert dram.exists(["k0"])[0] and pool.stats()["promotions"] == 1  # ... and promoted
        assert np.array_equal(_get(pool, "k0", 8 * KiB), blobs["k0"])
        assert pool.stats()["hits_by_tier"] == [1, 1]
        assert all(np.array_equal(_get(pool, k, v.size), v) for k, v in blobs.items())
        assert pool.remove(["k0", "k1", "nope"]) == 2 and pool.exists(["k0", "k1"]) == [False, False]


def test_a_corrupt_dram_copy_is_not_demoted(tmp_path):
    with _pool(tmp_path) as pool:
        dram, ssd = pool.tiers
        pool.put(["bad"], [_blob(8 * KiB, 1)])
        slot = dram.index.slot_of("bad")
        dram.arena.view(slot.offset, slot.nbytes)[100] ^= 1  # DRAM bit flip while resident
        for i in range(10):
            pool.put([f"k{i}"], [_blob(8 * KiB, 10 + i)])  # push "bad" out
        assert ssd.stats()["put_checksum_mismatch"] == 1 and not pool.exists(["bad"])[0]
        assert _get(pool, "bad", 8 * KiB) is None


def test_demotion_under_backpressure_drops_and_never_blocks(tmp_path, blocked_writer):
    gate = blocked_writer
    try:
        with _pool(tmp_path, queue_bytes=40 * KiB) as pool:
            start = time.monotonic()
            for i in range(30):
                assert pool.put([f"k{i}"], [_blob(8 * KiB, i)]) == [True]
            assert time.monotonic() - start < 2.0  # the SSD writer is wedged; DRAM puts never waited
            s = pool.stats()
            assert (
                s["demotions_dropped"] > 0 and s["tiers"][1]["dropped_backpressure"] == s["demotions_dropped"]
            )
            served = [i for i in range(30) if _get(pool, f"k{i}", 8 * KiB) is not None]
            assert all(np.array_equal(_get(pool, f"k{i}", 8 * KiB), _blob(8 * KiB, i)) for i in served)
            gate.set()
    finally:
        gate.set()


def test_objects_larger_than_dram_go_to_ssd_and_restart_serves_them(tmp_path):
    big = _blob(200 * KiB, 7)
    with _pool(tmp_path) as pool:
        assert pool.put(["big", "small"], [big, b"tiny"]) == [True, True]
        assert pool.tiers[1].exists(["big"]) == [True] and pool.tiers[0].exists(["small"]) == [True]
        with pytest.raises(ObjectTooLargeError, match="largest tier"):
            pool.put(["huge"], [bytes(20 * MiB)])
        assert pool.flush(timeout=30)
    with _pool(tmp_path) as pool:  # DRAM starts empty; the SSD tier still has what it held
        assert np.array_equal(_get(pool, "big", big.size), big) and pool.exists(["small"]) == [False]


def test_the_dram_eviction_hook_sees_intact_bytes_before_reuse():
    """DramIndex.on_evict sees the victims while their bytes are still intact (TieredPool demotes through
    it): one call per put batch, even when the batch's new objects take the victims' pages."""
    dram = DramPool(capacity_bytes=32 * KiB, pinned=False, high_watermark=1.0, low_watermark=1.0)
    calls = []
    install_evict_hook(
        dram,
        lambda victims: calls.append(
            [(key, dram.arena.view(slot.offset, slot.nbytes).copy()) for key, slot in victims]
        ),
    )
    assert isinstance(dram.index, DramIndex)
    blobs = [_blob(8 * KiB, i) for i in range(6)]
    for i, b in enumerate(blobs):
        dram.put([f"k{i}"], [b])
    assert [[k for k, _ in c] for c in calls] == [["k0"], ["k1"]]
    new = [_blob(8 * KiB, 100 + i) for i in range(3)]
    assert dram.put(["n0", "n1", "n2"], new) == [True] * 3  # one batch evicting three, into their pages
    assert [k for k, _ in calls[-1]] == ["k2", "k3", "k4"] and len(calls) == 3
    seen = [kv for c in calls for kv in c]
    assert all(np.array_equal(data, blobs[int(k[1:])]) for k, data in seen)
    assert all(np.array_equal(_get(dram, f"n{i}", 8 * KiB), b) for i, b in enumerate(new))


def test_a_put_batch_demotes_its_victims_in_one_lower_put(tmp_path, monkeypatch):
    calls = []
    real = SsdTier.put
    monkeypatch.setattr(
        SsdTier,
        "put",
        lambda self, keys, bufs, checksums=None: (
            calls.append(list(keys)),
            real(self, keys, bufs, checksums=checksums),
        )[1],
    )
    old = {f"k{i}": _blob(8 * KiB, i) for i in range(8)}
    with _pool(tmp_path) as pool:  # 64 KiB of DRAM, evicting from 100% down to 75%
        assert pool.put(list(old), list(old.values())) == [True] * 8
        assert calls == []
        new = {f"n{i}": _blob(8 * KiB, 50 + i) for i in range(4)}
        assert pool.put(list(new), list(new.values())) == [True] * 4
        # two watermark evictions in the batch (100% -> 75% twice): six victims, the oldest, in one put
        assert calls == [[f"k{i}" for i in range(6)]]
        s = pool.stats()
        assert s["demotions"] == s["tiers"][0]["evictions"] == 6
        assert s["demotions_dropped"] == s["demotion_errors"] == 0
        assert all(np.array_equal(_get(pool.tiers[1], f"k{i}", 8 * KiB), old[f"k{i}"]) for i in range(6))
        assert all(np.array_equal(_get(pool, k, 8 * KiB), v) for k, v in {**old, **new}.items())


def test_a_victim_too_large_for_the_lower_tier_does_not_stop_the_others(tmp_path):
    with _pool(tmp_path, dram_kib=68, queue_bytes=40 * KiB) as pool:  # SSD staging 40 KiB: 44 KiB never fits
        big, small = _blob(44 * KiB, 1), [_blob(8 * KiB, 2 + i) for i in range(3)]
        assert pool.put(["big", "s0", "s1", "s2"], [big, *small]) == [True] * 4  # DRAM full (68 KiB)
        new = [_blob(8 * KiB, 10 + i) for i in range(6)]
        assert pool.put([f"n{i}" for i in range(6)], new) == [True] * 6  # evicts big, s0, s1, s2 together
        s = pool.stats()
        assert s["demotion_errors"] == 1 and s["demotions"] == 3  # big cannot go down; the rest did
        assert not pool.exists(["big"])[0]
        assert all(np.array_equal(_get(pool.tiers[1], f"s{i}", 8 * KiB), b) for i, b in enumerate(small))


def test_a_key_the_ssd_tier_cannot_store_is_refused_at_put_not_dropped_with_a_burst(tmp_path):
    """DRAM alone takes any key; a stack with the SSD tier refuses keys over its limit at put. And were
    one to reach an eviction burst anyway, the SSD tier's refusal of it stops no other victim."""
    with _pool(tmp_path, dram_kib=64) as pool:
        with pytest.raises(InvalidKeyError, match="1100 bytes"):
            pool.put(["s", "L" * 1100], [_blob(8 * KiB, 1), _blob(8 * KiB, 2)])
        assert pool.exists(["s"]) == [False]  # refused before anything was stored
        dram = pool.tiers[0]
        small = [_blob(8 * KiB, 2 + i) for i in range(7)]
        assert dram.put(["L" * 1100] + [f"s{i}" for i in range(7)], [_blob(8 * KiB, 1), *small]) == [True] * 8
        assert pool.put([f"n{i}" for i in range(6)], [_blob(8 * KiB, 10 + i) for i in range(6)]) == [True] * 6
        s = pool.stats()
        assert s["demotion_errors"] == 1 and s["demotions"] == 5  # the long key alone stays behind
        assert all(np.array_equal(_get(pool, f"s{i}", 8 * KiB), b) for i, b in enumerate(small))


@pytest.mark.parametrize("capped", [True, False])
def test_a_watermark_burst_is_capped_to_what_the_ssd_staging_takes(tmp_path, blocked_writer, capped):
    """DRAM evicting 75% of itself at once would overflow a 64 KiB SSD staging buffer (its writer wedged
    here): TieredPool caps one eviction at half the staging, so nothing is dropped."""
    gate = blocked_writer
    dram = DramPool(capacity_bytes=256 * KiB, pinned=False, high_watermark=1.0, low_watermark=0.25)
    pool = TieredPool([dram, SsdTier(str(tmp_path), capacity_bytes=16 * MiB, queue_bytes=64 * KiB)])
    try:
        assert dram.index.max_evict_pages == 8  # 32 KiB of 4 KiB pages
        if not capped:
            dram.index.max_evict_pages = None
        for i in range(32):  # fills DRAM exactly; nothing evicted yet
            assert pool.put([f"k{i}"], [_blob(8 * KiB, i)]) == [True]
        assert pool.put(["new"], [_blob(8 * KiB, 99)]) == [True]
        s = pool.stats()
        if capped:  # 4 victims (32 KiB), all staged for the disk
            assert s["tiers"][0]["evictions"] == 4 and s["demotions"] == 4 and s["demotions_dropped"] == 0
        else:  # down to the low watermark: 25 victims, most of them dropped for lack of staging
            assert s["tiers"][0]["evictions"] == 25 and s["demotions_dropped"] > 0
        gate.set()
    finally:
        gate.set()
        pool.close()


def test_a_remove_during_a_lower_tier_read_is_not_undone_by_its_promotion(tmp_path):
    """A get that hits the SSD tier promotes those bytes into DRAM after its read. A remove() of the key
    that completes in between must stay done: else the removed version is back in DRAM, the next put of
    the key is a no-op ("already present") and every get serves the removed bytes."""
    import threading

    with _pool(tmp_path) as pool:
        dram, ssd = pool.tiers
        v1, v2 = _blob(8 * KiB, 1), _blob(8 * KiB, 2)
        assert pool.put(["K"], [v1]) == [True]
        for i in range(12):  # K goes down to the SSD tier
            pool.put([f"f{i}"], [_blob(8 * KiB, 100 + i)])
        assert ssd.exists(["K"]) == [True] and dram.exists(["K"]) == [False]
        read, removed = threading.Event(), threading.Event()
        real_get = ssd.get_into

        def get_then_wait(keys, buffers):
            out = real_get(keys, buffers)
            if threading.current_thread().name == "reader":
                read.set()
                removed.wait(10)  # the remove below runs here
            return out

        ssd.get_into = get_then_wait
        got = {}
        reader = threading.Thread(target=lambda: got.update(hit=_get(pool, "K", 8 * KiB)), name="reader")
        reader.start()
        assert read.wait(10)
        assert pool.remove(["K"]) == 1
        removed.set()
        reader.join()
        assert np.array_equal(got["hit"], v1)  # the overlapping get may still see the old version
        assert pool.exists(["K"]) == [False]  # ... but the remove stays done
        assert pool.put(["K"], [v2]) == [True]
        assert np.array_equal(_get(pool, "K", 8 * KiB), v2)
        assert pool.stats()["promotions_failed"] == 1
