"""The tier composition (umbp.pool.composition.TierStack) works from the capabilities a tier declares on
the Pool interface, not from its class: a tier the composition has never heard of joins a stack by
declaring them, and TieredPool hands evicted objects to it through `write_behind` with their checksums."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from umbp.pool import DramPool, ObjectTooLargeError, Pool, SsdTier, TieredPool, TierStack, UmbpError
from umbp.pool.checksum import checksum


class DictTier(Pool):
    """A lower tier unknown to the composition: a dict, declaring itself shared with queued writes."""

    shared = True
    async_writes = True

    def __init__(self, limit: int | None = None, closed: bool = False) -> None:
        self.data: dict[str, bytes] = {}
        self.handed: list[tuple[list[str], list[int] | None]] = []
        self.limit, self.closed, self.flushed = limit, closed, 0

    def write_behind(
        self, keys: Sequence[str], buffers: Sequence[Any], checksums: Sequence[int] | None = None
    ) -> list[bool]:
        if self.closed:
            raise UmbpError("closed")
        if self.limit is not None and any(np.asarray(b).size > self.limit for b in buffers):
            raise ObjectTooLargeError("too large")
        self.handed.append((list(keys), None if checksums is None else list(checksums)))
        return self.put(keys, buffers)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.data for k in keys]

    def put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        for k, b in zip(keys, buffers, strict=True):
            self.data[k] = bytes(np.asarray(b, dtype=np.uint8))
        return [True] * len(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        out = []
        for k, b in zip(keys, buffers, strict=True):
            if k in self.data:
                np.asarray(b)[:] = np.frombuffer(self.data[k], np.uint8)
            out.append(k in self.data)
        return out

    def remove(self, keys: Sequence[str]) -> int:
        return sum(self.data.pop(k, None) is not None for k in keys)

    def clear(self) -> None:
        self.data.clear()

    def stats(self) -> dict[str, Any]:
        return {"objects": len(self.data)}

    def flush(self, timeout: float | None = None) -> bool:
        self.flushed += 1
        return True


def blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_capabilities_of_the_shipped_tiers(tmp_path):
    dram = DramPool(capacity_bytes=1 << 20, pinned=False)
    ssd = SsdTier(str(tmp_path), capacity_bytes=64 << 20, queue_bytes=4 << 20, direct_io=False)
    try:
        assert (dram.demotes_evictions, dram.persistent, dram.shared) == (True, False, False)
        assert (ssd.demotes_evictions, ssd.persistent, ssd.shared) == (False, True, False)
        assert dram.max_object_bytes == dram.capacity_bytes and dram.intake_bytes is None
        assert ssd.intake_bytes == ssd.queue_bytes and 0 < ssd.max_object_bytes <= ssd.queue_bytes
        assert dram.flush() is True  # no queue: nothing to wait for
    finally:
        ssd.close()
        dram.close()


def test_tiered_pool_demotes_to_an_unknown_tier_through_write_behind_with_checksums():
    dram = DramPool(capacity_bytes=64 * 1024, pinned=False, high_watermark=1.0, low_watermark=0.75)
    lower = DictTier()
    pool = TieredPool([dram, lower])
    blobs = {f"k{i}": blob(8 * 1024, i) for i in range(16)}  # 128 KiB through 64 KiB of DRAM
    for k, v in blobs.items():
        assert pool.put([k], [v]) == [True]
    assert pool.flush(1) and lower.flushed == 1
    handed = [(k, s) for keys, sums in lower.handed for k, s in zip(keys, sums or [None] * len(keys))]
    assert handed and pool.stats()["demotions"] == len(handed)
    for k, s in handed:  # DRAM's own checksum went down with each object, so the lower tier can check it
        assert s == checksum(blobs[k]), k
    for k, v in blobs.items():
        out = np.empty(v.size, np.uint8)
        assert pool.get_into([k], [out]) == [True] and np.array_equal(out, v), k


def test_tier_stack_finds_tiers_by_capability_and_skips_absent_ones(tmp_path):
    ssd = SsdTier(str(tmp_path), capacity_bytes=64 << 20, queue_bytes=4 << 20, direct_io=False)
    shared = DictTier()
    try:
        stack = TierStack([None, ssd, shared])
        assert stack.tiers == [ssd, shared] and stack.persistent is ssd and stack.shared is shared
        assert stack.intake_bytes == ssd.queue_bytes
        only_shared = TierStack([None, shared])
        assert only_shared.persistent is None and only_shared.shared is shared
        assert not TierStack([None, None]) and TierStack([]).persistent is None
    finally:
        ssd.close()


def test_tier_stack_write_behind_counts_errors_and_keeps_the_rest_of_a_batch():
    small = DictTier(limit=100)
    stack = TierStack([small])
    ok, errors = stack.write_behind(small, ["a", "big", "b"], [blob(10, 1), blob(200, 2), blob(10, 3)], None)
    assert (ok, errors) == ([True, False, True], 1) and set(small.data) == {"a", "b"}
    closed = DictTier(closed=True)
    assert TierStack([closed]).write_behind(closed, ["x", "y"], [blob(1, 0), blob(1, 1)], [1, 2]) == (
        [False] * 2,
        2,
    )


def test_tier_stack_close_flushes_then_closes_every_tier():
    a, b = DictTier(), DictTier()
    closed: list[DictTier] = []
    for t in (a, b):
        t.close = lambda t=t: closed.append(t)  # type: ignore[method-assign]
    stack = TierStack([a, b])
    stack.close(flush_timeout=1)
    assert (a.flushed, b.flushed) == (1, 1) and closed == [a, b] and not stack and stack.shared is None


@pytest.mark.parametrize("demote", [True, False])
def test_demotion_follows_the_first_tiers_capability(demote):
    """A first tier that does not declare `demotes_evictions` gets no eviction hook: nothing is handed down."""
    upper, lower = DictTier(), DictTier()
    pool = TieredPool([DramPool(capacity_bytes=64 * 1024, pinned=False), lower], demote=demote)
    assert (pool.tiers[0].index.on_evict is not None) == demote
    TieredPool([upper, lower])  # a dict tier on top: accepted, and no hook to install
    assert lower.handed == []
