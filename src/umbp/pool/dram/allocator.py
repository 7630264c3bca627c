"""Page allocator: contiguous runs of fixed-size pages inside one arena.

Why this shape: every object must be one contiguous (offset, nbytes) range so a copy is a single memcpy,
and KV pages come in a handful of fixed sizes. Free space is kept as maximal runs of pages, segregated by
run length (one free list per length = per size class). Allocation is best fit: an exact-length hole is
taken first, so a freed 64 KiB slot is reused by the next 64 KiB object without splitting a larger run;
objects of one size therefore pack with zero fragmentation. Frees coalesce with both neighbours. Only
integers are stored (no per-object buffers), and every operation is O(log distinct run lengths).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


class PageAllocator:
    """Allocates runs of pages in [0, npages). Not thread-safe: its owner (DramIndex) serialises calls."""

    def __init__(self, npages: int) -> None:
        self.npages = npages
        self.free_pages = 0
        self._by_len: dict[int, dict[int, None]] = {}  # run length -> starts (insertion-ordered set)
        self._lens: list[int] = []  # sorted distinct lengths present in _by_len
        self._len_at: dict[int, int] = {}  # run start -> length
        self._start_at_end: dict[int, int] = {}  # run end (exclusive) -> start
        if npages > 0:
            self._add_run(0, npages)

    def _add_run(self, start: int, length: int) -> None:
        starts = self._by_len.get(length)
        if starts is None:
            starts = self._by_len[length] = {}
            bisect.insort(self._lens, length)
        starts[start] = None
        self._len_at[start] = length
        self._start_at_end[start + length] = start
        self.free_pages += length

    def _drop_run(self, start: int, length: int) -> None:
        starts = self._by_len[length]
        del starts[start]
        if not starts:
            del self._by_len[length]
            del self._lens[bisect.bisect_left(self._lens, length)]
        del self._len_at[start]
        del self._start_at_end[start + length]
        self.free_pages -= length

    def alloc(self, n: int) -> int | None:
        """Start page of a fresh run of n pages (best fit), or None if no free run is long enough."""
        if n <= 0:
            return 0
        i = bisect.bisect_left(self._lens, n)
        if i == len(self._lens):
            return None
        length = self._lens[i]
        start = next(iter(self._by_len[length]))
        self._drop_run(start, length)
        if length > n:
            self._add_run(start + n, length - n)
        return start

    def free(self, start: int, n: int) -> None:
        """Return a run to the free space, merging it with free neighbours."""
        if n <= 0:
            return
        left = self._start_at_end.get(start)
        if left is not None:
            left_len = self._len_at[left]
            self._drop_run(left, left_len)
            start, n = left, n + left_len
        right_len = self._len_at.get(start + n)
        if right_len is not None:
            self._drop_run(start + n, right_len)
            n += right_len
        self._add_run(start, n)

    def free_many(self, runs: Sequence[tuple[int, int]]) -> None:
        """free() of every run, in order: DramIndex's hand-back of the runs the Python table frees (the C
        table's go back inside PageRuns.hand_back)."""
        for start, n in runs:
            self.free(start, n)

    def largest_free(self) -> int:
        return self._lens[-1] if self._lens else 0

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every free run, sorted; for tests and debugging."""
        return sorted(self._len_at.items())
