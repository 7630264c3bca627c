"""psum64 of whole objects and of rows: the numpy reference, or the C extension's loops when built.

Row values combine by XOR, so callers that cut an object into rows or pieces (the fused copy, the Redis
reader, the SSD format) compute row values their own way and finish here with `combine`,
`combine_rows` or `finish`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from umbp.pool import native
from umbp.pool.buffers import as_u8
from umbp.pool.checksum.gf64 import (
    _LE_U64,
    _M64,
    _U,
    GOLDEN,
    LANES,
    ROW_BYTES,
    ROW_WORDS,
    STEPS,
    _lane_lookup,
    _row_weights,
    _table,
    gf_mul,
    gf_mul_int,
    mulx64,
)

FORMAT = 2  # the digest's version: stored digests of format 1 (additive psum64) never verify here

_BYTE_BASE = np.arange(ROW_BYTES, dtype=np.intp) * 256
_LANE_BASE = np.arange(LANES * 8, dtype=np.intp) * 256
_ROWS_AT_ONCE = 64  # rows per lookup pass: bounds the index array (2 MiB)
# From this many rows on, the numpy path runs each lane's Horner chain on whole arrays of rows and looks
# up 8 bytes per lane instead of 8 per word: ~100 array steps per pass, which a few rows do not repay
# (2-vCPU VM: 1 row 16 us by bytes, 82 us by lanes; 4 rows 73 / 98 us; 16 rows 378 / 155 us; 64 rows
# 1.9 / 0.41 ms).
HORNER_MIN_ROWS = 5
_HORNER_ROWS = 256  # rows per Horner pass: its arrays stay in L2 (128 KiB each)


def row_values(rows_view: np.ndarray) -> np.ndarray:
    """Each row's value (umbp.pool.checksum) from an as_rows view: the C extension's loop, else numpy
    (_lane_values for enough rows, else _byte_values; both give the same values)."""
    if native.lib is not None:
        out = np.empty(rows_view.shape[0], _U)
        native.lib.psum_rows(np.ascontiguousarray(rows_view), out)
        return out
    if rows_view.shape[0] >= HORNER_MIN_ROWS:
        return _lane_values(rows_view)
    return _byte_values(rows_view)


def _byte_values(rows_view: np.ndarray) -> np.ndarray:
    """Row values as the xor of one table lookup per byte (8 MiB table)."""
    flat = _table().ravel()
    data = np.ascontiguousarray(rows_view).view(np.uint8).reshape(-1, ROW_BYTES)
    out = np.empty(data.shape[0], _U)
    for r0 in range(0, data.shape[0], _ROWS_AT_ONCE):
        part = data[r0 : r0 + _ROWS_AT_ONCE]
        out[r0 : r0 + part.shape[0]] = np.bitwise_xor.reduce(flat[_BYTE_BASE + part], axis=1)
    return out


def _lane_values(rows_view: np.ndarray) -> np.ndarray:
    """Row values the way the definition is computed cheaply: each lane's Horner chain over its steps
    (acc = acc * x**64 + w, for all rows' lanes at once), then each lane's result times its lane weight
    by 8 lookups in a 1 MiB table, xored."""
    flat = _lane_lookup().ravel()
    words = np.ascontiguousarray(rows_view).view(_LE_U64).reshape(-1, STEPS, LANES)
    out = np.empty(words.shape[0], _U)
    for r0 in range(0, words.shape[0], _HORNER_ROWS):
        part = words[r0 : r0 + _HORNER_ROWS]
        acc = part[:, 0, :].astype(_LE_U64)
        for m in range(1, STEPS):
            acc = mulx64(acc)
            acc ^= part[:, m, :]
        lanes = acc.astype(_LE_U64, copy=False).view(np.uint8).reshape(acc.shape[0], LANES * 8)
        out[r0 : r0 + acc.shape[0]] = np.bitwise_xor.reduce(flat[_LANE_BASE + lanes], axis=1)
    return out


def _length_term(nbytes: int) -> int:
    return (nbytes * GOLDEN) & _M64


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


def combine(rows: np.ndarray, region: np.ndarray, full: int) -> int:
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
    return combine(row_values(as_rows(body)), region, full)


def as_rows(region: np.ndarray) -> np.ndarray:
    """A region of whole rows as a (rows, ROW_WORDS) view of little-endian words: what row_values reads."""
    return region.view(_LE_U64).reshape(-1, ROW_WORDS)


def row_sums_into(rows_view: np.ndarray, out: np.ndarray) -> None:
    """The row values (umbp.pool.checksum) of an as_rows view, into out (one uint64 per row). The name is
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
    umbp.pool.checksum)."""
    return checksum_u8(as_u8(buffer, key="<checksum>", what="buffer", writable=False))


def finish(weighted: int, nbytes: int) -> int:
    """psum64 from the xor of an object's weighted rows (pieces from psum_copy with row0s)."""
    return (weighted & _M64) ^ _length_term(nbytes)
