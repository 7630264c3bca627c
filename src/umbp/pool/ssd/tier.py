"""SsdTier: the SSD tier. Objects go into append-only segment files (format: umbp.pool.ssd.format,
docs/ssd.md) written by one background thread per directory; a restarted process serves what is on disk.

Why this shape:

* `put` never waits for the disk: it copies the caller's bytes (and computes their psum64 on the fly)
  into a bounded staging buffer laid out exactly as the on-disk record, and returns. A full buffer is a
  skipped save (False, counted as `dropped_backpressure`), not a stall of the engine's step.
* A queued object is served from the staging buffer, so an object is visible from the moment `put`
  returns True until it is removed or evicted: a DRAM eviction that demotes here leaves no gap.
* Space is reclaimed oldest segment first (a log): the least recently used objects are evicted down to a
  low watermark, the live objects left in the oldest segment are copied to the head, and the segment is
  deleted. Deleting oldest-first means an older version of a key never outlives a newer one, so a
  restart never serves stale bytes; tombstones (written by `remove`) need no bookkeeping for the same
  reason.
* Several directories (drives) are striped by a stable hash of the key; each has its own lock, writer
  thread and segments, and all versions of a key live in one directory.
* Every read verifies the payload's psum64 against the checksum the index took from the record's header
  (written by this process, or checked by the restart scan: magic, version, key, length, crc32); psum64
  mixes in the length and is position-sensitive, so a match proves these are the object's bytes. A
  corrupt, truncated, vanished or unreadable record is a miss (counted), never an exception or wrong
  bytes. Reads of many keys are pipelined: I/O threads fetch the next run of adjacent records while the
  caller checks and copies the current one.

Code: this module holds construction and the Pool API; the rest of the class lives beside it by
concern (mixins on the same state): `index` (routing, the key index, LRU, ghosts), `directory` (lock,
scan, rebuild, closing files), `staging` (put's copies, staging pages given back), `reader` (get_into's
reads), `writer` (the writer thread), `space` (segments, reclaim), with the records they share in
`shard` and the replaceable disk calls in `io_hooks`.

Thread-safety: one lock guards all metadata; copies and disk I/O run outside it, protected by pins
(staged items, segments being read) so nothing is freed or closed under a reader.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from umbp.pool.base import Pool
from umbp.pool.buffers import aligned_buffer, prepare_buffers
from umbp.pool.dram.allocator import PageAllocator
from umbp.pool.errors import BufferSizeError, OptionValueError, UmbpError
from umbp.pool.keycheck import check_keys
from umbp.pool.ssd import io_hooks
from umbp.pool.ssd.directory import DirectoryMixin
from umbp.pool.ssd.format import (
    BLOCK,
    MAX_KEY_BYTES,
    seal_bytes,
)
from umbp.pool.ssd.index import IndexMixin
from umbp.pool.ssd.options import SsdOptions
from umbp.pool.ssd.reader import ReaderMixin
from umbp.pool.ssd.recovery import write_flush_mark
from umbp.pool.ssd.shard import (
    _BAD,
    _CLEAR,
    _ENTRY_BYTES,
    _IOERR,
    _OK,
    _TOMB,
    COPYING,
    WRITING,
    KiB,
    MiB,
    SsdDirectoryError,
    SsdError,
    SsdLockedError,
    _Item,
    _Loc,
    _Shard,
    _staging_pages,
)
from umbp.pool.ssd.space import SpaceMixin
from umbp.pool.ssd.staging import StagingMixin
from umbp.pool.ssd.writer import WriterMixin

__all__ = ["SsdDirectoryError", "SsdError", "SsdLockedError", "SsdTier"]

log = logging.getLogger("umbp.ssd")


class SsdTier(IndexMixin, DirectoryMixin, StagingMixin, ReaderMixin, WriterMixin, SpaceMixin, Pool):
    """The SSD tier: batched exists/put/get_into over segment files in one or more directories.

    capacity_bytes bounds the bytes of segment files (headers and padding included), split evenly across
    directories; queue_bytes bounds the staging buffer (the most bytes waiting to be written). See
    docs/ssd.md for every option and counter."""

    persistent = True

    def __init__(
        self,
        dirs: Sequence[str] | str,
        capacity_bytes: int,
        queue_bytes: int = 256 * MiB,
        direct_io: bool | str = "auto",
        *,
        segment_bytes: int | None = None,
        low_watermark: float = 0.8,
        max_io_bytes: int = 8 * MiB,
        io_threads: int = 2,
        copy_threads: int = 2,
        track_evicted: bool = False,
        health_interval_s: float = 1.0,
        prefault: bool = True,
    ) -> None:
        dirs = (
            [os.fspath(dirs)]
            if isinstance(dirs, str | os.PathLike)
            else [os.fspath(d) if isinstance(d, os.PathLike) else d for d in dirs]
        )
        o = SsdOptions(
            dirs=dirs,
            capacity_bytes=capacity_bytes,
            queue_bytes=queue_bytes,
            direct_io=direct_io,
            segment_bytes=segment_bytes,
            low_watermark=low_watermark,
            max_io_bytes=max_io_bytes,
            io_threads=io_threads,
            copy_threads=copy_threads,
            track_evicted=track_evicted,
            health_interval_s=health_interval_s,
            prefault=prefault,
        )
        dirs = list(o.dirs)
        self._direct_mode = o.direct_io
        shard_cap = o.capacity_bytes // len(dirs)
        self._queue_bytes = o.queue_bytes // BLOCK * BLOCK
        self._max_io = o.max_io_bytes // BLOCK * BLOCK
        self._run_bytes = min(self._max_io, 2 * MiB)
        segment_bytes = o.segment_bytes
        if segment_bytes is None:
            segment_bytes = min(256 * MiB, max(256 * KiB, shard_cap // 16))
        self._segment_bytes = segment_bytes // BLOCK * BLOCK
        if self._segment_bytes > shard_cap // 4:
            raise OptionValueError(
                f"umbp: SSD tier option 'segment_bytes' ({segment_bytes}) must be at most a quarter of the "
                f"capacity per directory ({shard_cap // 4}); space is reclaimed a segment at a time"
            )
        # Capacity kept free for cleaning: reclaiming the oldest segment copies its still-live objects
        # forward before deleting it, and those copies (plus the write that needs the room) must fit.
        self._reserve = 2 * self._segment_bytes
        self._low = o.low_watermark
        self._io_threads = o.io_threads
        self._copy_threads = o.copy_threads
        track_evicted, prefault = o.track_evicted, o.prefault
        self._copy_pool = (
            ThreadPoolExecutor(self._copy_threads - 1, thread_name_prefix="umbp-ssd-copy")
            if self._copy_threads > 1
            else None
        )
        self._health_interval = o.health_interval_s
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)  # staging pages were given back (wait_for_room)
        self._room_waiters = 0
        self._staging = aligned_buffer(self._queue_bytes, populate=prefault)
        self._staging_view_all = memoryview(self._staging)
        self._alloc = PageAllocator(self._queue_bytes // BLOCK)
        self._local = threading.local()
        self._executor: ThreadPoolExecutor | None = None
        self._track_evicted = track_evicted
        self._evicted: list[str] = []
        self._stopping = self._closed = False
        self._counters = dict.fromkeys(
            (
                "puts",
                "put_duplicates",
                "dropped_backpressure",
                "dropped_failed",
                "dropped_write_error",
                "dropped_no_space",
                "put_checksum_mismatch",
                "records_written",
                "bytes_written",
                "tombstones",
                "tombstones_dropped",
                "hits",
                "hits_staged",
                "misses",
                "checksum_failures",
                "read_errors",
                "bytes_read",
                "evictions",
                "evicted_bytes",
                "segments_reclaimed",
                "copied_forward",
                "copied_forward_bytes",
                "segments_lost",
                "write_errors",
                "enospc",
                "seal_errors",
                "foreign_records",
                "restart_damaged_records",
                "restart_withheld_records",
            ),
            0,
        )
        self._ndirs = len(dirs)
        self._shards: list[_Shard] = []
        try:
            for i, d in enumerate(dirs):
                self._shards.append(self._open_shard(i, d, shard_cap))
        except BaseException:
            self._release_shards()
            raise
        for shard in self._shards:
            # io_hooks.WRITE_DEPTH writes and a seal (its fdatasync can take a while) run at once
            shard.io = ThreadPoolExecutor(
                io_hooks.WRITE_DEPTH + 1, thread_name_prefix=f"umbp-ssd-io-{shard.number}"
            )
            shard.thread = threading.Thread(
                target=self._writer, args=(shard,), daemon=True, name=f"umbp-ssd-writer-{shard.number}"
            )
            shard.thread.start()

    # ---- construction from options -------------------------------------------------------------------------

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SsdTier:
        """Build from a config mapping (SsdOptions: unknown keys are named, every value is checked)."""
        o = SsdOptions.from_options(options)
        return cls(
            o.dirs,
            o.capacity_bytes,
            o.queue_bytes,
            o.direct_io,
            segment_bytes=o.segment_bytes,
            low_watermark=o.low_watermark,
            max_io_bytes=o.max_io_bytes,
            io_threads=o.io_threads,
            copy_threads=o.copy_threads,
            track_evicted=o.track_evicted,
            health_interval_s=o.health_interval_s,
            prefault=o.prefault,
        )

    @property
    def queue_bytes(self) -> int:
        """Bytes of staging: what puts can hand over before the writer has written any of it."""
        return self._queue_bytes

    @property
    def max_key_bytes(self) -> int:
        return MAX_KEY_BYTES

    @property
    def max_object_bytes(self) -> int:
        """The largest payload put() accepts (for any key up to MAX_KEY_BYTES)."""
        room = min(
            self._queue_bytes, self._shards[0].capacity - seal_bytes(_ENTRY_BYTES + MAX_KEY_BYTES) - BLOCK
        )
        return max(room, 0) // BLOCK * BLOCK

    @property
    def intake_bytes(self) -> int:
        return self._queue_bytes

    def write_behind(
        self, keys: Sequence[str], buffers: Sequence[Any], checksums: Sequence[int] | None = None
    ) -> list[bool]:
        """`put`: it stages the bytes (checking `checksums`) and returns; the writer thread writes them."""
        return self.put(keys, buffers, checksums=checksums)

    # ---- Pool API ------------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        check_keys("exists", keys)
        out = []
        with self._lock:
            for key in keys:
                shard = self._route(key)
                it = shard.staged.get(key)
                out.append(key in shard.index or (it is not None and it.state != COPYING))
        return out

    def put(
        self, keys: Sequence[str], buffers: Sequence[Any], checksums: Sequence[int] | None = None
    ) -> list[bool]:
        """Queue each object for writing; True once it is staged (visible at once), or already present.
        False: not stored now (staging full, directory failed, or `checksums[i]` given and not equal to
        the psum64 of the bytes, which lets a demotion verify the DRAM copy end to end)."""
        srcs = prepare_buffers("put", keys, buffers, writable=False)
        blobs = [self._key_bytes(k) for k in keys]
        for size in {src.size for src in srcs}:  # per size, with the longest key; then key by key if need be
            if not self._fits(size, MAX_KEY_BYTES):
                for key, kb, src in zip(keys, blobs, srcs, strict=True):
                    if src.size == size:
                        self._check_fits(key, kb, size)
        if checksums is not None and len(checksums) != len(keys):
            raise BufferSizeError(f"umbp: put got {len(keys)} keys but {len(checksums)} checksums")
        out = [False] * len(keys)
        staged = self._stage(keys, blobs, srcs, out)
        self._copy_in(staged, srcs, checksums, out)
        return out

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        check_keys("get_into", keys)
        dsts = prepare_buffers("get_into", keys, buffers, writable=True)
        plans: list[_Item | _Loc | None] = []
        with self._lock:
            if self._closed:
                raise UmbpError("umbp: this SsdTier is closed")
            for key in keys:
                shard = self._route(key)
                it = shard.staged.get(key)
                if it is not None and it.state != COPYING:
                    it.pins += 1
                    shard.lru.move_to_end(key)
                    plans.append(it)
                elif (loc := shard.index.get(key)) is not None:
                    loc.seg.pins += 1
                    shard.lru.move_to_end(key)
                    plans.append(loc)
                else:
                    plans.append(None)
        try:
            self._check_sizes(keys, plans, dsts)
            status = self._read(keys, plans, dsts)
        finally:
            with self._lock:
                self._unpin(plans)
        with self._lock:
            self._account_get(keys, plans, status)
        return [s == _OK for s in status]

    def _unpin(self, plans: list[_Item | _Loc | None]) -> None:
        for p in plans:
            if isinstance(p, _Item):
                p.pins -= 1
                self._release(p)
            elif p is not None:
                seg = p.seg
                seg.pins -= 1
                if seg.dead and seg.pins == 0 and seg.fd >= 0:
                    os.close(seg.fd)
                    seg.fd = -1

    def _account_get(self, keys: Sequence[str], plans: list, status: list[int]) -> None:
        c = self._counters
        for key, plan, st in zip(keys, plans, status, strict=True):
            if st == _OK:
                c["hits"] += 1
                c["bytes_read"] += plan.length
                c["hits_staged"] += isinstance(plan, _Item)
                continue
            c["misses"] += 1
            if st in (_BAD, _IOERR):
                c["checksum_failures" if st == _BAD else "read_errors"] += 1
                shard = self._route(key)
                if isinstance(plan, _Loc) and shard.index.get(key) == plan:
                    self._unindex(shard, key, gone=True)  # never serve it again

    def remove(self, keys: Sequence[str]) -> int:
        """Make keys absent now; a tombstone keeps them absent after a restart."""
        check_keys("remove", keys)
        removed = 0
        with self._lock:
            for key in keys:
                shard = self._route(key)
                present = self._unindex(shard, key, gone=False) is not None
                # an evicted (or unreadable) record is still on disk until its segment is reclaimed: without a
                # tombstone a restart would serve it again, undoing a flushed remove
                tomb = self._forget_ghost(shard, key) or present
                it = shard.staged.pop(key, None)
                if it is not None:
                    shard.lru.pop(key, None)
                    present = present or it.state != COPYING
                    tomb = tomb or it.state == WRITING  # its record may land on disk
                    it.cancelled = True
                if tomb:
                    self._enqueue(shard, _Item(_TOMB, key, key.encode()))
                removed += present
        return removed

    def clear(self) -> None:
        """Drop everything, on disk too (every segment file is deleted); waits until that is done."""
        events = []
        with self._lock:
            if self._stopping:
                return
            for shard in self._shards:
                for key in list(shard.index):
                    self._unindex(shard, key, gone=False)
                for it in shard.staged.values():
                    it.cancelled = True
                shard.staged.clear()
                shard.lru.clear()
                op = _Item(_CLEAR, done=threading.Event())
                self._enqueue(shard, op)
                events.append(op.done)
        for ev in events:
            ev.wait()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is written and synced; False if `timeout` (s) passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while any(s.queue or s.busy for s in self._shards):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
            marks = [
                (s.directory, s.active.fd if s.active is not None else -1, s.written_seq)
                for s in self._shards
            ]
        for directory, fd, seq in marks:
            try:
                if fd >= 0:
                    os.fdatasync(fd)
            except OSError:
                continue  # not synced: no mark (a restart then treats these records as never flushed)
            if seq:  # what a restart needs to tell damaged flushed records from a crash's torn writes
                write_flush_mark(directory, seq)
        return True

    def wait_for_room(self, sizes: Sequence[int], timeout: float | None = None) -> bool:
        """Block until a put of objects of these payload sizes would find staging for all of them (one
        run of free pages, padding counted), or `timeout` (s) passes: True if there is room.
        For writers that would rather wait than be refused (bulk loads, `umbp bench ssd`); a put refused
        for lack of staging costs a pass over its keys, so polling burns the CPU the writer needs. A
        batch bigger than the whole staging buffer waits for it to be empty."""
        need = min(sum(_staging_pages(int(n)) for n in sizes), self._alloc.npages)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._room_waiters += 1
            try:
                while self._alloc.largest_free() < need and not self._stopping:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._room.wait(left)
                return not self._stopping
            finally:
                self._room_waiters -= 1

    def drain_evicted(self) -> list[str]:
        """Keys that left the tier without a remove() since the last call (LRU eviction, a failed
        checksum or read, a lost segment, a failed write); empty unless track_evicted=True."""
        with self._lock:
            out, self._evicted = self._evicted, []
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            shards = self._shards
            out.update(
                capacity_bytes=sum(s.capacity for s in shards),
                limit_bytes=sum(s.limit for s in shards),
                used_bytes=sum(s.footprint for s in shards),
                stored_bytes=sum(s.stored_bytes for s in shards),
                live_record_bytes=sum(s.live_bytes for s in shards),
                objects=sum(len(s.index) for s in shards),
                segments=sum(len(s.segments) for s in shards),
                queued=sum(len(s.queue) for s in shards),
                staged=sum(len(s.staged) for s in shards),
                queue_bytes=self._queue_bytes,
                queued_bytes=(self._alloc.npages - self._alloc.free_pages) * BLOCK,
                segment_bytes=self._segment_bytes,
                dirs=[s.directory for s in shards],
                direct_io=[s.direct for s in shards],
                failed_dirs={s.directory: s.failed for s in shards if s.failed},
            )
        lookups = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / lookups if lookups else 0.0
        return out

    def close(self, timeout: float | None = None) -> bool:
        """Write everything queued, seal the open segments, release the directories. With a timeout, a
        wedged disk cannot hang shutdown: what is still queued then is dropped (counted), the files stay
        open (the writer may still be inside a syscall on them) and False is returned."""
        with self._lock:
            if self._closed:
                return True
            self._stopping = True
            self._room.notify_all()
            for s in self._shards:
                s.cv.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        for s in self._shards:
            if s.thread is not None:
                s.thread.join(None if deadline is None else max(deadline - time.monotonic(), 0))
        if any(s.thread is not None and s.thread.is_alive() for s in self._shards):
            for s in self._shards:
                with self._lock:
                    stuck, s.queue = list(s.queue), deque()
                self._drop(s, stuck, "dropped_write_error")
            log.error("umbp: SSD writers did not finish within %ss; queued writes dropped", timeout)
            for s in self._shards:
                if s.io is not None:
                    s.io.shutdown(wait=False)
            if self._copy_pool is not None:
                self._copy_pool.shutdown(wait=False)
            self._closed = True
            return False
        for s in self._shards:
            if s.active is not None and not s.failed:
                self._seal(s, s.active)
        if self._executor is not None:
            self._executor.shutdown()
        if self._copy_pool is not None:
            self._copy_pool.shutdown()
        for s in self._shards:
            if s.io is not None:
                s.io.shutdown()
        self._release_shards()
        self._closed = True
        return True
