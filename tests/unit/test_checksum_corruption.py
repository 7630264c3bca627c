"""psum64 format 2 against each class of corruption, on every CPU path, and the paths' bit-for-bit agreement.

Paths: the numpy reference (umbp.pool.checksum with the C extension switched off) and each row-value
implementation of the C extension this CPU has (portable shift-and-xor, PCLMULQDQ, VPCLMULQDQ). The
classes with a proof in docs/pool.md (detected with certainty): any change inside one word (every single
bit flip), any swap of two different words (inside a row or across rows), any swap of two rows that differ
in a few words. The ones detected with probability 1 - 2**-64 for data unrelated to the polynomial: a
zeroed 4 KiB block, a reordering of rows of unrelated data. Several cases are exactly where format 1 (the
additive psum64) was blind: they fail on it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umbp.pool import native
from umbp.pool.checksum import (
    CHUNK_BYTES,
    GOLDEN,
    ROW_BYTES,
    ROW_WORDS,
    as_rows,
    checksum,
    combine_rows,
    copy_many,
    copy_with_checksum,
    finish,
    gf_mul_int,
    row_sums_into,
)

_NATIVE_IMPLS = ("portable", "clmul", "vclmul")


def _available() -> list[str]:
    if native.lib is None:
        return ["python"]
    best = native.lib.psum_impl()
    return ["python", *_NATIVE_IMPLS[: _NATIVE_IMPLS.index(best) + 1]]


@pytest.fixture(params=["python", *_NATIVE_IMPLS])
def path(request, monkeypatch):
    """One checksum path: 'python' (numpy, the extension off) or one of the extension's implementations.
    The native ones are skipped where the extension or the CPU feature is missing (CI requires the
    extension; the portable implementation runs everywhere it is built)."""
    if request.param == "python":
        monkeypatch.setattr(native, "lib", None)
        yield "python"
        return
    if native.lib is None or request.param not in _available():
        pytest.skip(f"{request.param} is not available here ({native.why_not or native.lib.psum_impl()})")
    before = native.lib.psum_impl()
    native.lib.psum_impl(request.param)
    try:
        yield request.param
    finally:
        native.lib.psum_impl(before)


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _words(data: np.ndarray) -> np.ndarray:
    return data[: data.size // 8 * 8].view("<u8")


SIZES = st.sampled_from([8, 77, ROW_BYTES, ROW_BYTES + 13, 3 * ROW_BYTES, 5 * ROW_BYTES + 800])
# the path fixture holds for the whole test; each example only reads it
FEW = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@FEW
@given(n=SIZES, seed=st.integers(0, 2**32), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_single_bit_flip(path, n, seed, where, bit):
    data = _data(n, seed)
    base = checksum(data)
    data[int(where * n)] ^= 1 << bit
    assert checksum(data) != base


@FEW
@given(
    seed=st.integers(0, 2**32),
    row=st.integers(0, 2),
    i=st.integers(0, ROW_WORDS - 1),
    j=st.integers(0, ROW_WORDS - 1),
    delta_bits=st.integers(0, 63),
)
def test_swap_of_two_words_in_a_row(path, seed, row, i, j, delta_bits):
    """Two different words of one row swapped: format 1 never saw this (same row sum). The words differ
    in one chosen bit only in half the examples (the hardest case for an additive sum: a 2**63 delta)."""
    data = _data(3 * ROW_BYTES, seed)
    w = _words(data)
    a, b = row * ROW_WORDS + i, row * ROW_WORDS + (j if j != i else (i + 1) % ROW_WORDS)
    if seed % 2:
        w[b] = w[a] ^ np.uint64(1 << delta_bits)
    base = checksum(data)
    w[[a, b]] = w[[b, a]]
    assert checksum(data) != base


@FEW
@given(seed=st.integers(0, 2**32), a=st.integers(0, 5 * ROW_WORDS - 1), b=st.integers(0, 5 * ROW_WORDS - 1))
def test_swap_of_two_words_across_rows(path, seed, a, b):
    data = _data(5 * ROW_BYTES + 24, seed)
    w = _words(data)
    if a // ROW_WORDS == b // ROW_WORDS:
        b = (b + ROW_WORDS) % (5 * ROW_WORDS)
    if seed % 2:  # equal but for the top bit: a delta of 2**63, invisible to any sum mod 2**64 times even
        w[b] = w[a] ^ np.uint64(1 << 63)
    base = checksum(data)
    w[[a, b]] = w[[b, a]]
    assert checksum(data) != base


@FEW
@given(seed=st.integers(0, 2**32), nrows=st.integers(2, 6), perm_seed=st.integers(0, 2**16))
def test_rows_reordered(path, seed, nrows, perm_seed):
    data = _data(nrows * ROW_BYTES, seed)
    rows = data.reshape(nrows, ROW_BYTES)
    order = np.random.default_rng(perm_seed).permutation(nrows)
    if (order == np.arange(nrows)).all():
        order = np.roll(order, 1)
    assert checksum(rows[order].ravel()) != checksum(data)


def test_swapped_rows_that_are_permutations_of_each_other(path):
    """Row B is row A with two words swapped, then A and B trade places: each row keeps its sum, so
    format 1 saw nothing; here the difference of the two rows is a word swap, which is always seen."""
    a = _data(ROW_BYTES, 5)
    b = a.copy()
    wb = b.view("<u8")
    wb[[3, 300]] = wb[[300, 3]]
    assert checksum(np.concatenate([a, b])) != checksum(np.concatenate([b, a]))


@FEW
@given(seed=st.integers(0, 2**32), nrows=st.integers(1, 5), block=st.integers(0, 4))
def test_zeroed_block(path, seed, nrows, block):
    data = _data(nrows * ROW_BYTES + 100, seed)
    base = checksum(data)
    start = min(block, nrows - 1) * ROW_BYTES
    data[start : start + ROW_BYTES] = 0
    assert checksum(data) != base


def test_zeroed_block_whose_words_sum_to_zero(path):
    """A row whose words sum to 0 mod 2**64 (w and -w): format 1 did not see it zeroed."""
    data = _data(2 * ROW_BYTES, 9)
    w = _words(data)
    w[ROW_WORDS + 256 : 2 * ROW_WORDS] = np.uint64(0) - w[ROW_WORDS : ROW_WORDS + 256]
    base = checksum(data)
    data[ROW_BYTES:] = 0
    assert checksum(data) != base


def test_any_two_bit_flips_in_a_row(path):
    """Every pair of flipped bits is seen (P is primitive: x**a + x**b is never a multiple of it); format
    1 missed the same bit flipped 0->1 in one word and 1->0 in another of the same row."""
    data = np.zeros(ROW_BYTES, np.uint8)
    w = data.view("<u8")
    w[7] = np.uint64(1 << 40)
    base = checksum(data)
    w[7] ^= np.uint64(1 << 40)
    w[100] ^= np.uint64(1 << 40)
    assert checksum(data) != base
    rng = np.random.default_rng(3)
    data = _data(ROW_BYTES, 4)
    base = checksum(data)
    for _ in range(200):
        p, q = rng.choice(ROW_BYTES * 8, 2, replace=False)
        bad = data.copy()
        bad[p // 8] ^= 1 << int(p % 8)
        bad[q // 8] ^= 1 << int(q % 8)
        assert checksum(bad) != base, (p, q)


# ---- agreement between paths ---------------------------------------------------------------------------------


def _xpow(e: int) -> int:
    r, b = 1, 2
    while e:
        if e & 1:
            r = gf_mul_int(r, b)
        b = gf_mul_int(b, b)
        e >>= 1
    return r


def _definition(data: bytes) -> int:
    """psum64 format 2 straight from its definition (umbp.pool.checksum's docstring), word by word in Python ints."""
    pad = data + bytes(-len(data) % ROW_BYTES)
    h = 0
    for k in range(len(pad) // 8):
        w = int.from_bytes(pad[8 * k : 8 * k + 8], "little")
        if w:
            r, i = divmod(k, ROW_WORDS)
            m, lane = divmod(i, 64)
            h ^= gf_mul_int(w, _xpow(64 * (512 * r + 8 * lane + 7 - m)))
    return h ^ ((len(data) * GOLDEN) & ((1 << 64) - 1))


@pytest.mark.parametrize("n", [0, 1, 8, 77, ROW_BYTES, ROW_BYTES + 13, 2 * ROW_BYTES + 4000])
def test_matches_the_definition(path, n):
    data = _data(n, n)
    assert checksum(data) == _definition(data.tobytes())


@pytest.mark.parametrize("nrows", [1, 4, 5, 8, 257, 300])
def test_numpy_row_value_paths_agree(nrows):
    """The numpy path's two ways to a row's value (a lookup per byte; a Horner chain per lane, then a
    lookup per lane byte), on either side of where row_values switches and across its passes."""
    from umbp.pool.checksum import digest

    rows = as_rows(_data(nrows * ROW_BYTES, nrows))
    assert np.array_equal(digest._byte_values(rows), digest._lane_values(rows))


def test_values_are_pinned():
    """Stored values carry this digest (SSD records, remote values): no path may change it silently."""
    assert checksum(_data(64 * 1024, seed=11)) == 0xE5409CEE035271CC
    assert checksum(_data(ROW_BYTES + 8, seed=12)) == 0x4C80655EEED0B975


@settings(max_examples=25, deadline=None, derandomize=True)
@given(n=st.integers(0, 3 * CHUNK_BYTES + 5 * ROW_BYTES + 9), seed=st.integers(0, 2**32))
def test_every_path_gives_the_same_digest(n, seed):
    """One-shot, fused copy (both ways), threaded batch copy and batched combine, on every path."""
    data = _data(n, seed)
    got = {}
    lib = native.lib
    try:
        for p in _available():
            native.lib = None if p == "python" else lib
            if p != "python":
                lib.psum_impl(p)
            region = np.zeros(n, np.uint8)
            out = np.empty(n, np.uint8)
            with ThreadPoolExecutor(2) as pool:
                got[p] = (
                    checksum(data),
                    copy_with_checksum(region, data, True),
                    copy_with_checksum(region, out, False),
                    copy_many([(region, data), (region[: n // 2], data[: n // 2])], True, pool, threads=3)[0],
                )
            assert np.array_equal(out, data)
    finally:
        native.lib = lib
        if lib is not None:
            lib.psum_impl(_available()[-1])
    assert len({v for vals in got.values() for v in vals}) == 1, got


def test_row_values_combine_like_the_whole(path):
    """The remote tier's batched path (row values per row, then combine_rows) and the SSD tier's (values
    of zero-padded rows) give the same digests as checksum()."""
    from umbp.pool.ssd.format import block_rows, psums_of_records

    objs = [_data(3 * ROW_BYTES, s) for s in range(4)]
    rows = np.zeros((4, 3), np.uint64)
    for i, o in enumerate(objs):
        row_sums_into(as_rows(o), rows[i])
    assert combine_rows(rows, 3 * ROW_BYTES).tolist() == [checksum(o) for o in objs]
    length = 2 * ROW_BYTES + 10
    run = np.zeros(4 * 3 * ROW_BYTES, np.uint8)
    for i, o in enumerate(objs):
        run[i * 3 * ROW_BYTES : i * 3 * ROW_BYTES + length] = o[:length]
    assert psums_of_records(block_rows(run), 4, length) == [checksum(o[:length]) for o in objs]


@pytest.mark.skipif(native.lib is None, reason="the C extension is not built")
def test_native_pieces_xor_to_the_whole():
    """psum_copy with row0s: pieces of one object cut at rows xor up to its digest (what threads do)."""
    data = _data(7 * ROW_BYTES + 99, 8)
    for p in _available()[1:]:
        native.lib.psum_impl(p)
        parts = native.lib.psum_copy([data[: 2 * ROW_BYTES], data[2 * ROW_BYTES :]], None, [0, 2])
        assert finish(parts[0] ^ parts[1], data.size) == checksum(data)
    native.lib.psum_impl(_available()[-1])
    with pytest.raises(ValueError, match="not available"):
        native.lib.psum_impl("no-such-implementation")
