"""DictIndex: the reference implementation of DramIndex's semantics, one Python object per stored object.

Why keep it: it is the plain statement of the index's rules (dicts of entries, an OrderedDict as the LRU),
against which the compact DramIndex is checked on random operation sequences, and the baseline that
`umbp bench index` measures beside it. It costs ~470 B and several microseconds per object and its dicts
make gen-2 garbage collections long at millions of objects: DramIndex (umbp.pool.dram.index) is what umbp uses.
The life cycle and eviction rules are those of umbp.pool.dram.index's module docstring.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from umbp.pool.dram.allocator import PageAllocator
from umbp.pool.dram.index import (
    ABSENT,
    BUSY,
    COMMITTED,
    PENDING,
    Slot,
    check_capacity,
    check_watermarks,
    too_large_error,
)
from umbp.pool.errors import BufferSizeError, SlotStateError


@dataclass(slots=True)
class _Entry:
    key: str
    slot: Slot
    start: int  # first page
    npages: int
    pins: int = 0
    doomed: bool = False  # removed while pinned or reserved: free when the last user lets go


class DictIndex:
    """The reference DramIndex: one Python entry per object. See the module docstring."""

    def __init__(
        self,
        capacity_bytes: int,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        alignment: int = 4096,
        *,
        track_evicted: bool = True,
    ) -> None:
        check_capacity(capacity_bytes, alignment)
        check_watermarks(high_watermark, low_watermark)
        self.alignment = alignment
        self.npages = capacity_bytes // alignment
        self.capacity_bytes = self.npages * alignment
        self.high_watermark = float(high_watermark)
        self.low_watermark = float(low_watermark)
        self._high_pages = int(self.npages * high_watermark)
        self._low_pages = int(self.npages * low_watermark)
        self._alloc = PageAllocator(self.npages)
        self._live: dict[str, _Entry] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # committed and unpinned only, oldest first
        # called as on_evict([(key, slot), ...]) with LRU victims while their bytes are intact (tier
        # demotion): once per victim, or once per batched_evictions() block
        self.on_evict: Callable[[list[tuple[str, Slot]]], None] | None = None
        self._deferred: list[tuple[str, Slot]] | None = None
        # pages one watermark eviction frees at most (None: down to the low watermark); TieredPool sets it
        # to what the next tier can take in one call, so a burst of victims does not overflow it
        self.max_evict_pages: int | None = None
        self._lru_pages = 0
        self._reserved: dict[str, _Entry] = {}
        self._doomed: dict[str, _Entry] = {}  # removed while pinned
        self._track_evicted = track_evicted
        self._evicted: list[str] = []
        self._pinned_entries = 0
        self._live_bytes = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.reserve_failures = 0

    # ---- queries -------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str], touch: bool = False) -> list[bool]:
        """Committed keys only. touch=True also marks hits as recently used."""
        live = self._live
        if not touch:
            return list(map(live.__contains__, keys))  # C-level loop: a lookup asks for every boundary
        lru = self._lru
        out = []
        for k in keys:
            hit = k in live
            if hit and k in lru:
                lru.move_to_end(k)
            out.append(hit)
        return out

    def state(self, key: str) -> str:
        """'committed', 'pending' (reserved, not yet committed), 'busy' (removed but still pinned or
        being written: cannot be stored again until released) or 'absent'."""
        if key in self._live:
            return COMMITTED
        entry = self._reserved.get(key)
        if entry is not None:
            return BUSY if entry.doomed else PENDING
        return BUSY if key in self._doomed else ABSENT

    def slot_of(self, key: str) -> Slot | None:
        """The committed slot of key without touching LRU order or pins."""
        entry = self._live.get(key)
        return entry.slot if entry is not None else None

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    # ---- writes --------------------------------------------------------------------------------------

    def reserve(self, key: str, nbytes: int) -> Slot | None:
        """A slot for a new object, evicting LRU objects if needed; None if it cannot fit now (everything
        else pinned or being written) or the key is busy. The key stays invisible until commit()."""
        if type(nbytes) is not int or nbytes < 0:  # noqa: E721 - exact type: bool is not a size
            raise BufferSizeError(
                f"umbp: object '{key}' has invalid size {nbytes!r}; sizes are ints >= 0 bytes"
            )
        if nbytes > self.capacity_bytes:
            raise too_large_error(key, nbytes, self.capacity_bytes)
        state = self.state(key)
        if state in (COMMITTED, PENDING):
            raise SlotStateError(
                f"umbp: reserve('{key}') but the key is already {state}; lookup()/state() first "
                "(a duplicate put is a no-op)"
            )
        # an empty object takes a page too: with none, nothing would ever evict it, and empty objects
        # could grow the index past any capacity
        npages = max(1, -(-nbytes // self.alignment))
        if state == BUSY or npages > self._alloc.free_pages + self._lru_pages:
            self.reserve_failures += 1
            return None
        start = self._allocate(npages)
        if start is None:
            self.reserve_failures += 1
            return None
        entry = _Entry(key, Slot(start * self.alignment, nbytes), start, npages)
        self._reserved[key] = entry
        return entry.slot

    def reserve_many(self, keys: Sequence[str], nbytes: int) -> list[Slot | None]:
        """Slots for several new objects of one size, adjacent in the arena when one free run can take
        them all after the usual watermark eviction (never evicting more just to get one): a run of
        adjacent slots is one copy for the transfer engine's DMA path instead of one per object.
        Otherwise exactly reserve() per key. Each slot is still committed, pinned and freed on its own."""
        keys = list(keys)
        simple = (
            len(keys) >= 2
            and len(set(keys)) == len(keys)
            and type(nbytes) is int  # noqa: E721
            and 0 < nbytes <= self.capacity_bytes
            and all(self.state(k) == ABSENT for k in keys)
        )
        if not simple:  # reserve() gives each odd case its own answer or error
            return [self.reserve(k, nbytes) for k in keys]
        npages = -(-nbytes // self.alignment)
        total = npages * len(keys)
        start = None
        if total <= self._alloc.free_pages + self._lru_pages:
            self._make_room(total)
            start = self._alloc.alloc(total)
        if start is None:
            return [self.reserve(k, nbytes) for k in keys]
        out = []
        for i, key in enumerate(keys):
            first = start + i * npages
            entry = _Entry(key, Slot(first * self.alignment, nbytes), first, npages)
            self._reserved[key] = entry
            out.append(entry.slot)
        return out

    def _make_room(self, npages: int) -> None:
        """Past the high watermark, evict least-recently-used objects down to the low one (at most
        max_evict_pages of them per call, at least one object)."""
        used = self.npages - self._alloc.free_pages
        if used + npages > self._high_pages:
            target = max(self._low_pages - npages, 0)
            budget = self.npages if self.max_evict_pages is None else self.max_evict_pages
            freed = 0
            while self._lru and self.npages - self._alloc.free_pages > target and freed < budget:
                freed += self._evict_one()

    def _allocate(self, npages: int) -> int | None:
        self._make_room(npages)
        start = self._alloc.alloc(npages)
        while start is None and self._lru:
            self._evict_one()
            start = self._alloc.alloc(npages)
        return start

    @contextmanager
    def batched_evictions(self) -> Iterator[None]:
        """Hand the victims of every eviction inside the block to on_evict in one call, at its end. For
        callers that reserve a whole batch before writing into any of it (DramPool.put): a burst of
        victims then reaches the next tier as one batch instead of one call per object (which halved
        TieredPool's put rate at 64 KiB). The victims' pages are freed at once but keep their bytes
        until the caller writes its new slots, after the block; so the block must end before any of
        those writes."""
        if self._deferred is not None:  # nested: the outer block delivers
            yield
            return
        self._deferred = []
        try:
            yield
        finally:
            victims, self._deferred = self._deferred, None
            if victims and self.on_evict is not None:
                self.on_evict(victims)

    def _evict_one(self) -> int:
        """Evict the least recently used object; returns its pages."""
        key, _ = self._lru.popitem(last=False)
        entry = self._live.pop(key)
        if self.on_evict is not None:  # the bytes are intact until the caller reuses the pages
            if self._deferred is not None:
                self._deferred.append((key, entry.slot))
            else:
                self.on_evict([(key, entry.slot)])
        self._lru_pages -= entry.npages
        self._live_bytes -= entry.slot.nbytes
        self._alloc.free(entry.start, entry.npages)
        self.evictions += 1
        self.evicted_bytes += entry.slot.nbytes
        if self._track_evicted:
            self._evicted.append(key)
        return entry.npages

    def commit(self, key: str, checksum: int | None = None) -> bool:
        """Make a reserved key visible. False if it was removed/cleared meanwhile (its pages are freed)."""
        entry = self._reserved.pop(key, None)
        if entry is None:
            raise SlotStateError(f"umbp: commit('{key}') without a reservation; call reserve() first")
        if entry.doomed:
            self._alloc.free(entry.start, entry.npages)
            return False
        if checksum is not None:
            entry.slot = Slot(entry.slot.offset, entry.slot.nbytes, checksum)
        self._live[key] = entry
        self._lru[key] = None
        self._lru_pages += entry.npages
        self._live_bytes += entry.slot.nbytes
        return True

    def abort(self, key: str) -> None:
        """Give a reservation back (the copy failed or was cancelled)."""
        entry = self._reserved.pop(key, None)
        if entry is None:
            raise SlotStateError(f"umbp: abort('{key}') without a reservation")
        self._alloc.free(entry.start, entry.npages)

    def pin(self, keys: Sequence[str]) -> list[Slot | None]:
        """Read-pin committed keys (None for a miss). Pins nest; every pin needs one unpin."""
        out: list[Slot | None] = []
        for k in keys:
            entry = self._live.get(k)
            if entry is None:
                out.append(None)
                continue
            if entry.pins == 0:
                del self._lru[k]
                self._lru_pages -= entry.npages
                self._pinned_entries += 1
            entry.pins += 1
            out.append(entry.slot)
        return out

    def unpin(self, keys: Iterable[str]) -> None:
        for k in keys:
            entry = self._live.get(k)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
                if entry.pins == 0:
                    self._pinned_entries -= 1
                    self._lru[k] = None  # a read is a use: most recently used
                    self._lru_pages += entry.npages
                continue
            entry = self._doomed.get(k)
            if entry is None:
                raise SlotStateError(f"umbp: unpin('{k}') without a matching pin")
            entry.pins -= 1
            if entry.pins == 0:
                self._pinned_entries -= 1
                del self._doomed[k]
                self._alloc.free(entry.start, entry.npages)

    def remove(self, keys: Iterable[str]) -> int:
        """Make keys absent; returns how many were committed. Pinned/reserved pages are freed later."""
        removed = 0
        for k in keys:
            entry = self._live.pop(k, None)
            if entry is None:
                pending = self._reserved.get(k)
                if pending is not None:
                    pending.doomed = True
                continue
            removed += 1
            self._live_bytes -= entry.slot.nbytes
            if entry.pins:
                entry.doomed = True
                self._doomed[k] = entry
            else:
                del self._lru[k]
                self._lru_pages -= entry.npages
                self._alloc.free(entry.start, entry.npages)
        return removed

    def clear(self) -> int:
        """Remove every object and cancel every reservation; returns how many objects were removed."""
        # pages freed in page order (DramIndex.clear too): the free runs' order is then the same in both
        removed = self.remove(sorted(self._live, key=lambda k: self._live[k].start))
        for entry in self._reserved.values():
            entry.doomed = True
        return removed

    def drain_evicted(self) -> list[str]:
        """Keys evicted since the last call (empty unless track_evicted), so the owner can tell others."""
        out, self._evicted = self._evicted, []
        return out

    # ---- reporting -----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        align = self.alignment
        used = (self.npages - self._alloc.free_pages) * align
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": used,
            "stored_bytes": self._live_bytes,
            "free_bytes": self.capacity_bytes - used,
            "largest_free_bytes": self._alloc.largest_free() * align,
            "evictable_bytes": self._lru_pages * align,
            "objects": len(self._live),
            "reserved": len(self._reserved),
            "pinned": self._pinned_entries,
            "deferred_frees": len(self._doomed) + sum(e.doomed for e in self._reserved.values()),
            "evictions": self.evictions,
            "evicted_bytes": self.evicted_bytes,
            "reserve_failures": self.reserve_failures,
            "high_watermark": self.high_watermark,
            "low_watermark": self.low_watermark,
            "alignment": align,
        }

    def allocations(self) -> list[tuple[str, int, int, str]]:
        """(key, offset, allocated bytes, state) of every entry holding pages; for tests and debugging."""
        align = self.alignment
        rows = [(e.key, e.start * align, e.npages * align, "committed") for e in self._live.values()]
        rows += [(e.key, e.start * align, e.npages * align, "reserved") for e in self._reserved.values()]
        rows += [(e.key, e.start * align, e.npages * align, "doomed") for e in self._doomed.values()]
        return rows
