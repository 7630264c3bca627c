"""DramIndex: the metadata half of the DRAM tier (keys, slots, LRU, pins), with no bytes.

Why separate: in vLLM's embedded mode the scheduler process owns the index and hands out slot offsets,
while every worker process owns its own Arena and copies its shard of each object at that same offset.

Object life cycle::

    reserve(key, n) -> Slot   (invisible to lookup; the caller copies into the slot)
      commit(key)             (visible; joins the LRU)        or  abort(key)  (freed)
    pin([key]) -> [Slot]      (read pin: never evicted, overwritten or freed while pinned)
      unpin([key])            (back in the LRU as most recently used)
    remove([key]) / clear()   (invisible at once; the pages of pinned or reserved objects are freed
                               only at the last unpin / at commit or abort)

Eviction takes least recently used committed, unpinned objects: when a reservation would lift usage above
the high watermark it evicts down to the low watermark, and when no free run is long enough it keeps
evicting until one is. A reservation that still cannot fit returns None (counted in stats).

Not thread-safe on purpose: the owner serialises calls (DramPool holds one lock; the vLLM scheduler is
single-threaded), so the hot path pays for no second lock.

Compact by construction: the per-object state lives in a table of plain arrays (the C `IndexTable` in
umbp.pool._native; its pure-Python twin umbp.pool.dram.index_table.PyIndexTable where the extension is not
built), keyed by a 128-bit keyed digest of the key, so millions of objects cost no Python objects and no
garbage-collector work. keep_keys=False (the vLLM scheduler) stores no key strings at all: evicted keys
then come back as their 16-byte digests (drain_evicted, on_evict, allocations). See docs/pool.md.
umbp.pool.dram.dict_index.DictIndex is the plain reference implementation of the same rules. With the C
table comes the C page allocator (PageRuns, the twin of umbp.pool.dram.allocator.PageAllocator).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from umbp.pool import native
from umbp.pool.dram.allocator import PageAllocator
from umbp.pool.dram.index_table import PyIndexTable
from umbp.pool.errors import (
    BufferSizeError,
    CapacityError,
    ObjectTooLargeError,
    OptionValueError,
    SlotStateError,
    human_bytes,
)

ABSENT, PENDING, COMMITTED, BUSY = "absent", "pending", "committed", "busy"
_STATES = (ABSENT, PENDING, COMMITTED, BUSY)  # the tables answer state() with an index into this


class Slot(NamedTuple):
    """Where an object lives in the arena. `checksum` is whatever the committer recorded (DramPool stores
    the psum64 of the bytes; the embedded connector may leave it None and keep checksums per worker).
    A NamedTuple rather than a frozen dataclass: it is built on every reserve and costs a fraction."""

    offset: int
    nbytes: int
    checksum: int | None = None


def check_capacity(capacity_bytes: Any, alignment: Any = 4096) -> None:
    """Raise a clear error for a capacity/alignment that cannot make an arena."""
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment < 8
        or alignment & (alignment - 1)
    ):
        raise OptionValueError(
            f"umbp: alignment must be a power of two >= 8 bytes, got {alignment!r}; the default 4096 suits KV pages"
        )
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise OptionValueError(
            f"umbp: capacity_bytes must be an int number of bytes, got {capacity_bytes!r}; "
            "e.g. capacity_bytes=8 << 30, or dram_gb=8 in options"
        )
    if capacity_bytes <= 0:
        raise CapacityError(
            f"umbp: capacity_bytes must be > 0, got {capacity_bytes}; set capacity_bytes (dram_gb) to the "
            "DRAM the pool may use, e.g. capacity_bytes=8 << 30"
        )
    if capacity_bytes < alignment:
        raise CapacityError(
            f"umbp: capacity_bytes={capacity_bytes} is smaller than one {alignment}-byte page; "
            "raise capacity_bytes (dram_gb)"
        )


def check_watermarks(high_watermark: Any, low_watermark: Any) -> None:
    ok = all(isinstance(w, int | float) and not isinstance(w, bool) for w in (high_watermark, low_watermark))
    if not ok or not 0 < low_watermark <= high_watermark <= 1:
        raise OptionValueError(
            "umbp: watermarks must satisfy 0 < low_watermark <= high_watermark <= 1, got "
            f"high_watermark={high_watermark!r}, low_watermark={low_watermark!r}; "
            "e.g. high_watermark=0.95, low_watermark=0.85"
        )


def too_large_error(key: str, nbytes: int, capacity_bytes: int) -> ObjectTooLargeError:
    return ObjectTooLargeError(
        f"umbp: object '{key}' is {human_bytes(nbytes)} but the DRAM arena holds {human_bytes(capacity_bytes)}; "
        "raise capacity_bytes (dram_gb) or store smaller pages"
    )


def make_table(alignment: int, keep_keys: bool, use_native: bool | None = None) -> Any:
    """The C IndexTable when the extension is loaded (or use_native=True), else its pure-Python twin."""
    if use_native is None:
        use_native = native.lib is not None
    if use_native and native.lib is None:
        raise ImportError(f"umbp: the native index table is unavailable: extension {native.why_not}")
    cls = native.lib.IndexTable if use_native else PyIndexTable
    return cls(os.urandom(16), alignment, Slot, keep_keys)


_UNPIN, _REMOVE, _CLEAR, _ABORT, _EVICT = range(5)  # PageRuns.hand_back's ops
_MAX_PAGES = (1 << 32) - 1  # pages of one object (a row's page count is 32 bits)


class DramIndex:
    """key -> Slot(offset, nbytes) inside a fixed capacity; no bytes. See the module docstring."""

    def __init__(
        self,
        capacity_bytes: int,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        alignment: int = 4096,
        *,
        track_evicted: bool = True,
        keep_keys: bool = True,
        use_native: bool | None = None,
        max_evict_objects: int | None = None,
        expected_objects: int | None = None,
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
        self._table = make_table(alignment, keep_keys, use_native)
        self.native = not isinstance(self._table, PyIndexTable)
        # the C allocator beside the C table (the Python one was most of a reserve+commit); same answers
        self._alloc = native.lib.PageRuns(self.npages) if self.native else PageAllocator(self.npages)
        # the most objects the owner expects (e.g. capacity / its smallest object): the table is sized for
        # them now, so it never grows while serving (a growth re-inserts every key: ~1 s at 16 M objects,
        # in the scheduler's step loop); more objects still fit, growing as usual
        if expected_objects is not None:
            if type(expected_objects) is not int or expected_objects < 0:  # noqa: E721 - bool is no count
                raise OptionValueError(
                    f"umbp: expected_objects must be an int >= 0, got {expected_objects!r}"
                )
            self._table.presize(min(expected_objects, self.npages))
        # called as on_evict([(key, slot), ...]) with LRU victims while their bytes are intact (tier
        # demotion): once per victim, or once per batched_evictions() block
        self.on_evict: Callable[[list[tuple[Any, Slot]]], None] | None = None
        self._deferred: list[tuple[Any, Slot]] | None = None
        # pages one watermark eviction frees at most (None: down to the low watermark); TieredPool sets it
        # to what the next tier can take in one call, so a burst of victims does not overflow it
        self.max_evict_pages: int | None = None
        # objects one watermark eviction takes at most (None: no limit): bounds the pause of the one
        # reservation that crosses the high watermark (at 30 M objects, 10% of them is ~1 s of evictions);
        # the rest go on later reservations, each still evicting whatever it needs to fit
        self.max_evict_objects: int | None = max_evict_objects
        self._track_evicted = track_evicted
        self._evicted: list[Any] = []
        self.evictions = 0
        self.evicted_bytes = 0
        self.reserve_failures = 0

    # ---- queries -------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str], touch: bool = False) -> list[bool]:
        """Committed keys only. touch=True also marks hits as recently used."""
        return self._table.lookup(keys, touch)

    def state(self, key: str) -> str:
        """'committed', 'pending' (reserved, not yet committed), 'busy' (removed but still pinned or
        being written: cannot be stored again until released) or 'absent'."""
        return _STATES[self._table.state(key)]

    def slot_of(self, key: str) -> Slot | None:
        """The committed slot of key without touching LRU order or pins."""
        return self._table.slot_of(key)

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key: object) -> bool:
        return self._table.contains(key)

    # ---- writes --------------------------------------------------------------------------------------

    def reserve(self, key: str, nbytes: int) -> Slot | None:
        """A slot for a new object, evicting LRU objects if needed; None if it cannot fit now (everything
        else pinned or being written) or the key is busy. The key stays invisible until commit()."""
        if self.native:  # the common case (absent key, fits without evicting) in one C call, same slot
            slot = self._alloc.reserve_row(self._table, key, nbytes, self._high_pages)
            if slot is not None:
                return slot
        if type(nbytes) is not int or nbytes < 0:  # noqa: E721 - exact type: bool is not a size
            raise BufferSizeError(
                f"umbp: object '{key}' has invalid size {nbytes!r}; sizes are ints >= 0 bytes"
            )
        if nbytes > self.capacity_bytes:
            raise too_large_error(key, nbytes, self.capacity_bytes)
        if nbytes > _MAX_PAGES * self.alignment:
            raise BufferSizeError(
                f"umbp: object '{key}' of {nbytes} bytes takes more than 2**32 - 1 pages of "
                f"{self.alignment} bytes (the most one object may have); use a larger alignment"
            )
        state = self._table.state(key)
        if state == 1 or state == 2:
            raise SlotStateError(
                f"umbp: reserve('{key}') but the key is already {_STATES[state]}; lookup()/state() first "
                "(a duplicate put is a no-op)"
            )
        # an empty object takes a page too: with none, nothing would ever evict it, and empty objects
        # could grow the index past any capacity
        npages = max(1, -(-nbytes // self.alignment))
        if state == 3 or npages > self._alloc.free_pages + self._table.lru_pages:
            self.reserve_failures += 1
            return None
        start = self._allocate(npages)
        if start is None:
            self.reserve_failures += 1
            return None
        try:
            return self._table.add(key, start, npages, nbytes)
        except BaseException:  # out of memory: nothing reserved (the C table adds no row), the pages back
            self._alloc.free(start, npages)
            raise

    def reserve_many(self, keys: Sequence[str], nbytes: int) -> list[Slot | None]:
        """Slots for several new objects of one size, adjacent in the arena when one free run can take
        them all after the usual watermark eviction (never evicting more just to get one): a run of
        adjacent slots is one copy for the transfer engine's DMA path instead of one per object.
        Otherwise exactly reserve() per key. Each slot is still committed, pinned and freed on its own."""
        keys = list(keys)
        if self.native:  # the common case (see reserve_row) in one C call, same slots
            slots = self._alloc.reserve_rows(self._table, keys, nbytes, self._high_pages)
            if slots is not None:
                return slots
        state = self._table.state
        simple = (
            len(keys) >= 2
            and len(set(keys)) == len(keys)
            and type(nbytes) is int  # noqa: E721
            and 0 < nbytes <= min(self.capacity_bytes, _MAX_PAGES * self.alignment)
            and all(state(k) == 0 for k in keys)
        )
        if not simple:  # reserve() gives each odd case its own answer or error
            return self._reserve_each(keys, nbytes)
        npages = -(-nbytes // self.alignment)
        total = npages * len(keys)
        start = None
        # made before the pages are taken (between that and the try, an allocation failing would leak
        # them); filled in place, which allocates nothing
        add, slots = self._table.add, [None] * len(keys)
        if total <= self._alloc.free_pages + self._table.lru_pages:
            self._make_room(total)
            start = self._alloc.alloc(total)
        if start is None:
            return self._reserve_each(keys, nbytes)
        try:
            for i, key in enumerate(keys):
                slots[i] = add(key, start + i * npages, npages, nbytes)
        except BaseException:  # out of memory part-way: the rows made so far dropped, every page back
            for key, slot in zip(keys, slots):
                if slot is not None:
                    self._table.abort(key)
            self._alloc.free(start, total)
            raise
        return slots

    def _reserve_each(self, keys: list[str], nbytes: int) -> list[Slot | None]:
        """reserve() per key. Out of memory part-way gives back the reservations made so far (the caller
        gets no slot to commit or abort them by); any other error keeps them, as the reference does."""
        slots: list[Slot | None] = [None] * len(keys)  # filled in place: storing allocates nothing
        try:
            for i, key in enumerate(keys):
                slots[i] = self.reserve(key, nbytes)
        except MemoryError:
            for key, slot in zip(keys, slots):
                if slot is not None:
                    self.abort(key)
            raise
        return slots

    def _make_room(self, npages: int) -> None:
        """Past the high watermark, evict least-recently-used objects down to the low one (at most
        max_evict_pages of them and max_evict_objects objects per call, at least one object)."""
        used = self.npages - self._alloc.free_pages
        if used + npages > self._high_pages:
            target = max(self._low_pages - npages, 0)
            budget = self.npages if self.max_evict_pages is None else self.max_evict_pages
            victims = self.max_evict_objects or -1
            if self.native and self.on_evict is None:  # the same loop in one C call
                count, nbytes, keys = self._alloc.evict_lru(
                    self._table, target, budget, victims, self._track_evicted
                )
                self.evictions += count
                self.evicted_bytes += nbytes
                if keys:
                    self._evicted.extend(keys)
                return
            freed = 0
            while self.npages - self._alloc.free_pages > target and freed < budget and victims:
                got = self._evict_one()
                if got is None:
                    break
                freed += got
                victims -= 1

    def _allocate(self, npages: int) -> int | None:
        self._make_room(npages)
        start = self._alloc.alloc(npages)
        while start is None and self._evict_one() is not None:
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

    def _evict_one(self) -> int | None:
        """Evict the least recently used object; returns its pages (None: nothing is evictable). Its
        pages are free before on_evict sees it (as in a batched_evictions block): an on_evict that raises
        or runs out of memory then loses no page."""
        victim = self._hand_back(_EVICT)
        if victim is None:
            return None
        key, slot, _start, npages = victim
        self.evictions += 1
        self.evicted_bytes += slot.nbytes
        if self._track_evicted:
            self._evicted.append(key)
        if self.on_evict is not None:  # the bytes are intact until the caller reuses the pages
            if self._deferred is not None:
                self._deferred.append((key, slot))
            else:
                self.on_evict([(key, slot)])
        return npages

    def commit(self, key: str, checksum: int | None = None) -> bool:
        """Make a reserved key visible. False if it was removed/cleared meanwhile (its pages are freed)."""
        done = self._table.commit(key, checksum)
        if done == 1:
            return True
        if done == -1:
            raise SlotStateError(f"umbp: commit('{key}') without a reservation; call reserve() first")
        self._hand_back(_ABORT, key)  # removed meanwhile: the reservation ends, its pages go back
        return False

    def abort(self, key: str) -> None:
        """Give a reservation back (the copy failed or was cancelled)."""
        if self._hand_back(_ABORT, key) is None:
            raise SlotStateError(f"umbp: abort('{key}') without a reservation")

    def pin(self, keys: Sequence[str]) -> list[Slot | None]:
        """Read-pin committed keys (None for a miss). Pins nest; every pin needs one unpin."""
        return self._table.pin(keys)

    def unpin(self, keys: Iterable[str]) -> None:
        bad = self._hand_back(_UNPIN, keys)[1]
        if bad is not None:
            raise SlotStateError(f"umbp: unpin('{bad}') without a matching pin")

    def remove(self, keys: Iterable[str]) -> int:
        """Make keys absent; returns how many were committed. Pinned/reserved pages are freed later."""
        return self._hand_back(_REMOVE, keys)[0]

    def clear(self) -> int:
        """Remove every object and cancel every reservation; returns how many objects were removed."""
        # the freed runs in page order (the table's answer): which free run the next reservation gets
        # then follows from the pages alone, not from the order the table keeps its rows in (the
        # reference index does the same)
        return self._hand_back(_CLEAR)[0]

    def _hand_back(self, op: int, arg: Any = ()) -> Any:
        """The table's unpin / remove / clear / abort / evict (op), and the pages it took off a row back
        in the allocator. With the C table, one C call that makes room for the freed runs first
        (PageRuns.hand_back): running out of memory then fails the op before the table takes a page off a
        row, never after, when those pages would be in no row and never free again."""
        if self.native:
            return self._alloc.hand_back(self._table, op, arg)
        t = self._table
        if op == _ABORT:
            res = t.abort(arg)
            runs = [res] if res is not None else []
        elif op == _EVICT:
            res = t.evict()
            runs = [res[2:]] if res is not None else []
        else:
            res = t.unpin(arg) if op == _UNPIN else t.remove(arg) if op == _REMOVE else t.clear()
            runs = res[0] if op == _UNPIN else res[1]
        self._alloc.free_many(runs)
        return res

    def drain_evicted(self) -> list[Any]:
        """Keys evicted since the last call (empty unless track_evicted), so the owner can tell others;
        with keep_keys=False, their 16-byte digests."""
        out, self._evicted = self._evicted, []
        return out

    # ---- reporting -----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        align = self.alignment
        used = (self.npages - self._alloc.free_pages) * align
        live, reserved, pinned, deferred, lru_pages, live_bytes, table_bytes = self._table.counters()
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": used,
            "stored_bytes": live_bytes,
            "free_bytes": self.capacity_bytes - used,
            "largest_free_bytes": self._alloc.largest_free() * align,
            "evictable_bytes": lru_pages * align,
            "objects": live,
            "reserved": reserved,
            "pinned": pinned,
            "deferred_frees": deferred,
            "evictions": self.evictions,
            "evicted_bytes": self.evicted_bytes,
            "reserve_failures": self.reserve_failures,
            "high_watermark": self.high_watermark,
            "low_watermark": self.low_watermark,
            "alignment": align,
            "index_table_bytes": table_bytes,
        }

    def allocations(self) -> list[tuple[Any, int, int, str]]:
        """(key, offset, allocated bytes, state) of every entry holding pages; for tests and debugging."""
        align = self.alignment
        return [
            (key, start * align, npages * align, state) for key, start, npages, state in self._table.rows()
        ]
