"""GF(2**64) arithmetic and the weight tables psum64 is built from (the definition: umbp.pool.checksum).

Python-int products are the reference; the numpy ones are what the pure-Python digest and the table
builders use. The tables are built once and only grow, by swapping one reference, so concurrent readers
never see a half-built table.
"""

from __future__ import annotations

import numpy as np

ROW_BYTES = 4096
ROW_WORDS = ROW_BYTES // 8
LANES = 64  # Horner chains per row (a row is LANES x STEPS words, lane = word index % LANES)
STEPS = ROW_WORDS // LANES
_M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # the length term is n * GOLDEN mod 2**64
POLY_LOW = 0x1B  # P = x**64 + x**4 + x**3 + x + 1
_LE_U64 = np.dtype("<u8")  # fixed byte order: the same bytes give the same checksum on every host
_U = np.uint64


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
    """At least n entries of K (see umbp.pool.checksum): K[64*r + l] weighs lane l of row r."""
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


def _byte_lookup(gamma: np.ndarray) -> np.ndarray:
    """T[8*i + j, v] = (v * x**(8*j)) * gamma[i] mod P: the product of word i's byte j by gamma[i] is one
    lookup (products by a constant are linear over GF(2), so a byte's table is built from its 8 bits)."""
    basis = np.zeros((gamma.size, 64), _U)
    a = np.asarray(gamma, _U).copy()
    for b in range(64):  # basis[i, b] = gamma[i] * x**b
        basis[:, b] = a
        a = (a << _U(1)) ^ ((a >> _U(63)) * _U(POLY_LOW))
    per_byte = basis.reshape(gamma.size * 8, 8)  # [8*i + j, t] = gamma[i] * x**(8*j + t)
    table = np.zeros((gamma.size * 8, 256), _U)
    for t in range(8):
        table[:, 1 << t : 2 << t] = table[:, : 1 << t] ^ per_byte[:, t : t + 1]
    return table


def _make_byte_table() -> np.ndarray:
    """T[8*i + j, v] = (v * x**(8*j)) * x**(64*e(i)) mod P for word i of a row and byte value v: a row's
    value is the xor of 4096 lookups, one per byte (8 MiB, built on first use by the numpy path)."""
    gamma = np.zeros(ROW_WORDS, _U)
    for lane in range(LANES):
        g = int(lane_table(LANES)[lane])
        for m in range(STEPS - 1, -1, -1):  # word 64*m + lane has exponent 8*lane + 7 - m
            gamma[LANES * m + lane] = g
            g = int(mulx64(_U(g)))
    return _byte_lookup(gamma)


def _table() -> np.ndarray:
    global _byte_table
    if _byte_table is None:
        _byte_table = _make_byte_table()
    return _byte_table


_lane_byte_table: np.ndarray | None = None


def _make_lane_byte_table() -> np.ndarray:
    """L[8*l + j, v] = (v * x**(8*j)) * K[l] mod P for lane l and byte value v: a lane's Horner result
    times its lane weight is the xor of 8 lookups, one per byte (1 MiB, built on first use)."""
    return _byte_lookup(lane_table(LANES)[:LANES])


def _lane_lookup() -> np.ndarray:
    global _lane_byte_table
    if _lane_byte_table is None:
        _lane_byte_table = _make_lane_byte_table()
    return _lane_byte_table
