"""PageAllocator and DramIndex invariants, property-based: no overlap, capacity never exceeded, LRU order,
pinned objects survive eviction pressure, deferred frees."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.pool import DramIndex, PageAllocator, SlotStateError

# ---- PageAllocator --------------------------------------------------------------------------------------


def _check_allocator(a: PageAllocator, live: dict[int, int], npages: int) -> None:
    owner = [None] * npages
    for start, n in live.items():
        assert 0 <= start and start + n <= npages
        for p in range(start, start + n):
            assert owner[p] is None, "two live runs overlap"
            owner[p] = "live"
    runs = a.free_runs()
    for start, n in runs:
        for p in range(start, start + n):
            assert owner[p] is None, "a free run overlaps a live one"
            owner[p] = "free"
    assert all(o is not None for o in owner), "pages leaked"
    assert a.free_pages == sum(n for _, n in runs)
    for (s1, n1), (s2, _) in zip(runs, runs[1:], strict=False):
        assert s1 + n1 < s2, "adjacent free runs were not coalesced"
    assert a.largest_free() == max((n for _, n in runs), default=0)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    npages=st.integers(1, 48),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 10**6)), max_size=60),
)
def test_allocator_never_overlaps_or_leaks(npages, ops):
    a, live = PageAllocator(npages), {}
    for is_alloc, n, pick in ops:
        if is_alloc or not live:
            start = a.alloc(n)
            if start is None:
                assert a.largest_free() < n  # None only when no free run is long enough
            else:
                live[start] = n
        else:
            start = sorted(live)[pick % len(live)]
            a.free(start, live.pop(start))
        _check_allocator(a, live, npages)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(size=st.integers(1, 8), frees=st.lists(st.integers(0, 10**6), max_size=30))
def test_same_size_objects_pack_without_fragmentation(size, frees):
    npages = size * 20
    a = PageAllocator(npages)
    live = [a.alloc(size) for _ in range(20)]
    assert None not in live and a.alloc(size) is None and a.free_pages == 0
    freed = 0
    for pick in frees:
        if live:
            a.free(live.pop(pick % len(live)), size)
            freed += 1
    for _ in range(freed):  # every freed slot is reusable: no fragmentation
        assert a.alloc(size) is not None
    assert a.free_pages == 0


def test_best_fit_reuses_an_exact_hole():
    a = PageAllocator(20)
    first, hole, third = a.alloc(4), a.alloc(4), a.alloc(4)
    a.free(hole, 4)
    assert a.alloc(4) == hole  # not carved from the 8-page tail
    assert a.free_runs() == [(12, 8)] and first == 0 and third == 8


# ---- DramIndex against a model --------------------------------------------------------------------------

ALIGN = 64
KEYS = [f"k{i}" for i in range(10)]


class _IndexModel:
    """Drives a DramIndex and checks every step against a plain-Python model of what must hold."""

    def __init__(self, capacity_pages: int, high: float, low: float) -> None:
        self.index = DramIndex(capacity_pages * ALIGN, high, low, alignment=ALIGN)
        self.committed: set[str] = set()
        self.recency: list[str] = []  # committed keys, least recently used first
        self.pins: dict[str, int] = {}
        self.pending: list[str] = []

    def _touch(self, key: str) -> None:
        self.recency.remove(key)
        self.recency.append(key)

    def reserve(self, key: str, nbytes: int) -> None:
        state = self.index.state(key)
        if state in ("committed", "pending"):
            with pytest.raises(SlotStateError):
                self.index.reserve(key, nbytes)
            return
        expected_victims = [k for k in self.recency if not self.pins.get(k)]
        slot = self.index.reserve(key, nbytes)
        victims = self.index.drain_evicted()
        assert victims == expected_victims[: len(victims)], "eviction must follow LRU order"
        for v in victims:  # pinned objects are never among them (they are not in expected_victims)
            self.committed.discard(v)
            self.recency.remove(v)
        if slot is None:
            # an empty object takes a page too
            assert state == "busy" or self.index.stats()["largest_free_bytes"] < max(nbytes, 1)
            return
        assert slot.nbytes == nbytes and slot.offset % ALIGN == 0
        assert not self.index.lookup([key])[0], "a reserved key must be invisible"
        self.pending.append(key)

    def reserve_many(self, keys: list[str], nbytes: int) -> None:
        """Like reserve() for each key (the odd cases are reserve()'s own, tested there)."""
        if len(set(keys)) < len(keys) or any(self.index.state(k) in ("committed", "pending") for k in keys):
            return
        expected_victims = [k for k in self.recency if not self.pins.get(k)]
        slots = self.index.reserve_many(keys, nbytes)
        victims = self.index.drain_evicted()
        assert victims == expected_victims[: len(victims)], "eviction must follow LRU order"
        for v in victims:
            self.committed.discard(v)
            self.recency.remove(v)
        for key, slot in zip(keys, slots, strict=True):
            if slot is not None:
                assert slot.nbytes == nbytes and slot.offset % ALIGN == 0
                assert not self.index.lookup([key])[0], "a reserved key must be invisible"
                self.pending.append(key)

    def finish(self, pick: int, commit: bool) -> None:
        if not self.pending:
            return
        key = self.pending.pop(pick % len(self.pending))
        if not commit:
            self.index.abort(key)
            return
        doomed = self.index.state(key) == "busy"
        assert self.index.commit(key, checksum=7) is (not doomed)
        if not doomed:
            self.committed.add(key)
            self.recency.append(key)
            assert self.index.slot_of(key).checksum == 7

    def pin(self, key: str) -> None:
        (slot,) = self.index.pin([key])
        assert (slot is not None) == (key in self.committed)
        if slot is not None:
            self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, pick: int) -> None:
        keys = sorted(k for k, n in self.pins.items() if n)
        if not keys:
            return
        key = keys[pick % len(keys)]
        self.index.unpin([key])
        self.pins[key] -= 1
        if self.pins[key] == 0 and key in self.committed:
            self._touch(key)

    def lookup(self, key: str, touch: bool) -> None:
        assert self.index.lookup([key], touch=touch) == [key in self.committed]
        if touch and key in self.committed and not self.pins.get(key):
            self._touch(key)

    def remove(self, key: str) -> None:
        assert self.index.remove([key]) == (key in self.committed)
        if key in self.committed:
            self.committed.discard(key)
            self.recency.remove(key)

    def clear(self) -> None:
        assert self.index.clear() == len(self.committed)
        self.committed.clear()
        self.recency.clear()

    def check(self) -> None:
        spans = sorted((off, off + n) for _, off, n, _ in self.index.allocations() if n)
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start, "two live slots overlap"
        stats = self.index.stats()
        assert all(0 <= s and e <= self.index.capacity_bytes for s, e in spans)
        assert stats["used_bytes"] == sum(e - s for s, e in spans) <= stats["capacity_bytes"]
        assert self.index.lookup(KEYS) == [k in self.committed for k in KEYS]
        assert stats["pinned"] == sum(1 for n in self.pins.values() if n)
        for key, n in self.pins.items():  # pinned objects keep their slot even under pressure
            if n and key in self.committed:
                assert self.index.slot_of(key) is not None


# op weights: reserve and finish dominate so the arena fills and eviction, pins and deferred frees happen
_OPS = (
    ["reserve"] * 6
    + ["reserve_many"] * 2
    + ["finish"] * 5
    + ["pin"] * 3
    + ["unpin"] * 3
    + ["lookup"] * 2
    + ["remove"] * 2
    + ["clear"]
)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    capacity_pages=st.integers(1, 24),
    marks=st.sampled_from([(1.0, 1.0), (0.9, 0.5), (0.75, 0.25)]),
    ops=st.lists(
        st.tuples(st.sampled_from(_OPS), st.sampled_from(KEYS), st.integers(0, 6 * ALIGN), st.integers(0, 7)),
        min_size=40,
        max_size=120,
    ),
)
def test_index_invariants_hold_under_random_calls(capacity_pages, marks, ops):
    model = _IndexModel(capacity_pages, *marks)
    for op, key, nbytes, dice in ops:
        if op == "reserve" and nbytes <= model.index.capacity_bytes:
            model.reserve(key, nbytes)
        elif op == "reserve_many" and nbytes <= model.index.capacity_bytes:
            model.reserve_many(
                [key] + [KEYS[(KEYS.index(key) + j) % len(KEYS)] for j in (dice + 1, dice + 3)], nbytes
            )
        elif op == "finish":
            model.finish(nbytes, commit=dice != 0)
        elif op == "pin":
            model.pin(key)
        elif op == "unpin":
            model.unpin(nbytes)
        elif op == "lookup":
            model.lookup(key, touch=dice % 2 == 1)
        elif op == "remove":
            model.remove(key)
        elif op == "clear" and dice == 0:
            model.clear()
        model.check()


# ---- DramIndex examples -------------------------------------------------------------------------------------


def _filled(
    capacity_objects: int, high: float = 1.0, low: float = 1.0, count: int | None = None
) -> DramIndex:
    index = DramIndex(capacity_objects * 4096, high, low)
    for i in range(capacity_objects if count is None else count):
        index.reserve(f"k{i}", 4096)
        index.commit(f"k{i}")
    return index


def test_watermarks_evict_lru_down_to_low():
    index = _filled(10, high=0.9, low=0.5, count=9)  # 9/10 pages: at the high watermark, not above
    assert index.stats()["evictions"] == 0
    index.lookup(["k0"], touch=True)  # k0 becomes most recently used
    assert index.reserve("new", 4096) is not None  # 10/10 > 90%: evict to <= 50% including "new"
    assert index.drain_evicted() == ["k1", "k2", "k3", "k4", "k5"]
    assert index.lookup(["k0", "k6", "k8"]) == [True, True, True]
    assert index.stats()["used_bytes"] == 5 * 4096


def test_pinned_survive_and_reserve_fails_when_all_pinned():
    index = _filled(4)
    slots = index.pin(["k0", "k1", "k2", "k3"])
    assert None not in slots
    assert index.reserve("new", 4096) is None
    assert index.stats()["reserve_failures"] == 1 and index.drain_evicted() == []
    index.unpin(["k2"])
    assert index.reserve("new", 4096).offset == slots[2].offset
    assert index.drain_evicted() == ["k2"]


def test_remove_of_pinned_defers_the_free_until_unpin():
    index = _filled(2)
    (slot,) = index.pin(["k0"])
    assert index.remove(["k0"]) == 1
    assert index.lookup(["k0"]) == [False] and index.state("k0") == "busy"
    assert index.reserve("k0", 4096) is None  # the old bytes are still being read
    assert index.reserve("x", 4096) is not None and index.drain_evicted() == ["k1"]  # never k0's pages
    index.unpin(["k0"])
    assert index.state("k0") == "absent" and index.stats()["deferred_frees"] == 0
    assert index.reserve("y", 4096).offset == slot.offset


def test_remove_during_write_cancels_the_commit():
    index = DramIndex(8 * 4096)
    index.reserve("a", 100)
    index.remove(["a"])
    assert index.commit("a") is False and index.lookup(["a"]) == [False]
    assert index.stats()["used_bytes"] == 0
    with pytest.raises(SlotStateError):
        index.commit("a")
    with pytest.raises(SlotStateError):
        index.unpin(["a"])


def test_reserve_many_hands_out_adjacent_slots_when_a_run_is_free():
    index = DramIndex(16 * 4096)
    slots = index.reserve_many(["a", "b", "c", "d"], 5000)  # 2 pages each
    assert [s.offset for s in slots] == [0, 8192, 16384, 24576]
    for k in "abcd":
        index.commit(k)
    index.remove(["b"])  # each object is still freed on its own
    assert index.stats()["used_bytes"] == 6 * 4096


def test_reserve_many_falls_back_to_holes_when_no_run_is_long_enough():
    index = _filled(8)
    index.remove(["k0", "k2", "k4", "k6"])  # four one-page holes, no two adjacent
    slots = index.reserve_many(["x", "y"], 4096)
    assert None not in slots and len({s.offset for s in slots}) == 2
    assert {s.offset for s in slots} <= {0, 2 * 4096, 4 * 4096, 6 * 4096}
    assert index.stats()["evictions"] == 0  # contiguity never costs an eviction
    with pytest.raises(SlotStateError):
        index.reserve_many(["k1", "z"], 4096)  # a committed key: reserve()'s error
