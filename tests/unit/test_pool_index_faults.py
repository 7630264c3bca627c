"""The scheduler's DRAM index under faults: bad keys, out of memory at each allocation in turn, finalizers
run by a garbage collection inside a call. Each must raise (or answer) with nothing lost: no page outside
a row and the allocator, no pin the caller never got, no key reserved without its slot, no two keys on one
slot. Most of these are the C table's own paths (umbp.pool._native); the bad-key and collection tests run
on both tables."""

import gc
import os

import pytest

from umbp.pool import native
from umbp.pool.dram.index import DramIndex
from umbp.pool.errors import BufferSizeError

ALIGN = 512


@pytest.fixture(params=[False, True], ids=["python", "native"])
def use_native(request) -> bool:
    if request.param:
        _native()
    return request.param


def _native() -> None:
    """Skips a test of the C table's paths without the extension (CI requires it: UMBP_REQUIRE_NATIVE=1)."""
    if native.lib is None:
        if os.environ.get("UMBP_REQUIRE_NATIVE") == "1":
            pytest.fail(f"UMBP_REQUIRE_NATIVE=1 but the extension is {native.why_not}")
        pytest.skip(f"the C extension is {native.why_not}")


def _pages(index) -> tuple:
    """What a call that failed must leave as it was: counters, rows, the pages in use."""
    stats = index.stats()
    stats.pop("index_table_bytes", None)
    return stats, sorted(index.allocations()), len(index)


@pytest.mark.parametrize("many", [False, True], ids=["reserve", "reserve_many"])
# 64 one-page slots: 8 stored (the one-call C paths), 64 (the full path evicts a run the batch fits in),
# 62 (evicting frees two pages apart from the two never used: reserve_many falls back to one per key)
@pytest.mark.parametrize("stored", [8, 64, 62], ids=["one-call", "evicting", "evicting-per-key"])
def test_running_out_of_memory_in_a_reservation_leaks_nothing(many, stored):
    """Out of memory at any one allocation inside reserve() or reserve_many() (CPython's allocation
    hooks fail the k-th, for every k until a call succeeds): the call raises MemoryError or succeeds,
    every page in use belongs to a row, and a failed call leaves none of its keys reserved (they reserve
    at once afterwards). The one-call C paths make every Slot before changing anything; the full path
    (here: evicting) gives back the rows and pages it took, and so does reserve_many's fallback of one
    reserve() per key."""
    _native()
    testcapi = pytest.importorskip("_testcapi")
    failures = 0
    for k in range(1, 400):
        index = DramIndex(64 * ALIGN, 1.0, 1.0, alignment=ALIGN, use_native=True)
        for i in range(stored):
            assert index.reserve(f"old/{i}", ALIGN) is not None and index.commit(f"old/{i}")
        keys = [f"new/{j}" for j in range(4 if many else 1)]
        call = index.reserve_many if many else index.reserve
        arg = keys if many else keys[0]
        got = None
        testcapi.set_nomemory(k, k + 1)
        try:  # nothing of the test's own allocates inside the window
            got = call(arg, ALIGN)
        except MemoryError:
            pass
        finally:
            testcapi.remove_mem_hooks()
        got = got if many or got is None else [got]
        assert sum(n for *_rest, n, _state in index.allocations()) == index.stats()["used_bytes"], k
        if got is not None:
            assert all(slot is not None for slot in got) and index.stats()["reserved"] == len(keys)
            break
        failures += 1
        assert index.stats()["reserved"] == 0 and all(index.state(key) == "absent" for key in keys), k
        assert all(slot is not None for slot in index.reserve_many(keys, ALIGN)), k
    else:
        pytest.fail("no call succeeded")
    assert failures >= 2  # every call allocates its Slot and offset: failures reached the index itself


@pytest.mark.parametrize("many", [False, True], ids=["reserve", "reserve_many"])
@pytest.mark.parametrize("evicting", [False, True], ids=["one-call", "evicting"])
def test_a_collection_inside_a_reservation_cannot_give_two_keys_one_slot(many, evicting):
    """Making a Slot is a tracked allocation, which can start a garbage collection, and a collection runs
    finalizers: any Python code, here one that reserves in the same index. With a collection at nearly
    every allocation and such a finalizer freed by each, every slot handed out is where its key's row
    is, no two overlap, and every key is found (a reservation looks at the table and the free runs only
    after it has made its Slots). Evicting: an arena of 256 pages, every key committed at once, so most
    reservations take the full path (IndexTable.add)."""
    _native()
    index = DramIndex((256 if evicting else 4096) * ALIGN, 1.0, 1.0, alignment=ALIGN, use_native=True)
    got: dict[str, tuple[int, int]] = {}

    def keep(keys, slots):
        for key, slot in zip(keys, slots):
            assert slot is not None, key
            got[key] = (slot.offset, slot.nbytes)
            if evicting:
                assert index.commit(key)

    class Reentrant:
        count = 0

        def __init__(self):
            self.cycle = self  # freed only by a collection

        def __del__(self):
            Reentrant.count += 1
            key = f"inner/{Reentrant.count}"
            keep([key], [index.reserve(key, ALIGN)])
            if Reentrant.count < 2000:
                Reentrant()  # garbage for the next collection, which may come inside a C call

    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1)  # a collection every other tracked allocation
    try:
        for i in range(300):
            Reentrant()
            keys = [f"outer/{i}/{j}" for j in range(3 if many else 1)]
            keep(keys, index.reserve_many(keys, ALIGN) if many else [index.reserve(keys[0], ALIGN)])
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
    assert Reentrant.count > 100  # finalizers did run, in the middle of the test's reservations
    rows = {key: (offset, n) for key, offset, n, _state in index.allocations()}
    assert {k: got[k][0] for k in rows} == {k: v[0] for k, v in rows.items()}
    assert len(rows) == (min(len(got), 256) if evicting else len(got))  # no row lost, none extra
    if evicting:
        assert index.lookup(list(rows)) == [True] * len(rows)
    spans = sorted(rows.values())
    assert all(a + n <= b for (a, n), (b, _m) in zip(spans, spans[1:])), "two rows share pages"
    assert index.stats()["reserved"] == (0 if evicting else len(got))


def _stored(index, n: int, pinned: int = 0, removed: int = 0) -> list[str]:
    """n committed one-page keys; the first `pinned` pinned, the first `removed` of those removed (doomed)."""
    keys = [f"k/{i}" for i in range(n)]
    for k in keys:
        assert index.reserve(k, ALIGN) is not None and index.commit(k)
    index.pin(keys[:pinned])
    index.remove(keys[:removed])
    return keys


@pytest.mark.parametrize("bad", [5, "\ud800"], ids=["not-str", "not-utf8"])
def test_a_bad_key_changes_nothing_in_pin_unpin_or_remove(use_native, bad):
    """A bad key anywhere in pin / unpin / remove raises before anything changes: found half-way, it left
    the keys before it pinned (a pin the caller never got back could never be undone, and those pages
    would never be evicted) or their pages in no row and never handed back."""
    index = DramIndex(64 * ALIGN, 1.0, 1.0, alignment=ALIGN, use_native=use_native)
    keys = _stored(index, 6, pinned=4, removed=2)  # k/0, k/1 doomed, k/2, k/3 pinned
    before = _pages(index)
    for call, arg in (
        (index.pin, [keys[4], bad]),
        (index.unpin, [keys[0], keys[2], bad]),
        (index.unpin, iter([keys[1], bad])),
        (index.remove, [keys[5], keys[3], bad]),
    ):
        with pytest.raises((TypeError, UnicodeEncodeError)):
            call(arg)
        assert _pages(index) == before, call.__name__
    index.unpin(keys[:4])  # every pin there was, once: the doomed keys' pages come back
    stats = index.stats()
    assert stats["pinned"] == 0 and stats["used_bytes"] == 4 * ALIGN and len(index) == 4


@pytest.mark.parametrize("op", ["pin", "unpin", "remove", "clear"])
def test_running_out_of_memory_in_pin_unpin_or_remove_changes_nothing(op):
    """Out of memory at any one allocation inside pin / unpin / remove / clear (as in the reservation test
    above): a failed call leaves counters, rows and pages as they were (the table hashes its keys, makes
    its Slots, runs and answer, and the allocator makes room for the runs, before anything changes, in one
    C call: PageRuns.hand_back); the call that succeeds hands back every page it freed."""
    _native()
    testcapi = pytest.importorskip("_testcapi")
    failures = 0
    for k in range(1, 400):
        index = DramIndex(64 * ALIGN, 1.0, 1.0, alignment=ALIGN, use_native=True)
        keys = _stored(index, 12, pinned=8, removed=4)
        arg = {"pin": keys[2:10], "unpin": keys[:6], "remove": keys[3:11]}.get(op)
        call = getattr(index, op)
        before = _pages(index)
        done = False
        testcapi.set_nomemory(k, k + 1)
        try:  # nothing of the test's own allocates inside the window
            call(arg) if arg is not None else call()
            done = True
        except MemoryError:
            pass
        finally:
            testcapi.remove_mem_hooks()
        rows = index.allocations()
        assert sum(n for *_rest, n, _state in rows) == index.stats()["used_bytes"], (op, k)
        if done:
            break
        failures += 1
        assert _pages(index) == before, (op, k)
    else:
        pytest.fail("no call succeeded")
    assert failures >= 1, op  # the failures reached the index's own allocations (small tuples and lists
    # come from free lists, so fewer calls allocate than make objects)
    assert _pages(index) != before


@pytest.mark.parametrize("op", ["remove", "clear"])
def test_a_collection_inside_a_removal_cannot_free_pages_it_pins(use_native, op):
    """A removal makes a run tuple per freed row, and a collection started there runs finalizers: here one
    that pins the very keys being removed. Every pin it gets must keep its pages (the row doomed, not
    freed): pages freed under a pin would go to the next reservation while a reader still copies them.
    Each removal runs with a collection due at every tracked allocation and the free list of 2-tuples
    drained (a tuple from it is no allocation, and starts no collection)."""
    index = DramIndex(4096 * ALIGN, 1.0, 1.0, alignment=ALIGN, use_native=use_native)
    held: dict[str, int] = {}
    batch: list[str] = []

    class Reentrant:
        count = turn = 0

        def __init__(self):
            self.cycle = self  # freed only by a collection

        def __del__(self):
            Reentrant.count += 1
            Reentrant.turn += 1
            if Reentrant.turn < 4:
                Reentrant()  # for the next collection: the first may come before the removal starts
            if Reentrant.turn >= 2:
                for key, slot in zip(batch, index.pin(batch)):
                    if slot is not None:
                        held.setdefault(key, slot.offset)

    threshold = gc.get_threshold()
    gc.collect()
    try:
        for i in range(300):
            batch[:] = [f"k/{i}/{j}" for j in range(3)]
            for key in batch:
                assert index.reserve(key, ALIGN) is not None and index.commit(key)
            hog = [(j, -j) for j in range(2500)]
            Reentrant.turn = 0
            Reentrant()
            gc.set_threshold(1)
            if op == "clear":
                index.clear()
            else:
                index.remove(batch)
            gc.set_threshold(*threshold)
            del hog
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
    assert Reentrant.count > 100 and held
    rows = {key: offset for key, offset, _n, _state in index.allocations()}
    assert {k: rows.get(k) for k in held} == held, "pages freed under a pin"


def _fragmented(index, doomed: bool) -> None:
    """66 one-page keys, k/64 only reserved (and removed with `doomed`), then every other key of the
    first 62 removed: 32 free runs, so the next isolated run freed makes the allocator grow."""
    for i in range(66):
        assert index.reserve(f"k/{i}", ALIGN) is not None
        if i != 64:
            index.commit(f"k/{i}")
    if doomed:
        index.remove(["k/64"])
    index.remove([f"k/{i}" for i in range(1, 62, 2)])


@pytest.mark.parametrize("op", ["abort", "commit-removed", "evict"])
def test_running_out_of_memory_when_a_reservation_ends_or_an_object_is_evicted_loses_no_page(op):
    """abort(), the commit of a reservation removed meanwhile, and an eviction take a row's pages off it
    and free them; freeing can need the allocator to grow (here: 32 free runs, and the run freed has no
    free neighbour). Out of memory at any one allocation leaves every page in use in a row
    (PageRuns.hand_back makes the allocator's room before the table changes the row; before, the row
    went first and a free that could not grow lost its pages)."""
    _native()
    testcapi = pytest.importorskip("_testcapi")
    failures = 0
    for k in range(1, 400):
        index = DramIndex(200 * ALIGN, 1.0, 1.0, alignment=ALIGN, use_native=True)
        if op == "evict":
            index = DramIndex(64 * ALIGN, 1.0, 1.0, alignment=ALIGN, use_native=True)
            index.on_evict = lambda victims: None
            _stored(index, 64)
            index.remove([f"k/{i}" for i in range(1, 62, 2)])
            for i in range(1, 62, 2):  # refilled: the LRU's head k/0 frees an isolated run
                assert index.reserve(f"f/{i}", ALIGN) is not None and index.commit(f"f/{i}")
        else:
            _fragmented(index, doomed=op == "commit-removed")
        objects = len(index)
        done = False
        testcapi.set_nomemory(k, k + 1)
        try:  # nothing of the test's own allocates inside the window
            if op == "abort":
                index.abort("k/64")
            elif op == "commit-removed":
                index.commit("k/64")
            else:
                index.reserve("new", 2 * ALIGN)
            done = True
        except MemoryError:
            failures += 1
        finally:
            testcapi.remove_mem_hooks()
        rows = index.allocations()
        assert sum(n for *_rest, n, _state in rows) == index.stats()["used_bytes"], (op, k)
        assert op == "evict" or len(index) >= objects - 1, (op, k)
        if done:
            break
    else:
        pytest.fail("no call succeeded")
    assert failures >= (op == "evict")  # (the aborts find room made by the removals before them)


def test_an_evict_callback_that_raises_loses_no_page():
    _native()
    index = DramIndex(8 * ALIGN, 1.0, 1.0, alignment=ALIGN, use_native=True)
    index.on_evict = lambda victims: (_ for _ in ()).throw(RuntimeError("next tier down"))
    _stored(index, 8)
    with pytest.raises(RuntimeError):
        index.reserve("x", ALIGN)
    assert index.stats()["used_bytes"] == 7 * ALIGN and len(index) == 7 and index.evictions == 1
    assert index.reserve("x", ALIGN) is not None  # the victim's page is free


def test_an_object_of_more_than_two_to_the_32_pages_is_refused(use_native):
    """A row's page count is 32 bits: an object of more pages (a small alignment and a large arena) is
    refused with one clear error, not stored with its page count cut (which left pages used for good)."""
    index = DramIndex(1 << 37, 1.0, 1.0, alignment=8, use_native=use_native)
    for call, arg in ((index.reserve, "a"), (index.reserve_many, ["a", "b"])):
        with pytest.raises(BufferSizeError, match="2\\*\\*32 - 1 pages"):
            call(arg, ((1 << 32) + 1) * 8)
    assert index.stats()["used_bytes"] == 0 and index.stats()["reserved"] == 0
    slot = index.reserve("a", ((1 << 32) - 1) * 8)  # the most pages one object may have
    assert slot is not None and index.commit("a") and index.remove(["a"]) == 1
    assert index.stats()["used_bytes"] == 0
    if use_native:
        with pytest.raises(OverflowError):
            index._table.add("b", 0, 1 << 32, 8)


def test_running_out_of_memory_in_a_watermark_eviction_counts_every_victim():
    """The one-call watermark eviction (PageRuns.evict_lru) takes victims one by one; out of memory
    part-way stops it there and answers the victims taken so far (they are gone: counted and reported),
    rather than raising with them neither counted nor reported."""
    _native()
    testcapi = pytest.importorskip("_testcapi")
    for k in range(1, 300):
        index = DramIndex(64 * ALIGN, 0.5, 0.25, alignment=ALIGN, use_native=True)
        keys = _stored(index, 32)
        index.remove(keys[1::4])  # holes: victims free isolated runs too
        for i in range(8):
            assert index.reserve(f"g/{i}", ALIGN) is not None and index.commit(f"g/{i}")
        index.drain_evicted()
        objects = len(index)
        done = False
        testcapi.set_nomemory(k, k + 1)
        try:  # nothing of the test's own allocates inside the window
            index.reserve("new", ALIGN)
            done = True
        except MemoryError:
            pass
        finally:
            testcapi.remove_mem_hooks()
        assert objects - len(index) == index.evictions == len(index.drain_evicted()), k
        if done:
            break
    else:
        pytest.fail("no call succeeded")
    assert index.evictions > 1


def test_the_c_types_cannot_be_made_without_their_arguments():
    """An IndexTable or PageRuns made by __new__ alone had no arrays, and its methods read through NULL
    (a crash); they are made and set up in one step now."""
    _native()
    for cls in (native.lib.IndexTable, native.lib.PageRuns):
        with pytest.raises(TypeError):
            cls.__new__(cls)
    assert native.lib.PageRuns(10).free_pages == 10
