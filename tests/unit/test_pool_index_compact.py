"""The compact DramIndex (C IndexTable and its pure-Python twin) against the reference DictIndex: every
operation of random sequences gives the same answer, slot, error and stats; plus what compactness
promises (no Python object per stored object, digests that never alias, keys kept only on request)."""

import gc
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.pool import native
from umbp.pool.dram.dict_index import DictIndex
from umbp.pool.dram.index import DramIndex
from umbp.pool.errors import OptionValueError

ALIGN = 512
KEYS = [f"key/{i}" for i in range(5)] + ["ключ-é"]  # a non-ASCII key goes through UTF-8 too
TABLES = [False, True]  # use_native


def _native_or_skip(use_native: bool) -> None:
    if use_native and native.lib is None:
        if os.environ.get("UMBP_REQUIRE_NATIVE") == "1":
            pytest.fail(f"UMBP_REQUIRE_NATIVE=1 but the extension is {native.why_not}")
        pytest.skip(f"the C extension is {native.why_not}")


def _call(index, name, *args):
    """(result, exception type) of one operation, so two indexes can be compared error for error."""
    try:
        return getattr(index, name)(*args), None
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return None, type(exc)


def _snapshot(index) -> tuple:
    stats = index.stats()
    stats.pop("index_table_bytes", None)
    return stats, sorted(index.allocations()), len(index), index.drain_evicted()


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "put",
                "put",
                "put",
                "touch",
                "reserve",
                "reserve_many",
                "commit",
                "abort",
                "pin",
                "unpin",
                "remove",
                "lookup",
                "touch",
                "clear",
                "slot_of",
                "state",
            ]
        ),
        st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
        # bad sizes too: the C one-call reserve leaves every odd case to the full path's errors
        st.sampled_from([ALIGN, ALIGN, 2 * ALIGN, 0, 3 * ALIGN - 1, -1, True, 2**70, 1 << 62]),
        st.integers(0, 2**64 - 1) | st.none(),
    ),
    min_size=15,  # eviction (where LRU order shows) needs a few puts first
    max_size=80,
)


def _apply(index, op, keys, nbytes, checksum):
    if op == "put":  # reserve + commit: most sequences that reach eviction need several
        slot = _call(index, "reserve", keys[0], nbytes)
        return slot, _call(index, "commit", keys[0], checksum) if slot[0] is not None else None
    if op == "reserve":
        return _call(index, "reserve", keys[0], nbytes)
    if op == "reserve_many":
        return _call(index, "reserve_many", keys, nbytes)
    if op == "commit":
        return _call(index, "commit", keys[0], checksum)
    if op in ("pin", "unpin", "remove"):
        return _call(index, op, keys)
    if op in ("lookup", "touch"):
        return _call(index, "lookup", keys, op == "touch")
    if op == "clear":
        return _call(index, "clear")
    return _call(index, op, keys[0])


@pytest.mark.parametrize("use_native", TABLES)
@settings(max_examples=200, deadline=None)
@given(
    ops=OPS,
    pages=st.integers(2, 6),
    budget=st.none() | st.integers(1, 6),
    marks=st.sampled_from([(1.0, 1.0), (0.9, 0.6)]),
    expected=st.none() | st.integers(0, 5000),
    callback=st.booleans(),
)
def test_same_answers_as_the_reference(use_native, ops, pages, budget, marks, expected, callback):
    _native_or_skip(use_native)
    ref = DictIndex(pages * ALIGN, *marks, alignment=ALIGN)
    new = DramIndex(pages * ALIGN, *marks, alignment=ALIGN, use_native=use_native, expected_objects=expected)
    seen_ref, seen_new = [], []
    if callback:  # without one, the C index evicts in one call (PageRuns.evict_lru)
        ref.on_evict, new.on_evict = seen_ref.extend, seen_new.extend
    ref.max_evict_pages = new.max_evict_pages = budget
    for op, keys, nbytes, checksum in ops:
        assert _apply(new, op, keys, nbytes, checksum) == _apply(ref, op, keys, nbytes, checksum), op
        assert _snapshot(new) == _snapshot(ref)
        assert [k in new for k in KEYS] == [k in ref for k in KEYS]
    assert seen_new == seen_ref


@pytest.mark.parametrize("use_native", TABLES)
def test_without_keys_victims_come_back_as_distinct_digests(use_native):
    _native_or_skip(use_native)
    index = DramIndex(4 * ALIGN, 1.0, 1.0, alignment=ALIGN, keep_keys=False, use_native=use_native)
    for i in range(12):
        assert index.reserve(f"k{i}", ALIGN) is not None and index.commit(f"k{i}")
    evicted = index.drain_evicted()
    assert len(evicted) == 8 and len(set(evicted)) == 8
    assert all(isinstance(d, bytes) and len(d) == 16 for d in evicted)
    assert index.lookup([f"k{i}" for i in range(12)]) == [False] * 8 + [True] * 4


def test_many_keys_never_alias():
    """100,000 near-identical keys: each finds its own slot (a digest collision would return another's)."""
    _native_or_skip(True)
    n = 100_000
    index = DramIndex(n * ALIGN, 1.0, 1.0, alignment=ALIGN, keep_keys=False, use_native=True)
    keys = [f"ns/g0/{i:064x}" for i in range(n)]
    for k in keys:
        index.reserve(k, ALIGN)
        index.commit(k, len(k))
    assert len(index) == n and index.stats()["evictions"] == 0
    offsets = {index.slot_of(k).offset for k in keys}
    assert len(offsets) == n
    assert index.lookup([f"ns/g1/{i:064x}" for i in range(1000)]) == [False] * 1000
    index.remove(keys[::2])
    assert index.lookup(keys[:6]) == [False, True] * 3


def test_no_python_object_per_stored_object():
    """The C table holds 50,000 objects without the garbage collector seeing any more objects (the
    reference index adds several per object, which is what makes gen-2 collections long)."""
    _native_or_skip(True)
    n = 50_000
    index = DramIndex(n * ALIGN, alignment=ALIGN, keep_keys=False, use_native=True)
    keys = [f"k{i}" for i in range(n)]  # built before counting: the caller's strings are not the index's
    gc.collect()
    before = len(gc.get_objects())
    for k in keys:
        index.reserve(k, ALIGN)
        index.commit(k)
    index.pin(keys[:100])
    gc.collect()
    assert len(gc.get_objects()) - before < 100
    assert index.stats()["index_table_bytes"] < 128 * 2 * n  # rows grow by doubling


ROW_BYTES = 2 * 8 + 2 * 8 + 8 + 4 * 4 + 1  # digest, start, nbytes, checksum, 4 uint32 fields, state


def test_presized_table_never_grows():
    """expected_objects sizes the key table at once: filling that many objects never re-inserts the keys
    (the pause a growth causes: ~1 s at 16 M objects). Rows cost only as they are used."""
    _native_or_skip(True)
    n = 20_000
    index = DramIndex(
        n * ALIGN, 1.0, 1.0, alignment=ALIGN, keep_keys=False, use_native=True, expected_objects=n
    )
    key_table = index.stats()["index_table_bytes"]
    assert key_table >= 2 * n * 4  # load <= 1/2 from the start, and no row touched yet
    for i in range(n):
        index.reserve(f"k{i}", ALIGN)
        index.commit(f"k{i}")
    assert index.stats()["index_table_bytes"] - n * ROW_BYTES == key_table
    index.reserve("one more", ALIGN)  # past the expected count: it still fits, by evicting
    assert len(index) == n - 1 and index.lookup([f"k{n - 1}"]) == [True]
    with pytest.raises(OptionValueError):
        DramIndex(n * ALIGN, alignment=ALIGN, expected_objects=-1)


def test_max_evict_objects_bounds_one_watermark_eviction():
    """Crossing the high watermark evicts at most max_evict_objects objects per reservation (the pause
    it bounds; without it the first crossing would evict down to the low watermark, 40 objects here),
    while a reservation that needs more room still gets it."""
    index = DramIndex(100 * ALIGN, 0.9, 0.5, alignment=ALIGN, max_evict_objects=3)
    for i in range(200):
        before = index.evictions
        assert index.reserve(f"k{i}", ALIGN) is not None and index.commit(f"k{i}")
        assert index.evictions - before <= 3
        assert index.stats()["used_bytes"] <= 90 * ALIGN
    assert index.evictions >= 110
    before = index.evictions
    assert index.reserve("big", 20 * ALIGN) is not None  # needs more than 3 victims: it gets them
    assert index.evictions - before > 3


def test_one_key_in_different_str_objects_is_one_row():
    """The C table remembers the digests of the str objects it hashed lately (by object): an equal key in
    another object, or in a str subclass (never remembered), must still find the same row."""
    _native_or_skip(True)

    class Key(str):
        pass

    index = DramIndex(64 * ALIGN, 1.0, 1.0, alignment=ALIGN, use_native=True)
    first, literal = "".join(["ns/", "a"]), "ns/a"  # equal keys in two objects
    assert first == literal and first is not literal
    assert index.reserve(first, ALIGN) is not None
    assert index.commit("ns/a") and index.lookup([Key("ns/a")]) == [True]
    assert index.pin([Key("ns/a")])[0] == index.slot_of(first)
    index.unpin(["ns/a"])
    slots = index.reserve_many([Key("ns/b"), "".join(["ns/", "c"])], ALIGN)
    assert slots[1].offset == slots[0].offset + ALIGN  # the one-call path: adjacent slots
    assert index.commit("ns/b") and index.commit("ns/c")
    assert index.lookup(["ns/a", "ns/b", "ns/c", "ns/d"]) == [True, True, True, False]
    assert index.remove([Key("ns/b")]) == 1 and index.lookup(["ns/b"]) == [False]


def test_reserve_many_grows_the_table_as_the_reference_would():
    """Batches of reservations in one C call past the first row and key-table sizes (1,024 rows, 4,096
    cells), with removals between so rows come from the free list and from fresh memory in one batch: the
    same slots, answers and stats as the reference index."""
    _native_or_skip(True)
    ref = DictIndex(6000 * ALIGN, 1.0, 1.0, alignment=ALIGN)
    new = DramIndex(6000 * ALIGN, 1.0, 1.0, alignment=ALIGN, use_native=True)
    peak = 0
    for batch in range(40):
        keys = [f"b{batch}/{i}" for i in range(37 + batch * 5)]
        assert new.reserve_many(keys, ALIGN) == ref.reserve_many(keys, ALIGN)
        peak = max(peak, len(new) + new.stats()["reserved"])
        for i, k in enumerate(keys):
            if i % 3 == 1:
                new.abort(k)
                ref.abort(k)
            else:
                assert new.commit(k, batch) == ref.commit(k, batch)
        gone = [f"b{batch - 1}/{i}" for i in range(0, 100, 2)]
        assert new.remove(gone) == ref.remove(gone)
        assert _snapshot(new) == _snapshot(ref)
    assert len(new) > 1024 and peak > 2048  # rows past the first 1,024; the 4,096-cell key table doubled
