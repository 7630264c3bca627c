"""TieredPool: several Pool tiers behind one Pool (DRAM over SSD, later a shared remote tier).

* put goes to the first tier that can hold the object (normally DRAM); a key present in any tier is a
  no-op, as for every Pool.
* When DRAM evicts an object, its bytes are handed to the next tier (demotion) before the DRAM pages are
  reused, through the lower tier's `write_behind` (the composition in umbp.pool.composition). For an
  SsdTier this is a copy into its staging buffer with the DRAM psum64 checked on the way (a DRAM copy
  that went bad is dropped, never demoted); a full staging buffer drops the object (counted), it never
  blocks. A tier with `async_writes` (the shared Redis tier) gets the same checked copy through its
  write queue, so no network round trip runs under DramPool's lock. Which tier demotes, how large an
  object a tier holds and how large a burst it takes are the tiers' declared capabilities (Pool).
* get_into tries the tiers in order and serves the first intact copy; a hit below the first tier is
  copied into the first tier (promotion). The SSD copy stays (tiers are inclusive), so evicting the
  promoted object again costs no second SSD write.

Why a hook: DramIndex frees an evicted object's pages inside reserve(), and the reserving put then
overwrites them, so the bytes must be taken before that: `DramIndex.on_evict` gets the victims of a whole
put batch in one call, after the batch's reservations and before its copies (`batched_evictions`), and
demotes them with one put to the next tier (a call per victim halved the put rate at 64 KiB). The callback
runs under DramPool's lock, so the demotion copy is paid by the put that caused the eviction.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from umbp.pool.base import Pool
from umbp.pool.buffers import as_u8
from umbp.pool.composition import TierStack
from umbp.pool.dram.index import Slot
from umbp.pool.errors import BufferSizeError, ObjectTooLargeError, UmbpError, human_bytes
from umbp.pool.keycheck import key_utf8

if TYPE_CHECKING:
    from umbp.pool.dram.tier import DramPool

EvictCallback = Callable[[list[tuple[str, Slot]]], None]


def install_evict_hook(dram: DramPool, callback: EvictCallback) -> None:
    """Call callback([(key, slot), ...]) with the objects `dram` evicts while their bytes are intact: once
    per put batch that evicted anything (see DramIndex.batched_evictions)."""
    dram.index.on_evict = callback


class TieredPool(Pool):
    """tiers[0] (a DramPool) over tiers[1] (an SsdTier) over ...; see the module docstring."""

    def __init__(self, tiers: Sequence[Pool], *, promote: bool = True, demote: bool = True) -> None:
        if not tiers:
            raise UmbpError("umbp: TieredPool needs at least one tier")
        self.tiers = list(tiers)
        self._promote = promote
        self._lock = threading.Lock()  # guards the counters only
        # removals and promotions: a promotion copies bytes read before it into the first tier, so one
        # that ran after a remove() of its key would bring the removed object back (and make the next
        # put of that key a no-op); removals count up `_removals` and promotions skip when it moved
        self._removal = threading.Lock()
        self._removals = 0
        self._counters = dict.fromkeys(
            ("demotions", "demotions_dropped", "demotion_errors", "promotions", "promotions_failed"), 0
        )
        self._hits = [0] * len(self.tiers)
        self._misses = 0
        self.lower = TierStack(self.tiers[1:])
        if demote and self.lower and self.tiers[0].demotes_evictions:
            install_evict_hook(self.tiers[0], self._demote)
            intake = self.lower.intake_bytes
            if intake is not None:  # DRAM's watermark burst (10% of it by default) must not overflow it
                index = self.tiers[0].index
                index.max_evict_pages = max(1, intake // 2 // index.alignment)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _demote(self, victims: list[tuple[str, Slot]]) -> None:
        """Runs inside DramPool's eviction, under its lock: copy a burst of victims down in one batch
        (one put, its copies split across the tier's copy threads), never raise."""
        arena = self.tiers[0].arena
        checked = [(k, s) for k, s in victims if s.checksum is not None]
        unchecked = [(k, s) for k, s in victims if s.checksum is None]
        for part, sums in ((checked, [s.checksum for _, s in checked]), (unchecked, None)):
            if part:
                self._demote_part(
                    [k for k, _ in part], [arena.view(s.offset, s.nbytes) for _, s in part], sums
                )

    def _demote_part(self, keys: list[str], srcs: list, sums: list[int] | None) -> None:
        ok, errors = self.lower.write_behind(self.lower.tiers[0], keys, srcs, sums)
        stored = sum(ok)
        self._count("demotions", stored)
        self._count("demotions_dropped", len(ok) - stored - errors)
        self._count("demotion_errors", errors)

    # ---- Pool API ------------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        out = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, hit in enumerate(out) if not hit]
            if not todo:
                break
            for i, hit in zip(todo, tier.exists([keys[i] for i in todo]), strict=True):
                out[i] = hit
        return out

    def put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Each new object goes to the first tier able to hold it (DRAM, or SSD for objects larger than
        the DRAM arena); if that tier cannot take it now, to the next."""
        if len(keys) != len(buffers):
            raise BufferSizeError(
                f"umbp: put got {len(keys)} keys but {len(buffers)} buffers; pass exactly one buffer per key"
            )
        sizes = [as_u8(b, key=k, what="source buffer", writable=False).size for k, b in zip(keys, buffers)]
        self._check_fits_somewhere(keys, sizes)
        self._check_key_lengths(keys)
        out = self.exists(keys)
        todo = [i for i, present in enumerate(out) if not present]
        for tier in self.tiers:
            limit = tier.max_object_bytes
            here = [i for i in todo if limit is None or sizes[i] <= limit]
            if here:
                for i, ok in zip(
                    here, tier.put([keys[i] for i in here], [buffers[i] for i in here]), strict=True
                ):
                    out[i] = ok
            todo = [i for i in todo if not out[i]]
        return out

    @property
    def max_key_bytes(self) -> int | None:
        limits = [t.max_key_bytes for t in self.tiers if t.max_key_bytes is not None]
        return min(limits) if limits else None

    def _check_key_lengths(self, keys: Sequence[str]) -> None:
        """A key some tier cannot store is refused here, not dropped by that tier when an eviction hands
        it down (with the rest of its burst)."""
        limit = self.max_key_bytes
        if limit is not None:
            for key in keys:
                key_utf8("put", key, limit)

    def _check_fits_somewhere(self, keys: Sequence[str], sizes: list[int]) -> None:
        limits = [t.max_object_bytes for t in self.tiers]
        if None in limits:
            return
        largest = max(limits)
        for key, n in zip(keys, sizes, strict=True):
            if n > largest:
                raise ObjectTooLargeError(
                    f"umbp: object '{key}' is {human_bytes(n)} but the largest tier takes objects up to "
                    f"{human_bytes(largest)}; raise the SSD tier's capacity_bytes/queue_bytes or the DRAM arena"
                )

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        removals = self._removals  # before any tier is read (see _removal)
        out = [False] * len(keys)
        todo = list(range(len(keys)))
        promote: list[int] = []
        for t, tier in enumerate(self.tiers):
            if not todo:
                break
            got = tier.get_into([keys[i] for i in todo], [buffers[i] for i in todo])
            hits = [i for i, ok in zip(todo, got, strict=True) if ok]
            for i in hits:
                out[i] = True
            if t > 0:
                promote += hits
            with self._lock:
                self._hits[t] += len(hits)
            todo = [i for i, ok in zip(todo, got, strict=True) if not ok]
        with self._lock:
            self._misses += len(todo)
        if promote and self._promote:
            self._promote_hits([keys[i] for i in promote], [buffers[i] for i in promote], removals)
        return out

    def _promote_hits(self, keys: list[str], buffers: list[Any], removals: int) -> None:
        """Copy lower-tier hits (now verified in the caller's buffers) into the first tier, unless a
        removal ran since they were read (then they are not promoted: counted as failed)."""
        first = self.tiers[0]
        limit = first.max_object_bytes
        sizes = [as_u8(b, key=k, what="buffer", writable=False).size for k, b in zip(keys, buffers)]
        fit = [i for i, n in enumerate(sizes) if limit is None or n <= limit]
        ok: list[bool] = []
        with self._removal:
            if fit and removals == self._removals:
                ok = first.put([keys[i] for i in fit], [buffers[i] for i in fit])
        self._count("promotions", sum(ok))
        self._count("promotions_failed", len(keys) - sum(ok))

    def remove(self, keys: Sequence[str]) -> int:
        with self._removal:  # no promotion lands while the tiers are emptied (see _removal)
            present = self.exists(keys)
            for tier in self.tiers:
                tier.remove(keys)
            self._removals += 1
        return sum(present)

    def clear(self) -> None:
        with self._removal:
            for tier in self.tiers:
                tier.clear()
            self._removals += 1

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every tier with a write queue (SsdTier, RedisTier) to drain."""
        return all([t.flush(timeout) for t in self.tiers])

    def stats(self) -> dict[str, Any]:
        tiers = [t.stats() for t in self.tiers]
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["hits_by_tier"] = list(self._hits)
            out["hits"] = sum(self._hits)
            out["misses"] = self._misses
        lookups = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / lookups if lookups else 0.0
        out["tier_names"] = [type(t).__name__ for t in self.tiers]
        out["tiers"] = tiers
        return out

    def close(self) -> None:
        """Close every tier, first to last (DRAM contents are not demoted on close)."""
        for tier in self.tiers:
            tier.close()
