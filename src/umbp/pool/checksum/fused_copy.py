"""The fused copy + checksum: copy bytes and take their psum64 while they are still in cache.

It works chunk by chunk (256 KiB, half of a core's L2) so the checksum reads data the copy has just
brought into cache instead of reading DRAM a second time. Both directions sum the arena side (`region`),
so put and get compute the same value for the same stored bytes. Large numpy copies and reductions
release the GIL; with the C extension a batch is one call that holds no GIL at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import Any

import numpy as np

from umbp.pool import native
from umbp.pool.checksum.digest import as_rows, checksum_u8, combine, finish, row_sums_into
from umbp.pool.checksum.gf64 import ROW_BYTES

CHUNK_BYTES = 256 * 1024  # a multiple of ROW_BYTES
# Split a batch across threads only when it is big and its objects are large: below these the thread
# hand-off and the GIL held by per-object Python work cost more than the extra bandwidth gives back.
PARALLEL_MIN_BYTES = 1 << 20
PARALLEL_MIN_MEAN_OBJECT = 128 * 1024


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
    return combine(rows, region, full)


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
    return [combine(rows[i], r, rows[i].size * ROW_BYTES) for i, (r, _) in enumerate(pairs)]


def run_split(executor: Executor | None, work: Callable[[Any], Any], shares: Sequence[Any]) -> list[Any]:
    """work(share) for every share, the first on the calling thread and the rest on `executor` (which may
    be None when there is one share); their results in order. Returns, or raises the first error, only
    once every share has finished, so no worker still writes into memory the caller is about to reuse."""
    futures: list[Future] = []
    try:  # a submit that fails (the executor was shut down) still waits for the shares already running
        for share in shares[1:]:
            futures.append(executor.submit(work, share))  # type: ignore[union-attr]
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
