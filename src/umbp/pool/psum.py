"""The per-object checksum ("psum64") and the fused copy + checksum used by the arena.

Why this function: a put or get already streams every byte through the CPU once (the copy, bound by DRAM
bandwidth); the checksum must read every byte again, and on this class of machine nothing in numpy reads
cache-hot data faster than a plain uint64 add-reduce (~25-35 GB/s; zlib.crc32 ~3.4, sha1 ~1.6, blake2b
~0.6 GB/s, measured in `docs/pool.md`). So the checksum is one add-reduce pass:

* the object is cut into 4 KiB rows of 512 little-endian uint64 words; each row is summed mod 2**64;
* the row sums are combined as sum(row_sum[r] * W[r]) mod 2**64 with fixed odd pseudo-random weights W
  (so rows are position-sensitive: a misplaced or swapped page changes the result);
* the bytes after the last full row are summed the same way (zero-padded) with the next weight, and the
  length is mixed in (xor with length * a constant).

Guarantees: any change confined to one aligned 8-byte word (every single-bit flip, every single changed
byte) changes the sum deterministically (an odd weight times a nonzero delta is nonzero mod 2**64). Other
random corruption escapes with probability about 2**-64. Known blind spot, accepted for speed: changes
inside one 4 KiB row whose word deltas cancel exactly (two words swapped within a row, or the same bit
flipped 0->1 in one word and 1->0 in another of the same row).

The fused copy works chunk by chunk (256 KiB, half of a core's L2) so the checksum reads data the copy
has just brought into cache instead of reading DRAM a second time. Both directions sum the arena side,
so put and get compute the same value for the same stored bytes. Large numpy copies and reductions
release the GIL.
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
CHUNK_BYTES = 256 * 1024  # a multiple of ROW_BYTES
# Split a batch across threads only when it is big and its objects are large: below these the thread
# hand-off and the GIL held by per-object Python work cost more than the extra bandwidth gives back.
PARALLEL_MIN_BYTES = 1 << 20
PARALLEL_MIN_MEAN_OBJECT = 128 * 1024
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_SEED = 0x75_6D_62_70  # "umbp"
_LE_U64 = np.dtype("<u8")  # fixed byte order: the same bytes give the same checksum on every host


def _make_weights(n: int) -> np.ndarray:
    """splitmix64(i) | 1 for i in [0, n): odd, so a nonzero row delta can never vanish."""
    z = np.arange(n, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(_SEED)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return z | np.uint64(1)


_weights_table = _make_weights(1 << 12)  # covers objects up to 16 MiB; grows on demand


def _weights(n: int) -> np.ndarray:
    global _weights_table
    table = _weights_table
    if table.size < n:
        table = _make_weights(max(n, 2 * table.size))
        _weights_table = table  # a single reference swap: safe for concurrent readers
    return table


def _tail_sum(region: np.ndarray, start: int) -> int:
    """Sum mod 2**64 of the bytes after the last full row, as little-endian words, the last zero-padded."""
    tail = region[start:]
    nwords = tail.size // 8
    total = int(np.add.reduce(tail[: nwords * 8].view(_LE_U64))) if nwords else 0
    rest = tail[nwords * 8 :]
    if rest.size:
        total += int.from_bytes(rest.tobytes(), "little")
    return total & _M64


def _combine(rows: np.ndarray, region: np.ndarray, full: int) -> int:
    """Weighted row sums + weighted tail + length. Mixing the length in keeps zero padding unambiguous;
    xor with a length constant is a bijection, so it cannot hide a difference."""
    nrows = rows.size
    table = _weights(nrows + 1)
    h = int(rows.dot(table[:nrows])) if nrows else 0
    nbytes = region.size
    if full < nbytes:
        h += _tail_sum(region, full) * int(table[nrows])
    return (h ^ (nbytes * _GOLDEN)) & _M64


def checksum_u8(region: np.ndarray) -> int:
    """psum64 of a flat uint8 array (one pass, no copy)."""
    if native.lib is not None:
        return native.lib.psum_copy((region,))[0]
    full = region.size // ROW_BYTES * ROW_BYTES
    body = region if full == region.size else region[:full]  # whole rows, the usual object: no slice
    rows = np.add.reduce(as_rows(body), axis=1)
    return _combine(rows, region, full)


def as_rows(region: np.ndarray) -> np.ndarray:
    """A region of whole rows as a (rows, ROW_WORDS) view of little-endian words: what row sums reduce."""
    return region.view(_LE_U64).reshape(-1, ROW_WORDS)


def row_sums_into(rows_view: np.ndarray, out: np.ndarray) -> None:
    """The row sums of an as_rows view, into out (one uint64 per row)."""
    np.add.reduce(rows_view, axis=1, out=out)


def combine_rows(rows: np.ndarray, nbytes: int) -> np.ndarray:
    """psum64 of several objects of `nbytes` each, all whole rows, from their row sums (one object per
    row of `rows`): _combine for a batch as one matrix product instead of a Python step per object."""
    if rows.shape[1] * ROW_BYTES != nbytes:
        raise ValueError(f"umbp: combine_rows needs whole {ROW_BYTES}-byte rows, got {nbytes} bytes")
    return combine_padded_rows(rows, nbytes)


def combine_padded_rows(rows: np.ndarray, nbytes: int) -> np.ndarray:
    """psum64 of several objects of `nbytes` each from the row sums of their rows, the last one zero-padded
    (a zero-padded tail's row sum is exactly what psum64 adds for the tail, with the next weight)."""
    nrows = rows.shape[1]
    return (rows @ _weights(nrows + 1)[:nrows]) ^ np.uint64((nbytes * _GOLDEN) & _M64)


def checksum(buffer: Any) -> int:
    """psum64 of any contiguous buffer (bytes, bytearray, memoryview, numpy array, CPU torch tensor):
    a 64-bit int that changes on any single-bit flip or changed byte (see the module docstring)."""
    return checksum_u8(as_u8(buffer, key="<checksum>", what="buffer", writable=False))


def _copy_chunk(region: np.ndarray, other: np.ndarray, rows: np.ndarray, c0: int, c1: int, to_region: bool) -> None:
    """Copy bytes [c0, c1) and sum the full rows among them into rows[]; c0 is a multiple of ROW_BYTES."""
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
    if threads <= 1 or executor is None or total < max(PARALLEL_MIN_BYTES, len(pairs) * PARALLEL_MIN_MEAN_OBJECT):
        if native.lib is not None:  # the whole batch in one call, one GIL release
            regions, others = [r for r, _o in pairs], [o for _r, o in pairs]
            return native.lib.psum_copy(regions, others) if to_region else native.lib.psum_copy(others, regions)
        return [copy_with_checksum(r, o, to_region) for r, o in pairs]
    if native.lib is not None:
        return _copy_many_native(pairs, to_region, executor, threads)
    rows = [np.empty(r.size // ROW_BYTES, np.uint64) for r, _ in pairs]
    units = [(i, c0, min(c0 + CHUNK_BYTES, r.size)) for i, (r, _) in enumerate(pairs) for c0 in range(0, r.size, CHUNK_BYTES)]
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
    a thread never waits for the interpreter mid-span. psum64 is a sum of weighted rows, so the pieces
    of an object cut apart add up to its checksum (finish)."""
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
            sums[i] += h
    return [finish(h, r.size) for h, (r, _) in zip(sums, pairs, strict=True)]


def finish(weighted: int, nbytes: int) -> int:
    """psum64 from the sum of an object's weighted rows (pieces from psum_copy with row0s)."""
    return ((weighted & _M64) ^ (nbytes * _GOLDEN)) & _M64
