"""DramPool behaviour: round trips for every buffer kind, duplicate puts, eviction, pins, checksum
corruption, stats, and a property test against a dict model."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.pool import DramPool, Pool

KiB = 1024


pytestmark = pytest.mark.usefixtures("impl")  # each test on the C extension's paths and on the Python ones


def _blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def pool():
    p = DramPool(capacity_bytes=256 * KiB, pinned=False)
    yield p
    p.close()


def test_is_a_pool_and_reports_backend(pool):
    assert isinstance(pool, Pool)
    stats = pool.stats()
    assert stats["arena_backend"] == "numpy" and stats["pinned_memory"] is False
    assert stats["capacity_bytes"] == 256 * KiB


@pytest.mark.parametrize("n", [0, 1, 7, 4095, 4096, 4097, 100_003])
def test_round_trip_sizes(pool, n):
    data = _blob(n, n)
    assert pool.put(["k"], [data]) == [True]
    out = bytearray(n)
    assert pool.get_into(["k"], [out]) == [True]
    assert bytes(out) == data


def test_round_trip_buffer_kinds(pool):
    data = np.arange(3000, dtype=np.float32)
    assert (
        pool.put(["np", "mv", "ba"], [data, memoryview(data.tobytes()), bytearray(data.tobytes())])
        == [True] * 3
    )
    out_np = np.empty(3000, np.float32)
    out_u8 = np.empty((100, 120), np.uint8)
    out_mv = memoryview(bytearray(12000))
    assert pool.get_into(["np", "mv", "ba"], [out_np, out_u8, out_mv]) == [True] * 3
    assert np.array_equal(out_np, data)
    assert out_u8.tobytes() == data.tobytes() == bytes(out_mv)


def test_round_trip_torch_tensors(pool):
    torch = pytest.importorskip("torch")
    src = torch.arange(2048, dtype=torch.bfloat16).reshape(32, 64)  # a dtype numpy cannot even name
    assert pool.put(["t"], [src]) == [True]
    dst = torch.empty_like(src)
    assert pool.get_into(["t"], [dst]) == [True]
    assert torch.equal(src, dst)


def test_duplicate_put_is_a_noop(pool):
    assert pool.put(["k"], [b"first"]) == [True]
    assert pool.put(["k", "k"], [b"other", b"again"]) == [True, True]
    out = bytearray(5)
    assert pool.get_into(["k"], [out]) == [True] and out == b"first"
    stats = pool.stats()
    assert stats["puts"] == 1 and stats["put_duplicates"] == 2 and stats["objects"] == 1


def test_exists_remove_clear_and_counters(pool):
    pool.put(["a", "b", "c"], [b"1", b"22", b"333"])
    assert pool.exists(["a", "x", "c"]) == [True, False, True]
    assert pool.remove(["a", "x", "a"]) == 1
    assert pool.get_into(["a", "b"], [bytearray(1), bytearray(2)]) == [False, True]
    pool.clear()
    assert pool.exists(["b", "c"]) == [False, False]
    stats = pool.stats()
    assert (stats["hits"], stats["misses"], stats["objects"], stats["used_bytes"]) == (1, 1, 0, 0)
    assert stats["bytes_read"] == 2 and stats["bytes_written"] == 6


def test_lru_eviction_keeps_recently_read_objects():
    pool = DramPool(capacity_bytes=10 * 4 * KiB, high_watermark=1.0, low_watermark=0.8, pinned=False)
    keys = [f"k{i}" for i in range(10)]
    assert all(pool.put(keys, [_blob(4 * KiB, i) for i in range(10)]))
    assert pool.get_into(["k0"], [bytearray(4 * KiB)]) == [True]  # k0 is now most recently used
    assert pool.put(["new"], [_blob(4 * KiB, 99)]) == [True]  # full: evict down to 80%
    assert pool.exists(keys) == [True, False, False, False] + [True] * 6
    assert pool.stats()["evictions"] == 3


def test_pinned_object_survives_pressure_and_put_fails_when_all_pinned():
    pool = DramPool(capacity_bytes=4 * 4 * KiB, high_watermark=1.0, low_watermark=1.0, pinned=False)
    pool.put(["a", "b", "c", "d"], [_blob(4 * KiB, i) for i in range(4)])
    pool.index.pin(["a", "b", "c", "d"])  # as if four readers were copying right now
    assert pool.put(["e"], [_blob(4 * KiB, 9)]) == [False]
    assert pool.stats()["put_failures"] == 1
    pool.index.unpin(["b", "c", "d"])
    assert pool.put(["e", "f", "g"], [_blob(4 * KiB, 9 + i) for i in range(3)]) == [True] * 3
    out = bytearray(4 * KiB)
    assert pool.exists(["a"]) == [True] and pool.get_into(["a"], [out]) == [True] and out == _blob(4 * KiB, 0)
    pool.index.unpin(["a"])
    assert pool.stats()["pinned"] == 0


def test_checksum_corruption_is_a_counted_miss_and_drops_the_object(pool):
    data = _blob(10_000, 1)
    pool.put(["k", "ok"], [data, b"fine"])
    slot = pool.index.slot_of("k")
    pool.arena.view(slot.offset, slot.nbytes)[1234] ^= 0x10  # one flipped bit in DRAM
    out = bytearray(10_000)
    assert pool.get_into(["k", "ok"], [out, bytearray(4)]) == [False, True]
    stats = pool.stats()
    assert stats["checksum_failures"] == 1 and stats["misses"] == 1 and stats["hits"] == 1
    assert pool.exists(["k"]) == [False]  # gone: it never serves bad data again
    assert pool.put(["k"], [data]) == [True] and pool.get_into(["k"], [out]) == [True] and bytes(out) == data


def test_from_options_builds_an_equivalent_pool():
    pool = DramPool.from_options(
        {
            "dram_gb": 1 / 1024,
            "high_watermark": 0.9,
            "low_watermark": 0.7,
            "pinned": "false",
            "alignment": 512,
            "prefault": False,
        }
    )
    stats = pool.stats()
    assert stats["capacity_bytes"] == 1 << 20 and stats["alignment"] == 512
    assert (stats["high_watermark"], stats["low_watermark"]) == (0.9, 0.7)
    assert pool.put(["x"], [b"abc"]) == [True]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "put", "get", "get", "remove"]),
            st.integers(0, 11),
            st.integers(1, 20 * KiB),
        ),
        min_size=10,
        max_size=60,
    )
)
def test_get_returns_exactly_what_was_put_or_a_miss(ops):
    pool = DramPool(
        capacity_bytes=64 * KiB, high_watermark=0.9, low_watermark=0.6, pinned=False, alignment=512
    )
    model: dict[str, bytes] = {}  # the bytes a key holds if the pool still has it
    for version, (op, k, n) in enumerate(ops):
        key = f"k{k}"
        if op == "put":
            was_present = pool.exists([key])[0]
            data = _blob(n, version)
            assert pool.put([key], [data]) == [True]  # nothing is pinned, so a put always succeeds
            if not was_present:
                model[key] = data
        elif op == "get" and key in model:
            out = bytearray(len(model[key]))
            if pool.get_into([key], [out])[0]:
                assert bytes(out) == model[key]
        elif op == "remove":
            pool.remove([key])
            model.pop(key, None)
        stats = pool.stats()
        assert stats["used_bytes"] <= stats["capacity_bytes"] and stats["checksum_failures"] == 0


def test_copy_threads_split_large_batches_exactly():
    pool = DramPool(capacity_bytes=8 << 20, pinned=False, copy_threads=3)
    blobs = [_blob(300 * KiB + i, i) for i in range(8)]  # 2.4 MiB: above the parallel threshold
    keys = [f"big{i}" for i in range(8)]
    assert pool.put(keys, blobs) == [True] * 8
    outs = [bytearray(len(b)) for b in blobs]
    assert pool.get_into(keys, outs) == [True] * 8
    assert [bytes(o) for o in outs] == blobs
    pool.close()


def test_empty_objects_take_a_page_and_are_evicted_like_any_other():
    """An empty object charged no page would never be evicted: empty puts could grow the index without
    bound in a pool of any size. Each takes a page, so the pool holds at most capacity / alignment."""
    pool = DramPool(capacity_bytes=64 * 1024, pinned=False)
    try:
        most = 64 * 1024 // pool.index.alignment
        empty = np.empty(0, np.uint8)
        for i in range(0, 4 * most, 8):
            assert pool.put([f"e{j}" for j in range(i, i + 8)], [empty] * 8) == [True] * 8
        s = pool.stats()
        assert s["objects"] <= most and s["evictions"] >= 3 * most
        assert pool.get_into([f"e{4 * most - 1}"], [np.empty(0, np.uint8)]) == [True]
        assert pool.get_into(["e0"], [np.empty(0, np.uint8)]) == [False]  # the oldest went first
    finally:
        pool.close()


def test_the_reference_index_charges_empty_objects_a_page_too():
    from umbp.pool.dram.dict_index import DictIndex

    index = DictIndex(2 * 64, high_watermark=1.0, low_watermark=1.0, alignment=64)
    for key in ("a", "b", "c"):
        assert index.reserve(key, 0) is not None
        index.commit(key)
    assert index.lookup(["a", "b", "c"]) == [False, True, True]  # two pages: the third evicts the first
