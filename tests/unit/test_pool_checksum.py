"""psum64: detection guarantees, agreement between the one-shot and the fused copy paths, buffer types.
(Each class of corruption, the definition and the pinned values: test_checksum_corruption.py.)"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.pool import Arena
from umbp.pool.checksum import CHUNK_BYTES, ROW_BYTES, checksum, copy_many, copy_with_checksum

pytestmark = pytest.mark.usefixtures("impl")  # each test on the C extension's paths and on the Python ones

RNG = np.random.default_rng(1234)


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_every_single_bit_flip_is_detected():
    data = _data(ROW_BYTES + 13)  # a full row, whole tail words and a partial last word
    base = checksum(data)
    bits = RNG.integers(0, 8, data.size)
    # every byte position with one random bit; every bit of the first 8 words, the tail words and the
    # partial last word
    flips = [(pos, int(bits[pos])) for pos in range(data.size)]
    edges = [*range(64), *range(ROW_BYTES - 8, data.size)]
    flips += [(pos, bit) for pos in edges for bit in range(8)]
    for pos, bit in flips:
        data[pos] ^= 1 << bit
        assert checksum(data) != base, (pos, bit)
        data[pos] ^= 1 << bit
    assert checksum(data) == base


def test_every_changed_byte_is_detected():
    data = _data(3 * ROW_BYTES + 5, seed=1)
    base = checksum(data)
    deltas = RNG.integers(1, 256, data.size)
    for pos, delta in enumerate(deltas):
        old = data[pos]
        data[pos] = (int(old) + int(delta)) % 256
        assert checksum(data) != base, pos
        data[pos] = old


def test_position_and_length_matter():
    data = _data(4 * ROW_BYTES, seed=2)
    swapped = data.copy()
    swapped[:ROW_BYTES], swapped[ROW_BYTES : 2 * ROW_BYTES] = (
        data[ROW_BYTES : 2 * ROW_BYTES],
        data[:ROW_BYTES],
    )
    assert checksum(swapped) != checksum(data)  # two pages swapped
    assert checksum(b"a") != checksum(b"a\0")  # zero padding is not ambiguous
    assert checksum(b"") != checksum(b"\0")
    assert checksum(bytes(ROW_BYTES)) != checksum(bytes(2 * ROW_BYTES))


def test_random_corruption_is_detected():
    data = _data(64 * 1024, seed=3)
    base = checksum(data)
    for i in range(200):
        bad = data.copy()
        start = int(RNG.integers(0, data.size - 64))
        bad[start : start + 64] = _data(64, seed=100 + i)
        if not np.array_equal(bad, data):
            assert checksum(bad) != base


def test_buffer_types_agree():
    data = _data(10_000, seed=4)
    ref = checksum(data)
    assert checksum(data.tobytes()) == ref
    assert checksum(bytearray(data.tobytes())) == ref
    assert checksum(memoryview(data.tobytes())) == ref
    assert checksum(data.view(np.uint16).reshape(100, 50)) == ref
    torch = pytest.importorskip("torch")
    assert checksum(torch.from_numpy(data.copy())) == ref


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(0, 2 * CHUNK_BYTES + 3 * ROW_BYTES + 17), seed=st.integers(0, 2**16))
def test_fused_copy_paths_equal_one_shot(n, seed):
    data = _data(n, seed)
    arena = np.zeros(n + 64, np.uint8)
    region = arena[8 : 8 + n]
    assert copy_with_checksum(region, data, to_region=True) == checksum(data)
    assert np.array_equal(region, data)
    out = np.empty(n, np.uint8)
    assert copy_with_checksum(region, out, to_region=False) == checksum(data)
    assert np.array_equal(out, data)


def test_large_object_grows_weight_table():
    data = _data(17 << 20, seed=5)  # more rows than the initial weight table holds
    arena = Arena(18 << 20, pinned=False)
    assert arena.write(4096, data) == checksum(data) == arena.checksum(4096, data.size)
    assert arena.verify(4096, data.size, checksum(data))


def test_threaded_batch_copy_matches_one_shot():
    sizes = [0, 5, ROW_BYTES, 3 * CHUNK_BYTES + 4099, CHUNK_BYTES, 1 << 20, 77]
    srcs = [_data(n, seed=n) for n in sizes]
    arena = np.zeros(sum(sizes) + 8 * len(sizes), np.uint8)
    regions, off = [], 0
    for n in sizes:
        regions.append(arena[off : off + n])
        off += -(-n // 8) * 8
    with ThreadPoolExecutor(3) as pool:
        assert copy_many(list(zip(regions, srcs, strict=True)), True, pool, threads=4) == [
            checksum(s) for s in srcs
        ]
        outs = [np.empty(n, np.uint8) for n in sizes]
        assert copy_many(list(zip(regions, outs, strict=True)), False, pool, 4) == [checksum(s) for s in srcs]
    assert all(np.array_equal(o, s) for o, s in zip(outs, srcs, strict=True))


@pytest.mark.parametrize("nrows", [1, 2, 16, 64, 300])
def test_batched_combine_equals_one_shot(nrows):
    """combine_rows (the remote tier's batched get) gives checksum()'s value for every object, and a
    changed word changes only its own object's value."""
    from umbp.pool.checksum import as_rows, combine_rows, row_sums_into

    rng = np.random.default_rng(nrows)
    objs = rng.integers(0, 256, (5, nrows * ROW_BYTES), dtype=np.uint8)
    objs[1] = 0  # all-zero and all-ones rows too
    objs[2] = 255
    rows = np.zeros((5, nrows), np.uint64)
    for i in range(5):
        row_sums_into(as_rows(objs[i]), rows[i])
    assert combine_rows(rows, nrows * ROW_BYTES).tolist() == [checksum(o) for o in objs]
    objs[3, -8] ^= 1
    row_sums_into(as_rows(objs[3]), rows[3])
    digests = combine_rows(rows, nrows * ROW_BYTES).tolist()
    assert digests == [checksum(o) for o in objs] and digests[3] != digests[4]


def test_batched_combine_needs_whole_rows():
    from umbp.pool.checksum import combine_rows

    with pytest.raises(ValueError):
        combine_rows(np.zeros((2, 1), np.uint64), ROW_BYTES + 8)


@pytest.mark.parametrize("impl", ["native"], indirect=True)  # the C entry point itself
def test_native_psum_copy_pieces_and_bad_input(impl):
    """Pieces of an object (row0s) xor up to its psum64, and a length mismatch or a read-only destination
    is a clear error with nothing written."""
    from umbp.pool import native
    from umbp.pool.checksum import finish

    data = _data(5 * ROW_BYTES + 99, seed=8)
    cut = 2 * ROW_BYTES
    parts = native.lib.psum_copy([data[:cut], data[cut:]], None, [0, 2])
    assert finish(parts[0] ^ parts[1], data.size) == checksum(data) == native.lib.psum_copy([data])[0]
    dst = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="source has 11 bytes, destination 10"):
        native.lib.psum_copy([dst], [np.ones(11, np.uint8)])
    assert not dst.any()
    with pytest.raises((BufferError, TypeError, ValueError)):
        native.lib.psum_copy([b"read-only!"], [b"0123456789"])
