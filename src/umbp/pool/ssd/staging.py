"""How `SsdTier.put` stages objects: input checks, staging pages taken under the lock, copies and
checksums outside it, then the items queued for the directory's writer; and how a finished item's
staging pages are given back (only once no reader holds them, since reads of queued objects are served
from staging)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from umbp.pool import native
from umbp.pool.checksum import copy_with_checksum, run_split
from umbp.pool.errors import ObjectTooLargeError, UmbpError, human_bytes
from umbp.pool.keycheck import key_utf8
from umbp.pool.ssd.format import (
    BLOCK,
    MAX_KEY_BYTES,
    block_rows,
    padded,
    psums_of_records,
    record_bytes,
    seal_bytes,
)
from umbp.pool.ssd.shard import (
    _ENTRY_BYTES,
    _PUT,
    _SUM_RUN_BYTES,
    DONE,
    QUEUED,
    _Item,
    _Shard,
    _staging_pages,
)

log = logging.getLogger("umbp.ssd")


class StagingMixin:
    """Part of SsdTier (umbp.pool.ssd.tier), split out by concern: it works on the tier's own state
    (`self`) under the tier's one lock, so the methods read exactly as they would in one class."""

    def _staging_view(self, it: _Item) -> np.ndarray:
        return self._staging[it.start * BLOCK : (it.start + it.npages) * BLOCK]

    def _release(self, it: _Item, runs: list[tuple[int, int]] | None = None) -> None:
        """Give a finished put's staging pages back once no reader holds them; with `runs`, collect them
        there for one _free_runs of a whole group (records staged together sit side by side)."""
        if it.state == DONE and it.pins == 0 and it.start >= 0:
            if runs is None:
                self._alloc.free(it.start, it.npages)
                self._room_freed()
            else:
                runs.append((it.start, it.npages))
            it.start = -1

    def _free_runs(self, runs: list[tuple[int, int]]) -> None:
        """Free collected staging runs, adjacent ones merged first: one allocator call per merged run."""
        runs.sort()
        i = 0
        while i < len(runs):
            start, n = runs[i]
            i += 1
            while i < len(runs) and runs[i][0] == start + n:
                n += runs[i][1]
                i += 1
            self._alloc.free(start, n)
        self._room_freed()

    def _room_freed(self) -> None:
        if self._room_waiters:
            self._room.notify_all()

    def _finish(self, shard: _Shard, it: _Item, runs: list[tuple[int, int]] | None = None) -> None:
        if shard.staged.get(it.key) is it:
            del shard.staged[it.key]
        if it.key not in shard.index and it.key not in shard.staged:  # never made it to disk
            shard.lru.pop(it.key, None)
        it.state = DONE
        self._release(it, runs)

    def _enqueue(self, shard: _Shard, it: _Item) -> None:
        it.state = QUEUED
        shard.queue.append(it)
        shard.cv.notify()

    @staticmethod
    def _key_bytes(key: Any) -> bytes:
        return key_utf8("put", key, MAX_KEY_BYTES)

    def _fits(self, nbytes: int, key_len: int) -> bool:
        """Whether an object fits both the staging queue and a directory's capacity (its seal included)."""
        rec = record_bytes(nbytes)
        return (
            _staging_pages(nbytes) * BLOCK <= self._queue_bytes
            and rec + seal_bytes(_ENTRY_BYTES + key_len) <= self._shards[0].capacity
        )

    def _check_fits(self, key: str, kb: bytes, nbytes: int) -> None:
        """_fits, or the error that names the limit the object exceeds."""
        if self._fits(nbytes, len(kb)):
            return
        if _staging_pages(nbytes) * BLOCK > self._queue_bytes:
            raise ObjectTooLargeError(
                f"umbp: object '{key}' is {human_bytes(nbytes)} but the SSD staging queue holds "
                f"{human_bytes(self._queue_bytes)}; raise queue_bytes"
            )
        cap = self._shards[0].capacity
        raise ObjectTooLargeError(
            f"umbp: object '{key}' is {human_bytes(nbytes)} but the SSD tier holds {human_bytes(cap)} per "
            "directory; raise capacity_bytes"
        )

    def _stage(
        self, keys: Sequence[str], blobs: list[bytes], srcs: list[np.ndarray], out: list[bool]
    ) -> list[tuple[int, _Item]]:
        """Under one lock: answer duplicates, refuse what cannot be taken now, take staging for the rest.
        Objects of one size get one run of staging, record after record, when the arena has it: then
        _copy_in sums them together and the writer frees them together."""
        staged = []
        c = self._counters
        with self._lock:
            if self._stopping:
                raise UmbpError("umbp: this SsdTier is closed")
            wanted = []
            pages: dict[int, int] = {}  # payload size -> staging pages of its padded payload
            for i, (key, src) in enumerate(zip(keys, srcs, strict=True)):
                shard = self._route(key)
                if key in shard.index or key in shard.staged:
                    c["put_duplicates"] += 1
                    out[i] = True
                elif shard.failed:
                    c["dropped_failed"] += 1
                else:
                    n = pages.get(src.size)
                    if n is None:
                        n = pages[src.size] = _staging_pages(src.size)
                    wanted.append((i, shard, n))
            if len(wanted) > 1 and len(pages) == 1:
                npages = wanted[0][2]
                run = self._alloc.alloc(npages * len(wanted))
                starts = None if run is None else range(run, run + npages * len(wanted), npages)
            else:
                starts = None
            refused = set()  # page counts no free run has left (nothing is freed while the lock is held)
            for k, (i, shard, npages) in enumerate(wanted):
                start = (
                    (None if npages in refused else self._alloc.alloc(npages))
                    if starts is None
                    else starts[k]
                )
                if start is None:
                    refused.add(npages)
                    c["dropped_backpressure"] += 1
                    continue
                key = keys[i]
                if key in shard.staged:  # the same key twice in one call: the first one is stored
                    c["put_duplicates"] += 1
                    out[i] = True
                    self._alloc.free(start, npages)
                    continue
                it = _Item(_PUT, key, blobs[i], srcs[i].size, start, npages, nbytes=padded(srcs[i].size))
                shard.staged[key] = it
                shard.lru[key] = None  # recency counts from the put, not from when the write lands
                staged.append((i, it))
        return staged

    def _copy_in(
        self,
        staged: list[tuple[int, _Item]],
        srcs: list[np.ndarray],
        checksums: Sequence[int] | None,
        out: list[bool],
    ) -> None:
        """Copy each staged object into its staging pages, take its psum64 and queue it, run by run (~1 MiB),
        so the writer starts on the first run while later ones are still copied (a 16 MiB put used to
        keep the disk idle until its last copy). Runs are dealt round-robin to copy_threads (the caller
        and its helpers) when the batch holds more than one: a put's time is mostly memcpy and summing,
        which release the GIL, and one core's copy + checksum is what bounded small-object writes
        (docs/ssd.md). Returns once every run is queued or given back; if a copy raised, the runs not yet
        queued are given back (their objects not stored) and the error is raised."""
        runs = self._sum_runs(staged)
        if not runs:
            return
        queued = [False] * len(runs)

        def work(share: range) -> None:
            for r in share:
                i, j = runs[r]
                self._copy_run(staged, srcs, i, j)
                self._enqueue_staged(staged[i:j], checksums, out)
                queued[r] = True

        total = sum(it.nbytes for _i, it in staged)
        n = (
            1
            if self._copy_pool is None or len(runs) < 2 or total < 2 * _SUM_RUN_BYTES
            else self._copy_threads
        )
        shares = [range(t, len(runs), n) for t in range(min(n, len(runs)))]
        try:
            run_split(self._copy_pool, work, shares)
        finally:
            left = [it for r, (i, j) in enumerate(runs) if not queued[r] for _k, it in staged[i:j]]
            if left:
                with self._lock:
                    for it in left:
                        self._finish(self._route(it.key), it)

    def _sum_runs(self, staged: list[tuple[int, _Item]]) -> list[tuple[int, int]]:
        """[i, j) ranges of staged items summed together: records of one size that sit side by side in
        staging, up to ~1 MiB (see _copy_run); any other item is a range of its own."""
        runs = []
        i = 0
        while i < len(staged):
            it = staged[i][1]
            j = i + 1
            limit = i + max(1, _SUM_RUN_BYTES // it.nbytes) if it.nbytes else j  # an empty payload goes alone
            while (
                j < len(staged)
                and j < limit
                and staged[j][1].length == it.length
                and staged[j][1].start == staged[j - 1][1].start + it.npages
            ):
                j += 1
            runs.append((i, j))
            i = j
        return runs

    def _copy_run(self, staged: list[tuple[int, _Item]], srcs: list[np.ndarray], i: int, j: int) -> None:
        """Copy items [i, j) in. Several side-by-side records are summed in one reduction over their
        blocks and one matrix product (psums_of_records, the read path's), instead of a numpy call chain
        per object: the interpreter time per 64 KiB object matters here."""
        it = staged[i][1]
        n = it.length
        if native.lib is not None:  # copy + psum64 of the whole run in one call that holds no GIL
            regions = [self._staging_view(item) for _k, item in staged[i:j]]
            digests = native.lib.psum_copy([r[:n] for r in regions], [srcs[k] for k, _it in staged[i:j]])
            for (_k, item), region, digest in zip(staged[i:j], regions, digests, strict=True):
                item.checksum = digest
                if n % BLOCK:
                    region[n:] = 0
            return
        for k, item in staged[i:j]:
            region = self._staging_view(item)
            if j - i == 1:
                item.checksum = copy_with_checksum(region[:n], srcs[k], to_region=True)
            else:
                np.copyto(region[:n], srcs[k])
            if n % BLOCK:
                region[n:] = 0
        if j - i > 1:
            run = self._staging[it.start * BLOCK : (it.start + (j - i) * it.npages) * BLOCK]
            for (_k, item), digest in zip(
                staged[i:j], psums_of_records(block_rows(run), j - i, n), strict=True
            ):
                item.checksum = digest

    def _enqueue_staged(
        self, staged: list[tuple[int, _Item]], checksums: Sequence[int] | None, out: list[bool]
    ) -> None:
        """Under one lock: queue copied items, one wake-up per directory. An item removed while it
        was copied, or whose bytes do not match the caller's checksum, is dropped (False)."""
        woken = set()
        with self._lock:
            for i, it in staged:
                shard = self._route(it.key)
                if it.cancelled or (checksums is not None and it.checksum != checksums[i]):
                    self._counters["put_checksum_mismatch"] += not it.cancelled
                    self._finish(shard, it)
                    continue
                it.state = QUEUED
                shard.queue.append(it)
                woken.add(shard.number)
                self._counters["puts"] += 1
                out[i] = True
            for n in woken:
                self._shards[n].cv.notify()
