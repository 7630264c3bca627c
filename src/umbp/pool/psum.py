"""The per-object checksum ("psum64", format 2) and the fused copy + checksum used by the arena.

Definition. An object of n bytes is zero-padded to whole 4 KiB rows of 512 little-endian uint64 words;
word i = 64*m + l of row r (lane l < 64, step m < 8) is read as a polynomial over GF(2) of degree < 64
and given the exponent e = 512*r + 8*l + (7 - m). The digest is

    D = ( XOR over all words of  w * x**(64*e)  mod P ) xor (n * GOLDEN mod 2**64)

with carry-less products and P = x**64 + x**4 + x**3 + x + 1 (primitive: x has order 2**64 - 1). Every
bit of the object gets its own power of x, 64*e + bit, so this is a CRC-64 of the object's bits in a
fixed order (lanes transposed inside each row).

Why this function (docs/pool.md has the full argument): the former psum64 added words mod 2**64 and so
could not see two words swapped inside a row. No digest that adds per-word terms mod 2**64 can: a swap
changes it by f_i(b) - f_i(a) + f_j(a) - f_j(b), and for that never to vanish every f_i - f_j must be a
bijection of Z/2**64, which a cyclic group of even order does not allow for three positions (Hall-Paige).
XOR-accumulated products in the field GF(2**64) = GF(2)[x]/P have no such limit, and with the powers of
x above they detect with certainty: any change inside one word (every single-bit flip), any two flipped
bits anywhere, any swap of two different words anywhere in the object, and a swap of two rows whose
row values (below) differ. A zeroed block, a reordering of more rows, or other damage escapes only when
the error polynomial is a multiple of P (about 2**-64 for damage unrelated to P).

How it is computed cheaply everywhere (the GPU kernel and the C extension's portable path): inside a row,
each lane is a Horner chain over its 8 steps,
acc = acc * x**64 + w, and multiplying by x**64 is a few shifts and xors because P is sparse (mulx64).
Each lane's result is then multiplied once by K[64*r + l] = x**(512*(64*r + l)) (a full field product,
once per 8 words); the row's *value* rho_r is the XOR of its lanes times K[l], and D is the XOR of
rho_r * K[64*r] (the row weight) over rows, plus the length term. Rows, and pieces of an object cut at
row boundaries, combine by XOR, so threads, pieces and GPU programs add their parts with xor. With a
carry-less multiply instruction (x86-64 PCLMULQDQ) the C extension instead multiplies every word by its
power of x directly; this module looks each byte's term up in a table (8 MiB, built on first use).

The fused copy works chunk by chunk (256 KiB, half of a core's L2) so the checksum reads data the copy
has just brought into cache instead of reading DRAM a second time. Both directions sum the arena side,
so put and get compute the same value for the same stored bytes. Large numpy copies and reductions
release the GIL. The C extension (umbp.pool._native) and the GPU copy kernel (umbp.transfer.triton_kernels)
compute the same value; this module is the reference and the fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
from typing import Any

import numpy as np

from umbp.pool import native
from umbp.pool.buffers import as_u8

ROW_BYTES = 4096
ROW_WORDS = ROW_BYTES // 8
LANES = 64  # Horner chains per row (a row is LANES x STEPS words, lane = word index % LANES)
STEPS = ROW_WORDS // LANES
CHUNK_BYTES = 256 * 1024  # a multiple of ROW_BYTES
FORMAT = 2  # the digest's version: stored digests of format 1 (additive psum64) never verify here
# Split a batch across threads only when it is big and its objects are large: below these the thread
# hand-off and the GIL held by per-object Python work cost more than the extra bandwidth gives back.
PARALLEL_MIN_BYTES = 1 << 20
PARALLEL_MIN_MEAN_OBJECT = 128 * 1024
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
POLY_LOW = 0x1B  # P = x**64 + x**4 + x**3 + x + 1
_LE_U64 = np.dtype("<u8")  # fixed byte order: the same bytes give the same checksum on every host
_U = np.uint64


# ---- GF(2**64) arithmetic: Python ints (the reference) and numpy arrays ------------------------------------


def gf_mul_int(a: int, b: int) -> int:
    """a * b in GF(2)[x]/P for Python ints: a carry-less product 4 bits of b at a time, then two folds of
    the bits at x**64 and above (x**64 = x**4 + x**3 + x + 1 mod P)."""
    t = [0] * 16  # t[v] = a * v: v's lowest set bit's shift of a, xor the rest of v's entry
    for v in range(1, 16):
        t[v] = t[v & (v - 1)] ^ (a << ((v & -v).bit_length() - 1))
    r = 0
    for j in range(0, 64, 4):
        r ^= t[(b >> j) & 15] << j
    for _ in range(2):
        hi = r >> 64
        r = (r & _M64) ^ hi ^ (hi << 1) ^ (hi << 3) ^ (hi << 4)
    return r


def mulx64(a: np.ndarray) -> np.ndarray:
    """a * x**64 mod P, elementwise: a*(x**4 + x**3 + x + 1) and its <= 3 overflow bits folded once more."""
    o = (a >> _U(60)) ^ (a >> _U(61)) ^ (a >> _U(63))
    r = a ^ (a << _U(1)) ^ (a << _U(3)) ^ (a << _U(4))
    return r ^ o ^ (o << _U(1)) ^ (o << _U(3)) ^ (o << _U(4))


def gf_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a * b mod P elementwise (broadcasting), 4 bits of b at a time: a table of a * v for v < 16 as
    128-bit (hi, lo) pairs, then 16 shifted lookups, then one fold of the high half."""
    a, b = np.broadcast_arrays(np.asarray(a, _U), np.asarray(b, _U))
    tl = np.zeros((*a.shape, 16), _U)
    th = np.zeros((*a.shape, 16), _U)
    for t in range(4):  # table by doubling: entries [2**t, 2**(t+1)) = entries [0, 2**t) xor a * x**t
        lo = a << _U(t)
        hi = a >> _U(64 - t) if t else np.zeros_like(a)
        tl[..., 1 << t : 2 << t] = tl[..., : 1 << t] ^ lo[..., None]
        th[..., 1 << t : 2 << t] = th[..., : 1 << t] ^ hi[..., None]
    lo = np.zeros(a.shape, _U)
    hi = np.zeros(a.shape, _U)
    for j in range(16):
        v = ((b >> _U(4 * j)) & _U(15)).astype(np.intp)[..., None]
        pl = np.take_along_axis(tl, v, axis=-1)[..., 0]
        ph = np.take_along_axis(th, v, axis=-1)[..., 0]
        lo ^= pl << _U(4 * j)
        hi ^= ph << _U(4 * j)
        if j:
            hi ^= pl >> _U(64 - 4 * j)
    return lo ^ mulx64(hi)


def _make_lane_table(n: int) -> np.ndarray:
    """K[j] = x**(64*STEPS*j) mod P for j < n (by doubling: K[s:2s] = K[:s] * x**(64*STEPS*s))."""
    k = np.ones(1, _U)
    step = 2  # x
    for _ in range((64 * STEPS).bit_length() - 1):  # x**(64*STEPS), a power of two
        step = gf_mul_int(step, step)
    while k.size < n:
        k = np.concatenate([k, gf_mul(k, _U(step))])
        step = gf_mul_int(step, step)
    return k


_lane_table = _make_lane_table(LANES * 1024)  # covers objects up to 4 MiB; grows on demand


def lane_table(n: int) -> np.ndarray:
    """At least n entries of K (see the module docstring): K[64*r + l] weighs lane l of row r."""
    global _lane_table
    table = _lane_table
    if table.size < n:
        table = _make_lane_table(max(n, 2 * table.size))
        _lane_table = table  # a single reference swap: safe for concurrent readers
    return table


def _row_weights(nrows: int) -> np.ndarray:
    """K[64*r] for r < nrows: what each row's value is multiplied by."""
    return lane_table(LANES * nrows + 1)[: LANES * nrows : LANES]


_byte_table: np.ndarray | None = None


def _make_byte_table() -> np.ndarray:
    """T[8*i + j, v] = (v * x**(8*j)) * x**(64*e(i)) mod P for word i of a row and byte value v: a row's
    value is the xor of 4096 lookups, one per byte (8 MiB, built on first use by the numpy path)."""
    gamma = np.zeros(ROW_WORDS, _U)
    for lane in range(LANES):
        g = int(lane_table(LANES)[lane])
        for m in range(STEPS - 1, -1, -1):  # word 64*m + lane has exponent 8*lane + 7 - m
            gamma[LANES * m + lane] = g
            g = int(mulx64(_U(g)))
    basis = np.zeros((ROW_WORDS, 64), _U)
    a = gamma.copy()
    for b in range(64):  # basis[i, b] = gamma[i] * x**b
        basis[:, b] = a
        a = (a << _U(1)) ^ ((a >> _U(63)) * _U(POLY_LOW))
    per_byte = basis.reshape(ROW_WORDS * 8, 8)  # [8*i + j, t] = gamma[i] * x**(8*j + t)
    table = np.zeros((ROW_WORDS * 8, 256), _U)
    for t in range(8):
        table[:, 1 << t : 2 << t] = table[:, : 1 << t] ^ per_byte[:, t : t + 1]
    return table


def _table() -> np.ndarray:
    global _byte_table
    if _byte_table is None:
        _byte_table = _make_byte_table()
    return _byte_table


_BYTE_BASE = np.arange(ROW_BYTES, dtype=np.intp) * 256
_ROWS_AT_ONCE = 64  # rows per lookup pass: bounds the index array (2 MiB)


def row_values(rows_view: np.ndarray) -> np.ndarray:
    """Each row's value (module docstring) from an as_rows view: the xor of one table lookup per byte
    (or the C extension's loop)."""
    if native.lib is not None:
        out = np.empty(rows_view.shape[0], _U)
        native.lib.psum_rows(np.ascontiguousarray(rows_view), out)
        return out
    flat = _table().ravel()
    data = np.ascontiguousarray(rows_view).view(np.uint8).reshape(-1, ROW_BYTES)
    out = np.empty(data.shape[0], _U)
    for r0 in range(0, data.shape[0], _ROWS_AT_ONCE):
        part = data[r0 : r0 + _ROWS_AT_ONCE]
        out[r0 : r0 + part.shape[0]] = np.bitwise_xor.reduce(flat[_BYTE_BASE + part], axis=1)
    return out


def _length_term(nbytes: int) -> int:
    return (nbytes * _GOLDEN) & _M64


def _tail_value(region: np.ndarray, start: int) -> int:
    """The value of the bytes after the last full row, zero-padded to a row: one lookup per byte present
    (the padding's bytes look up zeros)."""
    tail = region[start:]
    if native.lib is not None:
        row = np.zeros(ROW_BYTES, np.uint8)
        row[: tail.size] = tail
        return int(row_values(as_rows(row))[0])
    flat = _table().ravel()
    return int(np.bitwise_xor.reduce(flat[_BYTE_BASE[: tail.size] + tail]))


def _combine(rows: np.ndarray, region: np.ndarray, full: int) -> int:
    """Row values times their row weights + the zero-padded tail as one more row + the length. Mixing
    the length in keeps zero padding unambiguous; xor with a length constant cannot hide a difference."""
    nrows = rows.size
    weights = _row_weights(nrows + 1)
    if nrows > 64:
        h = int(np.bitwise_xor.reduce(gf_mul(rows, weights[:nrows])))
    else:  # up to 64 rows: Python ints (~10 us a product) cost less than gf_mul's ~100 array steps
        h = 0
        for r in range(nrows):
            h ^= gf_mul_int(int(rows[r]), int(weights[r]))
    nbytes = region.size
    if full < nbytes:
        h ^= gf_mul_int(_tail_value(region, full), int(weights[nrows]))
    return h ^ _length_term(nbytes)


def checksum_u8(region: np.ndarray) -> int:
    """psum64 of a flat uint8 array (one pass, no copy)."""
    if native.lib is not None:
        return native.lib.psum_copy((region,))[0]
    full = region.size // ROW_BYTES * ROW_BYTES
    body = region if full == region.size else region[:full]  # whole rows, the usual object: no slice
    return _combine(row_values(as_rows(body)), region, full)


def as_rows(region: np.ndarray) -> np.ndarray:
    """A region of whole rows as a (rows, ROW_WORDS) view of little-endian words: what row_values reads."""
    return region.view(_LE_U64).reshape(-1, ROW_WORDS)


def row_sums_into(rows_view: np.ndarray, out: np.ndarray) -> None:
    """The row values (module docstring) of an as_rows view, into out (one uint64 per row). The name is
    format 1's (row sums); callers keep it because they only pass row values on to combine_rows."""
    out[...] = row_values(rows_view)


def combine_rows(rows: np.ndarray, nbytes: int) -> np.ndarray:
    """psum64 of several objects of `nbytes` each, all whole rows, from their row values (one object per
    row of `rows`): _combine for a batch in a few array operations instead of a Python step per object."""
    if rows.shape[1] * ROW_BYTES != nbytes:
        raise ValueError(f"umbp: combine_rows needs whole {ROW_BYTES}-byte rows, got {nbytes} bytes")
    return combine_padded_rows(rows, nbytes)


def combine_padded_rows(rows: np.ndarray, nbytes: int) -> np.ndarray:
    """psum64 of several objects of `nbytes` each from the values of their rows, the last one zero-padded
    (a zero-padded tail's row value is exactly what psum64 takes for the tail, with the next weight)."""
    nrows = rows.shape[1]
    weighted = gf_mul(np.asarray(rows, _U), _row_weights(nrows)[None, :])
    return np.bitwise_xor.reduce(weighted, axis=1) ^ _U(_length_term(nbytes))


def checksum(buffer: Any) -> int:
    """psum64 of any contiguous buffer (bytes, bytearray, memoryview, numpy array, CPU torch tensor):
    a 64-bit int that changes on any change inside one word and on any swap of two different words (see
    the module docstring)."""
    return checksum_u8(as_u8(buffer, key="<checksum>", what="buffer", writable=False))


def _copy_chunk(
    region: np.ndarray, other: np.ndarray, rows: np.ndarray, c0: int, c1: int, to_region: bool
) -> None:
    """Copy bytes [c0, c1) and put the values of the full rows among them into rows[]; c0 is a multiple
    of ROW_BYTES."""
    if to_region:
        np.copyto(region[c0:c1], other[c0:c1])
    else:
        np.copyto(other[c0:c1], region[c0:c1])
    r0, r1 = c0 // ROW_BYTES, min(c1, rows.size * ROW_BYTES) // ROW_BYTES
    if r1 > r0:
        row_sums_into(as_rows(region[r0 * ROW_BYTES : r1 * ROW_BYTES]), rows[r0:r1])


def copy_with_checksum(region: np.ndarray, other: np.ndarray, to_region: bool) -> int:
    """Copy `other` into `region` (to_region) or `region` into `other`, chunk by chunk, and return the
    psum64 of `region` computed while each chunk is still in cache. Both arrays are flat uint8 views of
    the same length; `region` must start 8-byte aligned (arena slots do)."""
    if native.lib is not None:
        dst, src = (region, other) if to_region else (other, region)
        return native.lib.psum_copy((dst,), (src,))[0]
    nbytes = region.size
    if nbytes <= CHUNK_BYTES:  # one chunk: the fewest numpy calls (their fixed cost matters here)
        if to_region:
            np.copyto(region, other)
        else:
            np.copyto(other, region)
        return checksum_u8(region)
    full = nbytes // ROW_BYTES * ROW_BYTES
    rows = np.empty(full // ROW_BYTES, np.uint64)
    for c0 in range(0, nbytes, CHUNK_BYTES):
        _copy_chunk(region, other, rows, c0, min(c0 + CHUNK_BYTES, nbytes), to_region)
    return _combine(rows, region, full)


def copy_many(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]],
    to_region: bool,
    executor: Executor | None = None,
    threads: int = 1,
) -> list[int]:
    """copy_with_checksum over a batch, optionally split across `threads` (the caller plus threads - 1
    workers of `executor`). Why: one core's copy + checksum cannot keep up with a plain memcpy (the
    checksum re-reads every byte), while DRAM bandwidth grows with cores; the batch is cut into 256 KiB
    chunks and each thread takes a contiguous run of them. Returns when every copy has finished, also
    when one raises (so no worker writes into a slot the caller is about to give back)."""
    total = sum(r.size for r, _ in pairs)
    if (
        threads <= 1
        or executor is None
        or total < max(PARALLEL_MIN_BYTES, len(pairs) * PARALLEL_MIN_MEAN_OBJECT)
    ):
        if native.lib is not None:  # the whole batch in one call, one GIL release
            regions, others = [r for r, _o in pairs], [o for _r, o in pairs]
            return (
                native.lib.psum_copy(regions, others) if to_region else native.lib.psum_copy(others, regions)
            )
        return [copy_with_checksum(r, o, to_region) for r, o in pairs]
    if native.lib is not None:
        return _copy_many_native(pairs, to_region, executor, threads)
    rows = [np.empty(r.size // ROW_BYTES, np.uint64) for r, _ in pairs]
    units = [
        (i, c0, min(c0 + CHUNK_BYTES, r.size))
        for i, (r, _) in enumerate(pairs)
        for c0 in range(0, r.size, CHUNK_BYTES)
    ]
    per = -(-len(units) // threads)
    shares = [units[j : j + per] for j in range(0, len(units), per)]

    def work(share: list[tuple[int, int, int]]) -> None:
        for i, c0, c1 in share:
            _copy_chunk(pairs[i][0], pairs[i][1], rows[i], c0, c1, to_region)

    run_split(executor, work, shares)
    return [_combine(rows[i], r, rows[i].size * ROW_BYTES) for i, (r, _) in enumerate(pairs)]


def run_split(executor: Executor | None, work: Callable[[Any], Any], shares: Sequence[Any]) -> list[Any]:
    """work(share) for every share, the first on the calling thread and the rest on `executor` (which may
    be None when there is one share); their results in order. Returns, or raises the first error, only
    once every share has finished, so no worker still writes into memory the caller is about to reuse."""
    futures = [executor.submit(work, share) for share in shares[1:]] if len(shares) > 1 else []
    try:
        first = work(shares[0])
    finally:
        wait(futures)
    return [first, *(f.result() for f in futures)]


def _copy_many_native(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], to_region: bool, executor: Executor, threads: int
) -> list[int]:
    """copy_many across threads with the C extension: the batch's bytes are cut into `threads` equal
    spans (at row boundaries, across objects), each copied and summed by one call that holds no GIL, so
    a thread never waits for the interpreter mid-span. psum64 is an xor of weighted rows, so the pieces
    of an object cut apart xor up to its checksum (finish)."""
    total = sum(r.size for r, _ in pairs)
    span = -(-total // threads // ROW_BYTES) * ROW_BYTES
    shares: list[list[tuple[int, int, int]]] = [[]]
    room = span
    for i, (r, _) in enumerate(pairs):
        c0 = 0
        while c0 < r.size:
            c1 = min(r.size, c0 + room)
            if c1 < r.size:  # a cut inside an object falls on a row boundary (c0 always does)
                c1 = c0 + (c1 - c0) // ROW_BYTES * ROW_BYTES
            if c1 == c0:
                shares.append([])
                room = span
                continue
            shares[-1].append((i, c0, c1))
            room -= c1 - c0
            c0 = c1

    def work(share: list[tuple[int, int, int]]) -> list[int]:
        regions = [pairs[i][0][c0:c1] for i, c0, c1 in share]
        others = [pairs[i][1][c0:c1] for i, c0, c1 in share]
        row0s = [c0 // ROW_BYTES for _i, c0, _c1 in share]
        lib = native.lib
        return lib.psum_copy(regions, others, row0s) if to_region else lib.psum_copy(others, regions, row0s)

    parts = run_split(executor, work, shares)
    sums = [0] * len(pairs)
    for share, got in zip(shares, parts, strict=True):
        for (i, _c0, _c1), h in zip(share, got, strict=True):
            sums[i] ^= h
    return [finish(h, r.size) for h, (r, _) in zip(sums, pairs, strict=True)]


def finish(weighted: int, nbytes: int) -> int:
    """psum64 from the xor of an object's weighted rows (pieces from psum_copy with row0s)."""
    return (weighted & _M64) ^ _length_term(nbytes)
