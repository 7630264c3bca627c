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

Thread-safety: one lock guards all metadata; copies and disk I/O run outside it, protected by pins
(staged items, segments being read) so nothing is freed or closed under a reader.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from umbp.pool import native
from umbp.pool.base import Pool
from umbp.pool.buffers import aligned_buffer, prepare_buffers
from umbp.pool.dram.allocator import PageAllocator
from umbp.pool.errors import BufferSizeError, ObjectTooLargeError, OptionValueError, UmbpError, human_bytes
from umbp.pool.keycheck import check_keys, key_utf8
from umbp.pool.psum import checksum_u8, copy_with_checksum, run_split
from umbp.pool.ssd.format import (
    BLOCK,
    DATA,
    LOCK_NAME,
    MAX_KEY_BYTES,
    MAX_SEGMENT_NUMBER,
    SUMMARY,
    TOMBSTONE,
    RecordInfo,
    block_rows,
    entry_bytes,
    entry_span,
    head_bytes,
    pack_group,
    pack_summary,
    pack_trailer,
    padded,
    psum_of_rows,
    psums_of_records,
    record_bytes,
    seal_bytes,
    segment_name,
)
from umbp.pool.ssd.options import SsdOptions
from umbp.pool.ssd.recovery import scan, write_flush_mark

log = logging.getLogger("umbp.ssd")
KiB, MiB = 1 << 10, 1 << 20
COPYING, QUEUED, WRITING, DONE = range(4)  # a staged put's life
_PUT, _TOMB, _CLEAR = range(3)
_OK, _MISS, _BAD, _IOERR = range(4)
_MAX_BATCH_ITEMS = 512  # below IOV_MAX (1024) for one pwritev
_SUM_RUN_BYTES = 1 << 20  # put: checksums of side-by-side small records taken this much at a time
_ENTRY_BYTES = entry_bytes(b"")  # a summary entry's bytes before its key
_WRITE_DEPTH = 3  # groups a directory's writer keeps in flight, so a writer late by one write's time leaves no gap
_FATAL_ERRNOS = (errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)

# The syscalls the tier's I/O goes through; module attributes so fault tests can replace them.
_pwritev = os.pwritev
_preadv = os.preadv


def _staging_pages(length: int) -> int:
    """Staging pages a put of `length` bytes takes: its padded payload (one page for an empty one)."""
    return max(padded(length) // BLOCK, 1)


class SsdError(UmbpError):
    """A directory the SSD tier cannot use."""


class SsdDirectoryError(SsdError):
    """The directory is missing and cannot be created, is not a directory, or is read-only."""


class SsdLockedError(SsdError):
    """Another process (or another SsdTier in this one) owns the directory."""


class _Loc(NamedTuple):
    seg: _Segment
    offset: int  # of the payload
    length: int
    checksum: int  # psum64 of the payload, from the record's header


@dataclass(eq=False, slots=True)
class _Segment:
    number: int
    path: str
    fd: int
    size: int = 0  # bytes of valid records (the append offset)
    sealed: bool = False
    entries: list[tuple[str, RecordInfo]] = field(default_factory=list)  # for the summary
    entry_bytes: int = 0
    live: dict[str, None] = field(default_factory=dict)  # keys whose current record is here
    ghosts: dict[str, None] = field(default_factory=dict)  # keys whose unindexed newest record is here
    reserved: int = 0  # bytes counted against capacity: size, plus the seal to come if unsealed
    pins: int = 0
    dead: bool = False  # deleted; the fd is closed at the last unpin


@dataclass(eq=False, slots=True)
class _Item:
    """A queued operation: a put (its record image sits in staging), a tombstone, or a clear."""

    kind: int
    key: str = ""
    key_bytes: bytes = b""
    length: int = 0
    start: int = -1  # first staging page (puts)
    npages: int = 0
    checksum: int = 0
    state: int = COPYING
    cancelled: bool = False
    pins: int = 0
    done: threading.Event | None = None
    nbytes: int = 0  # bytes of its payload on disk (padded; 0 for a tombstone), a field: read ~30 times a record


@dataclass(eq=False, slots=True)
class _Write:
    """A group of records on its way into a segment: planned at `offset`, written by an I/O thread while
    the writer thread prepares the next group, so the disk is not idle while Python runs."""

    seg: _Segment
    group: list[_Item]
    seqs: list[int]
    offset: int
    nbytes: int  # the group's bytes: head and payloads
    ebytes: int
    future: Future
    buffer: np.ndarray | None = None  # memory the write reads besides staging (the group's head, a seal's
    # image), kept alive until it is written
    head: int = 0  # bytes of the group's head
    seal: bool = False  # the segment's summary and trailer (no records): lands as _sealed


@dataclass(eq=False)
class _Shard:
    """One directory: its lock, segments (oldest first), index, LRU, queue and writer thread."""

    number: int
    directory: str
    lock_fd: int
    capacity: int
    cv: threading.Condition
    direct: bool
    scratch: np.ndarray
    limit: int = 0  # capacity, lowered while the filesystem has less free space
    segments: list[_Segment] = field(default_factory=list)
    active: _Segment | None = None
    next_seq: int = 1
    next_segment: int = 1
    written_seq: int = 0  # the highest seq of a record whose write reached the file (what flush() marks)
    index: dict[str, _Loc] = field(default_factory=dict)
    ghosts: dict[str, _Segment] = field(default_factory=dict)  # left the index without remove(), still on disk
    lru: OrderedDict[str, None] = field(default_factory=OrderedDict)
    staged: dict[str, _Item] = field(default_factory=dict)
    queue: deque[_Item] = field(default_factory=deque)
    live_bytes: int = 0  # on-disk bytes of the indexed records
    stored_bytes: int = 0  # their payload bytes
    footprint: int = 0  # sum of segments' reserved bytes
    busy: bool = False
    failed: str = ""
    thread: threading.Thread | None = None
    io: ThreadPoolExecutor | None = None  # runs the writes the writer thread plans (_WRITE_DEPTH at once) and seals
    inflight: deque[_Write] = field(default_factory=deque)  # oldest first; touched by the writer thread only


def _ensure_directory(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise SsdDirectoryError(
            f"umbp: cannot use SSD directory '{directory}': {exc.strerror}; give an existing, writable "
            "directory (or one whose parent is writable)"
        ) from None
    if not os.path.isdir(directory):
        raise SsdDirectoryError(f"umbp: SSD directory '{directory}' is not a directory")


def _lock_directory(directory: str) -> int:
    """flock the directory's LOCK file; the holder's pid goes into it for the error message."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise SsdDirectoryError(
            f"umbp: SSD directory '{directory}' is not writable ({exc.strerror}); the SSD tier needs a "
            "writable directory (read-only media and read-only mounts cannot hold a cache)"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise SsdLockedError(
            f"umbp: SSD directory '{directory}' is in use by another SsdTier (pid {holder}); two processes "
            "must not share one directory: give each process (each TP rank) its own subdirectory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class SsdTier(Pool):
    """The SSD tier: batched exists/put/get_into over segment files in one or more directories.

    capacity_bytes bounds the bytes of segment files (headers and padding included), split evenly across
    directories; queue_bytes bounds the staging buffer (the most bytes waiting to be written). See
    docs/ssd.md for every option and counter."""

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
        dirs = [os.fspath(dirs)] if isinstance(dirs, str | os.PathLike) else [
            os.fspath(d) if isinstance(d, os.PathLike) else d for d in dirs]
        o = SsdOptions(dirs=dirs, capacity_bytes=capacity_bytes, queue_bytes=queue_bytes, direct_io=direct_io,
                       segment_bytes=segment_bytes, low_watermark=low_watermark, max_io_bytes=max_io_bytes,
                       io_threads=io_threads, copy_threads=copy_threads, track_evicted=track_evicted,
                       health_interval_s=health_interval_s, prefault=prefault)
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
        self._copy_pool = (ThreadPoolExecutor(self._copy_threads - 1, thread_name_prefix="umbp-ssd-copy")
                           if self._copy_threads > 1 else None)
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
            ("puts", "put_duplicates", "dropped_backpressure", "dropped_failed", "dropped_write_error",
             "dropped_no_space",
             "put_checksum_mismatch", "records_written", "bytes_written", "tombstones", "tombstones_dropped", "hits", "hits_staged",
             "misses", "checksum_failures", "read_errors", "bytes_read", "evictions", "evicted_bytes",
             "segments_reclaimed", "copied_forward", "copied_forward_bytes", "segments_lost", "write_errors",
             "enospc", "seal_errors", "foreign_records", "restart_damaged_records", "restart_withheld_records"),
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
            # _WRITE_DEPTH writes and a seal (its fdatasync can take a while) run at once
            shard.io = ThreadPoolExecutor(_WRITE_DEPTH + 1, thread_name_prefix=f"umbp-ssd-io-{shard.number}")
            shard.thread = threading.Thread(target=self._writer, args=(shard,), daemon=True,
                                            name=f"umbp-ssd-writer-{shard.number}")
            shard.thread.start()

    # ---- opening a directory -------------------------------------------------------------------------

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SsdTier:
        """Build from a config mapping (SsdOptions: unknown keys are named, every value is checked)."""
        o = SsdOptions.from_options(options)
        return cls(o.dirs, o.capacity_bytes, o.queue_bytes, o.direct_io, segment_bytes=o.segment_bytes,
                   low_watermark=o.low_watermark, max_io_bytes=o.max_io_bytes, io_threads=o.io_threads,
                   copy_threads=o.copy_threads, track_evicted=o.track_evicted,
                   health_interval_s=o.health_interval_s, prefault=o.prefault)

    def _open_shard(self, number: int, directory: str, capacity: int) -> _Shard:
        _ensure_directory(directory)
        lock_fd = _lock_directory(directory)
        shard = _Shard(number, directory, lock_fd, capacity, threading.Condition(self._lock),
                       direct=self._direct_mode is not False, scratch=aligned_buffer(self._max_io), limit=capacity)
        try:
            self._rebuild(shard)
            self._refresh_limit(shard)
        except BaseException:
            self._close_shard_files(shard)
            raise
        return shard

    def _rebuild(self, shard: _Shard) -> None:
        """Adopt what the directory holds: index the winners, seal segments a crash left open."""
        found = scan(shard.directory)
        shard.next_seq, shard.next_segment = found.next_seq, found.next_segment
        shard.written_seq = found.next_seq - 1
        for reason in found.discarded:
            log.warning("umbp: SSD %s: %s", shard.directory, reason)
        self._counters["restart_damaged_records"] += found.damaged
        self._counters["restart_withheld_records"] += found.withheld
        self._unlink_empty(shard, found.segments)
        # numbers of deleted files are free again: a stray empty or garbage seg-999999999999.umbp must not
        # push every later name up
        shard.next_segment = max((s.number for s in found.segments if s.records), default=0) + 1
        by_number = {}
        for s in found.segments:
            if not s.records:
                continue
            seg = _Segment(s.number, s.path, self._open_fd(shard, s.path, create=False), s.size, s.sealed,
                           list(s.records), sum(entry_bytes(k.encode()) for k, _ in s.records))
            shard.segments.append(seg)
            by_number[s.number] = seg
            if not s.sealed:
                self._truncate(seg, s.valid_end)
                self._seal(shard, seg)
            self._set_reserved(shard, seg)
        for key, r in sorted(found.records.items(), key=lambda kv: kv[1].seq):  # oldest write = LRU end
            if self._shard_number(key) != shard.number:  # written when the directory list was different
                self._counters["foreign_records"] += 1
                continue
            self._index(shard, key, _Loc(by_number[r.segment], r.offset, r.length, r.checksum))

    @staticmethod
    def _unlink_empty(shard: _Shard, segments: list) -> None:
        """Delete segments left with nothing to serve (created just before a crash, or holding only records
        a loss withholds), durably, before the walked segments are sealed: a seal ends their walks, so a
        withheld older record must be gone from the disk before the loss that withholds it is forgotten."""
        empty = [s for s in segments if not s.records]
        for s in empty:
            os.unlink(s.path)
        if empty:
            dfd = os.open(shard.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _open_fd(self, shard: _Shard, path: str, create: bool) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC | ((os.O_CREAT | os.O_EXCL) if create else 0)
        if shard.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                if self._direct_mode is True:
                    raise SsdDirectoryError(
                        f"umbp: the filesystem of '{shard.directory}' does not support O_DIRECT; "
                        "use direct_io='auto' (falls back to buffered I/O) or False"
                    ) from None
                self._go_buffered(shard)
        return os.open(path, flags, 0o644)

    def _go_buffered(self, shard: _Shard) -> None:
        """Direct I/O refused here: switch this directory's files to buffered I/O (direct_io='auto')."""
        log.warning("umbp: SSD %s: O_DIRECT unsupported, using buffered I/O", shard.directory)
        shard.direct = False
        with self._lock:  # may run on a write thread while the writer adds or deletes segments
            segs = list(shard.segments)
        for seg in segs:
            if seg.fd >= 0:
                fcntl.fcntl(seg.fd, fcntl.F_SETFL, fcntl.fcntl(seg.fd, fcntl.F_GETFL) & ~os.O_DIRECT)

    @staticmethod
    def _truncate(seg: _Segment, valid_end: int) -> None:
        if valid_end < seg.size:
            os.ftruncate(seg.fd, valid_end)
            seg.size = valid_end

    # ---- routing and bookkeeping (callers hold the lock) ------------------------------------------------

    def _shard_number(self, key: str) -> int:
        """A stable hash (crc32, not Python's salted hash()): the same key maps to the same directory in
        every process and after every restart."""
        return 0 if self._ndirs == 1 else zlib.crc32(key.encode()) % self._ndirs

    def _route(self, key: str) -> _Shard:
        return self._shards[self._shard_number(key)]

    def _index(self, shard: _Shard, key: str, loc: _Loc, nbytes: int = 0) -> None:
        """Index key at loc; nbytes, when known, is its payload's bytes on disk (saves the writer a call a
        record)."""
        shard.index[key] = loc
        self._forget_ghost(shard, key)
        if key not in shard.lru:  # a written put keeps the place it took when it was put
            shard.lru[key] = None
        loc.seg.live[key] = None
        shard.live_bytes += nbytes or padded(loc.length)
        shard.stored_bytes += loc.length

    def _unindex(self, shard: _Shard, key: str, gone: bool) -> _Loc | None:
        """Drop key from the index; gone=True means it left without a remove() (reported by drain_evicted)."""
        loc = shard.index.pop(key, None)
        if loc is None:
            return None
        shard.lru.pop(key, None)
        loc.seg.live.pop(key, None)
        shard.live_bytes -= padded(loc.length)
        shard.stored_bytes -= loc.length
        if gone:
            shard.ghosts[key] = loc.seg  # a restart would find it: a remove() must still write a tombstone
            loc.seg.ghosts[key] = None
            if self._track_evicted:
                self._evicted.append(key)
        return loc

    @staticmethod
    def _forget_ghost(shard: _Shard, key: str) -> bool:
        """Drop key's unindexed record from the ghosts (a newer record or a tombstone shadows it); True if
        there was one."""
        seg = shard.ghosts.pop(key, None)
        if seg is not None:
            seg.ghosts.pop(key, None)
        return seg is not None

    def _set_reserved(self, shard: _Shard, seg: _Segment) -> None:
        new = seg.size if seg.sealed else seg.size + seal_bytes(seg.entry_bytes)
        shard.footprint += new - seg.reserved
        seg.reserved = new

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

    @property
    def queue_bytes(self) -> int:
        """Bytes of staging: what puts can hand over before the writer has written any of it."""
        return self._queue_bytes

    @property
    def max_object_bytes(self) -> int:
        """The largest payload put() accepts (for any key up to MAX_KEY_BYTES)."""
        room = min(self._queue_bytes, self._shards[0].capacity - seal_bytes(_ENTRY_BYTES + MAX_KEY_BYTES) - BLOCK)
        return max(room, 0) // BLOCK * BLOCK

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

    def put(self, keys: Sequence[str], buffers: Sequence[Any], checksums: Sequence[int] | None = None) -> list[bool]:
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

    def _stage(self, keys: Sequence[str], blobs: list[bytes], srcs: list[np.ndarray],
               out: list[bool]) -> list[tuple[int, _Item]]:
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
                start = (None if npages in refused else self._alloc.alloc(npages)) if starts is None else starts[k]
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

    def _copy_in(self, staged: list[tuple[int, _Item]], srcs: list[np.ndarray], checksums: Sequence[int] | None,
                 out: list[bool]) -> None:
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
        n = 1 if self._copy_pool is None or len(runs) < 2 or total < 2 * _SUM_RUN_BYTES else self._copy_threads
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
            while (j < len(staged) and j < limit and staged[j][1].length == it.length
                   and staged[j][1].start == staged[j - 1][1].start + it.npages):
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
            for (_k, item), digest in zip(staged[i:j], psums_of_records(block_rows(run), j - i, n), strict=True):
                item.checksum = digest

    def _enqueue_staged(self, staged: list[tuple[int, _Item]], checksums: Sequence[int] | None,
                        out: list[bool]) -> None:
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
            marks = [(s.directory, s.active.fd if s.active is not None else -1, s.written_seq) for s in self._shards]
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

    def _release_shards(self) -> None:
        for s in self._shards:
            self._close_shard_files(s)

    @staticmethod
    def _close_shard_files(shard: _Shard) -> None:
        for seg in shard.segments:
            if seg.fd >= 0:
                os.close(seg.fd)
                seg.fd = -1
        if shard.lock_fd >= 0:
            os.close(shard.lock_fd)  # releases the flock
            shard.lock_fd = -1

    # ---- input checks --------------------------------------------------------------------------------

    @staticmethod
    def _key_bytes(key: Any) -> bytes:
        return key_utf8("put", key, MAX_KEY_BYTES)

    def _fits(self, nbytes: int, key_len: int) -> bool:
        """Whether an object fits both the staging queue and a directory's capacity (its seal included)."""
        rec = record_bytes(nbytes)
        return (_staging_pages(nbytes) * BLOCK <= self._queue_bytes
                and rec + seal_bytes(_ENTRY_BYTES + key_len) <= self._shards[0].capacity)

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

    @staticmethod
    def _check_sizes(keys: Sequence[str], plans: list, dsts: list[np.ndarray]) -> None:
        for key, plan, dst in zip(keys, plans, dsts, strict=True):
            if plan is not None and dst.size != plan.length:
                raise BufferSizeError(
                    f"umbp: get_into buffer for key '{key}' is {dst.size} bytes but the stored object is "
                    f"{plan.length} bytes; pass a buffer of exactly {plan.length} bytes"
                )

    # ---- reading ---------------------------------------------------------------------------------------

    def _bounce(self) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = aligned_buffer(self._max_io)
        return buf

    def _read(self, keys: Sequence[str], plans: list, dsts: list[np.ndarray]) -> list[int]:
        """Staged objects are copied from staging. Records on disk are read in runs of adjacent records,
        pipelined: I/O threads read the next runs while this thread checks and copies the current one, so
        the per-object CPU work hides behind the disk instead of adding to it."""
        status = [_MISS] * len(keys)
        by_seg: dict[int, list[int]] = {}
        first: dict[int, int] = {}  # a record named twice in the batch is read once (a run breaks at a repeat)
        repeats: list[tuple[int, int]] = []
        for i, plan in enumerate(plans):
            if isinstance(plan, _Item):
                got = copy_with_checksum(self._staging_view(plan)[: plan.length], dsts[i], False)
                status[i] = _OK if got == plan.checksum else _BAD
            elif plan is not None:
                j = first.setdefault(id(plan), i)
                if j != i:
                    repeats.append((i, j))
                else:
                    by_seg.setdefault(id(plan.seg), []).append(i)
        runs = [run for idx in by_seg.values() for run in self._runs(plans, idx)]
        if len(runs) == 1 or self._io_threads == 0:
            for run in runs:
                self._read_run(run, keys, plans, dsts, status, self._bounce())
        elif runs:
            self._read_pipelined(runs, keys, plans, dsts, status)
        for i, j in repeats:
            status[i] = status[j]
            if status[j] == _OK:
                np.copyto(dsts[i], dsts[j])
        return status

    def _read_pipelined(self, runs: list[list[int]], keys: Sequence[str], plans: list, dsts: list,
                        status: list[int]) -> None:
        if self._executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self._io_threads, thread_name_prefix="umbp-ssd-read")
        free = list(self._run_buffers())
        pending: deque = deque()
        for run in runs:
            if self._whole_in_thread(run, keys, plans, dsts):  # large objects: read and verify there
                pending.append((None, self._executor.submit(
                    self._read_run, run, keys, plans, dsts, status, None)))
                continue
            while not free:  # every buffer in flight: finish the oldest jobs until one comes back
                self._complete(pending.popleft(), keys, plans, dsts, status, free)
            buf = free.pop()
            pending.append(((run, buf), self._executor.submit(self._fetch, run, plans, buf)))
        while pending:
            self._complete(pending.popleft(), keys, plans, dsts, status, free)

    def _complete(self, job: tuple, keys: Sequence[str], plans: list, dsts: list, status: list[int],
                  free: list[np.ndarray]) -> None:
        ctx, fut = job
        got = fut.result()
        if ctx is not None:
            run, buf = ctx
            self._verify_bounced(run, plans, dsts, status, buf, got)
            free.append(buf)

    def _run_buffers(self) -> list[np.ndarray]:
        """This calling thread's bounce buffers for pipelined runs (one per I/O thread, plus one)."""
        bufs = getattr(self._local, "runs", None)
        if bufs is None:
            bufs = self._local.runs = [aligned_buffer(self._run_bytes) for _ in range(self._io_threads + 1)]
        return bufs

    def _whole_in_thread(self, run: list[int], keys: Sequence[str], plans: list, dsts: list) -> bool:
        return self._zero_copy(run, keys, plans, dsts) or padded(plans[run[0]].length) >= self._run_bytes

    def _zero_copy(self, run: list[int], keys: Sequence[str], plans: list, dsts: list) -> bool:
        """Only records of a run's size or more are read straight into their destination. Smaller ones go
        through a bounce buffer and are verified a whole run at a time on the calling thread: that one
        vectorised pass beat a checksum call per object in the reader threads (which contend for the
        GIL) by a wide margin: 256 KiB objects 0.92-0.96 vs 0.67-0.68 of the disk, 1 MiB 1.07-1.12 vs
        0.75-0.78 (docs/ssd.md)."""
        return all(padded(plans[i].length) >= self._run_bytes and self._zero_copy_ok(keys[i], dsts[i])
                   for i in run)

    def _runs(self, plans: list, idx: list[int]) -> list[list[int]]:
        """Records of one segment whose payloads sit side by side (a write group's), grouped into reads of
        up to run_bytes."""
        idx = sorted(idx, key=lambda i: plans[i].offset)
        runs: list[list[int]] = []
        end = nbytes = -1
        for i in idx:
            loc = plans[i]
            rec = (loc.length + BLOCK - 1) // BLOCK * BLOCK
            if runs and loc.offset == end and nbytes + rec <= self._run_bytes and len(runs[-1]) < 256:
                runs[-1].append(i)
                nbytes += rec
            else:
                runs.append([i])
                nbytes = rec
            end = loc.offset + rec
        return runs

    def _read_run(self, run: list[int], keys: Sequence[str], plans: list, dsts: list, status: list[int],
                  buf: np.ndarray | None) -> None:
        """Read and verify one run, whichever way suits it."""
        first = plans[run[0]]
        if self._zero_copy(run, keys, plans, dsts):
            self._read_zero_copy(run, plans, dsts, status)
        elif padded(first.length) >= self._run_bytes:
            status[run[0]] = self._read_large(first, dsts[run[0]])
        else:
            buf = self._bounce() if buf is None else buf
            self._verify_bounced(run, plans, dsts, status, buf, self._fetch(run, plans, buf))

    @staticmethod
    def _fetch(run: list[int], plans: list, buf: np.ndarray) -> int:
        """Read the run's bytes into buf; returns the whole blocks read (0 on an I/O error)."""
        start, last = plans[run[0]].offset, plans[run[-1]]
        try:
            got = _preadv(plans[run[0]].seg.fd, [buf[: last.offset + padded(last.length) - start]], start)
        except OSError:
            return 0
        return got // BLOCK * BLOCK

    def _verify_bounced(self, run: list[int], plans: list, dsts: list, status: list[int], buf: np.ndarray,
                        got: int) -> None:
        """One numpy call for every block's sum and one for the psum64 of every payload of the run, then
        a copy per intact object into its destination. With the C extension: one call copies every whole
        record's payload into its destination and sums it on the way (a miss leaves its buffer undefined,
        as Pool.get_into allows)."""
        start = plans[run[0]].offset
        if native.lib is not None:
            whole = [i for i in run if plans[i].offset - start + padded(plans[i].length) <= got]
            srcs = [buf[plans[i].offset - start :][: plans[i].length] for i in whole]
            digests = dict(zip(whole, native.lib.psum_copy([dsts[i] for i in whole], srcs), strict=True))
            for i in run:
                d = digests.get(i)
                status[i] = _IOERR if d is None else _OK if d == plans[i].checksum else _BAD
            return
        rows = block_rows(buf[:got])
        length = plans[run[0]].length
        if length and all(plans[i].length == length for i in run):
            sums = psums_of_records(rows, min(len(run), got // padded(length)), length)
        else:
            sums = [self._psum_at(rows, plans[i], start, got) for i in run]
        for j, i in enumerate(run):
            loc = plans[i]
            rel = loc.offset - start
            if rel + padded(loc.length) > got:
                status[i] = _IOERR  # truncated or unreadable
            elif sums[j] != loc.checksum:
                status[i] = _BAD
            else:
                np.copyto(dsts[i], buf[rel : rel + loc.length])
                status[i] = _OK

    @staticmethod
    def _psum_at(rows: np.ndarray, loc: _Loc, start: int, got: int) -> int | None:
        r0 = (loc.offset - start) // BLOCK
        if loc.offset - start + padded(loc.length) > got:
            return None
        return psum_of_rows(rows[r0 : r0 + padded(loc.length) // BLOCK], loc.length)

    def _zero_copy_ok(self, key: str, dst: np.ndarray) -> bool:
        """O_DIRECT can read straight into dst only if dst is 4 KiB-aligned; buffered I/O always can."""
        return not self._route(key).direct or dst.ctypes.data % BLOCK == 0

    def _blocks(self, n: int) -> np.ndarray:
        """A per-thread aligned scratch of n blocks (partial last blocks of zero-copy reads)."""
        buf = getattr(self._local, "blocks", None)
        if buf is None or buf.size < n * BLOCK:
            buf = self._local.blocks = aligned_buffer(max(n, 64) * BLOCK)
        return buf

    def _read_zero_copy(self, run: list[int], plans: list, dsts: list, status: list[int]) -> None:
        """Large objects: one preadv for the run, each payload straight into its destination (its partial
        last block into scratch, copied after); then psum64 of dst. Headers are not re-read: the payload's
        psum64, recorded in the index from the header at write or scan time and mixing in the length,
        already proves the bytes are the object's."""
        scratch = self._blocks(len(run))
        iov, start = [], plans[run[0]].offset
        for j, i in enumerate(run):
            full = plans[i].length // BLOCK * BLOCK
            if full:
                iov.append(dsts[i][:full])
            if plans[i].length > full:
                iov.append(scratch[j * BLOCK : (j + 1) * BLOCK])
        try:
            got = _preadv(plans[run[0]].seg.fd, iov, start)
        except OSError:
            got = 0
        for j, i in enumerate(run):
            loc, dst = plans[i], dsts[i]
            full = loc.length // BLOCK * BLOCK
            if loc.offset - start + padded(loc.length) > got:
                status[i] = _IOERR
            else:
                tail = j * BLOCK
                dst[full:] = scratch[tail : tail + loc.length - full]
                status[i] = _OK if checksum_u8(dst) == loc.checksum else _BAD

    def _read_large(self, loc: _Loc, dst: np.ndarray) -> int:
        """A record larger than a run whose destination cannot take a direct read: chunked reads into the
        bounce buffer, block sums taken per chunk, payload copied out per chunk."""
        buf, off, end = self._bounce(), loc.offset, loc.offset + padded(loc.length)
        rows = np.empty((end - off) // BLOCK, np.uint64)
        pos = 0
        while off < end:
            n = min(self._max_io, end - off)
            try:
                if _preadv(loc.seg.fd, [buf[:n]], off) != n:
                    return _IOERR
            except OSError:
                return _IOERR
            r0 = (off - loc.offset) // BLOCK
            rows[r0 : r0 + n // BLOCK] = block_rows(buf[:n])
            take = min(n, loc.length - pos)
            np.copyto(dst[pos : pos + take], buf[:take])
            pos, off = pos + take, off + n
        return _OK if psum_of_rows(rows, loc.length) == loc.checksum else _BAD

    # ---- the writer thread -------------------------------------------------------------------------------

    def _writer(self, shard: _Shard) -> None:
        next_check = time.monotonic() + self._health_interval
        while True:
            with self._lock:
                while (not shard.queue and not shard.inflight and not self._stopping
                       and time.monotonic() < next_check):
                    shard.cv.wait(max(next_check - time.monotonic(), 0.001))
                if not shard.queue and not shard.inflight and self._stopping:
                    return
                batch = self._take_batch(shard)
                shard.busy = True
            try:
                if batch:
                    self._write_batch(shard, batch)
                else:  # nothing new to overlap with: land what is in flight
                    self._settle(shard)
                if time.monotonic() >= next_check:
                    self._settle(shard)
                    self._health_check(shard)
                    next_check = time.monotonic() + self._health_interval
            except Exception as exc:  # the writer must never die: fail the directory, keep serving reads
                log.exception("umbp: SSD writer for %s failed", shard.directory)
                self._fail(shard, f"writer error: {exc!r}")
                self._abandon(shard)
                self._drop(shard, batch, "dropped_write_error")
            finally:
                with self._lock:
                    shard.busy = bool(shard.inflight)
                    self._idle.notify_all()

    def _take_batch(self, shard: _Shard) -> list[_Item]:
        """Up to max_io_bytes of consecutive queued items (a clear always goes alone)."""
        batch: list[_Item] = []
        total = 0
        q = shard.queue
        while q and len(batch) < _MAX_BATCH_ITEMS:
            it = q[0]
            if it.kind == _CLEAR:
                if not batch:
                    batch.append(q.popleft())
                break
            if batch and total + it.nbytes > self._max_io:
                break
            q.popleft()
            if it.kind == _PUT and it.cancelled:  # removed while queued: never written
                self._finish(shard, it)
                continue
            it.state = WRITING
            batch.append(it)
            total += it.nbytes
        return batch

    def _write_batch(self, shard: _Shard, batch: list[_Item]) -> None:
        if batch[0].kind == _CLEAR:
            self._settle(shard)
            for seg in list(shard.segments):
                self._delete_segment(shard, seg)
            batch[0].done.set()
            return
        if shard.failed:
            self._drop(shard, batch, "dropped_failed")
            return
        i = 0
        while i < len(batch):
            group = self._next_group(shard, batch, i)
            self._write_group(shard, group)
            i += len(group)

    def _fits_active(self, shard: _Shard, nbytes: int) -> bool:
        seg = shard.active
        return seg is not None and (seg.size == 0 or seg.size + nbytes <= self._segment_bytes)

    def _plan_ahead(self, shard: _Shard, nbytes: int, ebytes: int) -> tuple[_Segment, int] | None:
        """(segment, offset) for a group appended behind the writes in flight, without waiting for them;
        None when the append needs the exact state (space to reclaim, no active segment, a failure), and
        the caller then settles first. A group that overflows the active segment opens the next one here;
        the full one is sealed once its last write lands (_seal_if_left, from here or _settle)."""
        seg = shard.active
        if seg is None or shard.failed:
            return None
        # writes in flight are not in the footprint yet (a seal in flight is: its segment reserved it)
        ahead = sum(w.nbytes + w.ebytes for w in shard.inflight if not w.seal) + BLOCK  # + their seal growth
        if shard.footprint + ahead + nbytes + seal_bytes(ebytes) + ebytes > shard.limit - self._reserve:
            return None
        tail = seg.size + sum(w.nbytes for w in shard.inflight if w.seg is seg)
        if tail == 0 or tail + nbytes <= self._segment_bytes:
            return seg, tail
        full = seg
        seg = self._new_segment(shard)  # becomes the active one
        if seg is None:
            return None
        self._seal_if_left(shard, full)  # now, unless writes to it are still in flight
        return seg, 0

    def _next_group(self, shard: _Shard, batch: list[_Item], i: int) -> list[_Item]:
        """The items from i on that go into one group of one segment: the active one if the first fits,
        else a new one (a group's head is counted with its payloads)."""
        seg = shard.active
        room = self._segment_bytes - seg.size if seg is not None and seg.size else self._segment_bytes
        first = head_bytes(entry_span(len(batch[i].key_bytes))) + batch[i].nbytes
        if first > room:
            room = max(self._segment_bytes, first)
        j, payload, spans = i, 0, 0
        while j < len(batch):
            it = batch[j]
            span = entry_span(len(it.key_bytes))
            if j > i and head_bytes(spans + span) + payload + it.nbytes > room:
                break
            payload, spans = payload + it.nbytes, spans + span
            j += 1
        return batch[i:j]

    def _append_cost(self, shard: _Shard, nbytes: int, ebytes: int) -> int:
        """Capacity an append of nbytes (adding ebytes of summary) takes, seal included."""
        seg = shard.active
        if self._fits_active(shard, nbytes):
            return nbytes + seal_bytes(seg.entry_bytes + ebytes) - seal_bytes(seg.entry_bytes)
        return nbytes + seal_bytes(ebytes)

    def _segment_for(self, shard: _Shard, nbytes: int) -> _Segment | None:
        if self._fits_active(shard, nbytes):
            return shard.active
        if shard.active is not None:
            self._seal(shard, shard.active)
        return self._new_segment(shard)

    def _write_group(self, shard: _Shard, group: list[_Item]) -> None:
        head = head_bytes(sum(entry_span(len(it.key_bytes)) for it in group))
        total = head + sum(it.nbytes for it in group)
        ebytes = sum(entry_bytes(it.key_bytes) for it in group)
        planned = self._plan_ahead(shard, total, ebytes)
        if planned is None:
            self._settle(shard)
            seg = self._place(shard, group, total, ebytes)
            if seg is None:
                return
            planned = seg, seg.size
        seg, offset = planned
        with self._lock:
            seqs = list(range(shard.next_seq, shard.next_seq + len(group)))
            shard.next_seq += len(group)
        iov, image = self._images(group, seqs, head)
        self._submit(shard, _Write(seg, group, seqs, offset, total, ebytes,
                                   shard.io.submit(self._pwrite, shard, seg, iov, offset), image, head=head))

    def _place(self, shard: _Shard, group: list[_Item], total: int, ebytes: int) -> _Segment | None:
        """The segment for a group once nothing is in flight: reclaim space first if needed; None (the
        group dropped, counted) when there is no room or no segment can be opened."""
        # Reclaim until the append leaves the cleaning reserve free (copy-forward writes into it). Each
        # round deletes one segment; a bound of one pass over the log keeps a pathological case finite.
        for _ in range(len(shard.segments) + 1):
            if shard.footprint + self._append_cost(shard, total, ebytes) <= shard.limit - self._reserve:
                break
            if not self._reclaim_oldest(shard, self._append_cost(shard, total, ebytes)):
                break
        if shard.footprint + self._append_cost(shard, total, ebytes) > shard.limit:
            self._drop(shard, group, "dropped_no_space")  # the filesystem has no room at all
            return
        seg = self._segment_for(shard, total)
        if seg is None:
            self._drop(shard, group, "dropped_failed" if shard.failed else "dropped_write_error")
        return seg

    def _images(self, group: list[_Item], seqs: list[int], head: int) -> tuple[list[memoryview], np.ndarray]:
        """The group's head (packed into a buffer of its own, as the write may outlive this call) and its
        payloads, as few buffers as possible: payloads staged side by side go as one."""
        image = aligned_buffer(head)
        pack_group(memoryview(image), [it.key_bytes for it in group],
                   [DATA if it.kind == _PUT else TOMBSTONE for it in group], seqs,
                   [it.length for it in group], [it.checksum for it in group])
        staging = self._staging_view_all
        spans: list[tuple[int, int]] = []  # (start, end) in staging, merged while adjacent
        for it in group:
            if it.kind != _PUT or not it.nbytes:
                continue
            lo = it.start * BLOCK
            if spans and spans[-1][1] == lo:
                spans[-1] = (spans[-1][0], lo + it.nbytes)
            else:
                spans.append((lo, lo + it.nbytes))
        return [memoryview(image)] + [staging[lo:hi] for lo, hi in spans], image

    def _submit(self, shard: _Shard, w: _Write) -> None:
        """Queue a planned write; then land the older ones, keeping _WRITE_DEPTH - 1 in flight while the
        writer prepares the next group. A segment the new write left behind is sealed once its writes
        have landed."""
        shard.inflight.append(w)
        self._settle(shard, keep=_WRITE_DEPTH - 1)

    def _settle(self, shard: _Shard, keep: int = 0) -> None:
        """Land the oldest writes in flight until `keep` are left: index what reached the file. After a
        short or failed write, the later writes to that segment are dropped and the file cut back to its
        valid end, so the next append lands right behind the last good record and no record follows a
        hole. Segments with no write left in flight that are no longer active get sealed. Seals in
        flight do not count towards `keep`: they land once done, or all of them when keep is 0."""
        while True:
            w = next((w for w in shard.inflight if not w.seal), None)
            if w is None or sum(not x.seal for x in shard.inflight) <= keep:
                break
            shard.inflight.remove(w)
            written = self._result(w)
            with self._lock:
                short = w.offset != w.seg.size
            self._commit(shard, w, 0 if short else written)
            if short or written < w.nbytes:
                self._cut_back(shard, w.seg)
            self._seal_if_left(shard, w.seg)
        for w in [w for w in shard.inflight if w.seal and (keep == 0 or w.future.done())]:
            shard.inflight.remove(w)
            self._sealed(shard, w.seg, bool(self._result(w)), w.nbytes)

    def _cut_back(self, shard: _Shard, seg: _Segment) -> None:
        """After a write to seg fell short: drop its later writes (waited for, never indexed) and cut the
        file to the last good record."""
        later = [w for w in shard.inflight if w.seg is seg]
        for w in later:
            self._result(w)
            shard.inflight.remove(w)
            self._drop(shard, w.group, "dropped_write_error")
        self._cut_file(seg)

    def _seal_if_left(self, shard: _Shard, seg: _Segment) -> None:
        """Seal seg (in the background) once it is no longer active and no write to it is in flight."""
        if seg is not shard.active and not seg.sealed and not seg.dead and all(w.seg is not seg for w in shard.inflight):
            self._seal_later(shard, seg)

    @staticmethod
    def _result(w: _Write) -> int:
        try:
            return w.future.result()
        except Exception:  # _pwrite counts OSErrors; anything else means nothing is known to be written
            log.exception("umbp: SSD write to %s failed", w.seg.path)
            return 0

    def _abandon(self, shard: _Shard) -> None:
        """After a writer error: wait for the writes in flight, drop them unindexed (counted) and cut their
        segments back to the last indexed record, so a restart does not find them either."""
        segs = {}
        while shard.inflight:
            w = shard.inflight.popleft()
            self._result(w)
            self._drop(shard, w.group, "dropped_write_error")
            segs[w.seg.number] = w.seg
        for seg in segs.values():
            self._cut_file(seg)

    @staticmethod
    def _cut_file(seg: _Segment) -> None:
        """Truncate seg's file to its indexed size: bytes of dropped writes beyond it must not be found
        by a restart's walk (the next append overwrites them only if it is at least as long)."""
        try:
            os.ftruncate(seg.fd, seg.size)
        except OSError as exc:
            log.warning("umbp: cannot cut %s back to %d bytes: %s", seg.path, seg.size, exc)

    def _pwrite(self, shard: _Shard, seg: _Segment, iov: list[np.ndarray], offset: int) -> int:
        """Bytes written (a short count on a partial write); 0 after an error, which is counted."""
        for attempt in (0, 1):
            try:
                return _pwritev(seg.fd, iov, offset)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self._direct_mode == "auto" and not attempt:
                    self._undirect(shard, seg)
                    continue
                self._write_failed(shard, exc)
                return 0
        return 0

    def _undirect(self, shard: _Shard, seg: _Segment) -> None:
        """After EINVAL from a write (direct_io='auto'): make sure the directory and this file use buffered
        I/O; the caller retries once. Checking shard.direct alone is not enough with writes in flight: another
        write thread may have switched the directory after this write was issued as a direct one, or this
        file may have been opened with O_DIRECT just as the switch happened."""
        if shard.direct:
            self._go_buffered(shard)
        flags = fcntl.fcntl(seg.fd, fcntl.F_GETFL)
        if flags & os.O_DIRECT:
            fcntl.fcntl(seg.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)

    def _write_failed(self, shard: _Shard, exc: OSError) -> None:
        with self._lock:
            self._counters["write_errors"] += 1
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._counters["enospc"] += 1
        log.warning("umbp: SSD write in %s failed: %s", shard.directory, exc)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self._refresh_limit(shard)  # what the filesystem really has left: reclaim down to it
        if exc.errno in _FATAL_ERRNOS:
            self._fail(shard, f"write failed: {exc.strerror}")

    def _commit(self, shard: _Shard, w: _Write, written: int) -> None:
        """Index the group's records if all of it reached the file, else drop them all (counted; the caller
        cuts the file back, so the next group lands right behind the last whole one). Runs under the lock
        for every record of the group, so counters and staging frees go once per group."""
        c = self._counters
        whole = written >= w.nbytes
        runs: list[tuple[int, int]] = []
        seg = w.seg
        entries, number, index = seg.entries, seg.number, shard.index
        with self._lock:
            pos, tombs, ebytes = seg.size + w.head, 0, 0
            for it, seq in zip(w.group, w.seqs, strict=True):
                put = it.kind == _PUT
                if whole:
                    entries.append((it.key, RecordInfo(number, pos, it.length, it.checksum, seq,
                                                       DATA if put else TOMBSTONE)))
                    ebytes += entry_bytes(it.key_bytes)
                    tombs += not put
                    if put and not it.cancelled:
                        if it.key in index:
                            self._unindex(shard, it.key, gone=False)
                        self._index(shard, it.key, _Loc(seg, pos, it.length, it.checksum), it.nbytes)
                elif put and not it.cancelled:
                    c["dropped_write_error"] += 1
                    if self._track_evicted:
                        self._evicted.append(it.key)
                elif not put:
                    c["tombstones_dropped"] += 1
                pos += it.nbytes
                if put:
                    self._finish(shard, it, runs)
                else:
                    it.state = DONE
            if whole:
                shard.written_seq = max(shard.written_seq, w.seqs[-1])
                seg.size += w.nbytes
                seg.entry_bytes += ebytes
                c["records_written"] += len(w.group)
                c["bytes_written"] += w.nbytes
                c["tombstones"] += tombs
            self._free_runs(runs)
            self._set_reserved(shard, seg)

    def _drop(self, shard: _Shard, items: list[_Item], counter: str) -> None:
        with self._lock:
            for it in items:
                if it.kind == _PUT and it.state != DONE:
                    if not it.cancelled:
                        self._counters[counter] += 1
                        if self._track_evicted:
                            self._evicted.append(it.key)
                    self._finish(shard, it)
                elif it.kind == _TOMB and it.state != DONE:
                    self._counters["tombstones_dropped"] += 1
                    it.state = DONE
                elif it.kind == _CLEAR and it.done is not None:
                    it.done.set()

    def _fail(self, shard: _Shard, why: str) -> None:
        with self._lock:
            if not shard.failed:
                shard.failed = why
                log.error("umbp: SSD directory %s disabled: %s (reads of intact records continue)",
                          shard.directory, why)

    # ---- segments: create, seal, reclaim, delete ----------------------------------------------------------

    def _new_segment(self, shard: _Shard) -> _Segment | None:
        number = shard.next_segment
        if number > MAX_SEGMENT_NUMBER:  # never a name the scanner would not read back
            self._fail(shard, f"segment numbers are exhausted (a file seg-{number - 1}.umbp is present)")
            return None
        shard.next_segment += 1
        path = os.path.join(shard.directory, segment_name(number))
        try:
            fd = self._open_fd(shard, path, create=True)
        except OSError as exc:
            self._write_failed(shard, exc)
            return None
        seg = _Segment(number, path, fd)
        with self._lock:
            shard.segments.append(seg)
            shard.active = seg
            self._set_reserved(shard, seg)
        return seg

    def _seal(self, shard: _Shard, seg: _Segment) -> None:
        """Append the summary record and trailer, sync, and stop appending to the segment."""
        image = self._seal_image(seg)
        self._sealed(shard, seg, self._seal_io(shard, seg, image, seg.size), image.size)

    def _seal_later(self, shard: _Shard, seg: _Segment) -> None:
        """_seal with its write and sync on an I/O thread, landed by _settle like a write: the writer
        goes on with the next segment meanwhile (a synchronous seal's fdatasync left the disk idle)."""
        image = self._seal_image(seg)
        future = shard.io.submit(self._seal_io, shard, seg, image, seg.size)
        shard.inflight.append(_Write(seg, [], [], seg.size, image.size, 0, future, image, seal=True))

    @staticmethod
    def _seal_image(seg: _Segment) -> np.ndarray:
        """The summary group (one entry whose payload lists every record of the segment) and the trailer,
        ready to append."""
        payload = np.frombuffer(pack_summary(seg.entries), np.uint8)
        head = head_bytes(entry_span(0))
        rec = head + padded(payload.size)
        buf = aligned_buffer(rec + BLOCK)
        pack_group(memoryview(buf), [b""], [SUMMARY], [0], [payload.size], [checksum_u8(payload)])
        buf[head : head + payload.size] = payload
        buf[head + payload.size : rec] = 0
        buf[rec:] = np.frombuffer(pack_trailer(seg.size, rec), np.uint8)
        return buf

    @staticmethod
    def _seal_io(shard: _Shard, seg: _Segment, image: np.ndarray, offset: int) -> bool:
        try:
            ok = _pwritev(seg.fd, [image], offset) == image.size
            os.fdatasync(seg.fd)
            if not shard.direct:
                os.posix_fadvise(seg.fd, 0, 0, os.POSIX_FADV_DONTNEED)  # sealed: keep the page cache free
        except OSError as exc:
            ok = False
            log.warning("umbp: sealing %s failed: %s (it will be walked at restart)", seg.path, exc)
        return ok

    def _sealed(self, shard: _Shard, seg: _Segment, ok: bool, nbytes: int) -> None:
        with self._lock:
            self._counters["seal_errors"] += not ok
            seg.size += nbytes if ok else 0
            seg.sealed = True
            if shard.active is seg:
                shard.active = None
            self._set_reserved(shard, seg)

    def _reclaim_oldest(self, shard: _Shard, need: int) -> bool:
        """Free the oldest segment: evict least recently used objects down to the low watermark, copy the
        live records left in the segment to the head (while they fit), delete it. False if none is left."""
        if not shard.segments:
            return False
        victim = shard.segments[0]
        if victim is shard.active:
            self._seal(shard, victim)
        with self._lock:
            self._evict_lru(shard, need)
            keys = list(victim.live)
        for key in keys:
            with self._lock:
                loc = shard.index.get(key)
            if loc is None or loc.seg is not victim:
                continue
            cost = self._append_cost(shard, record_bytes(loc.length), entry_bytes(key.encode()))
            # the copy must fit now, and the pending write once the victim is gone (its bytes are freed):
            # not crediting them evicted recently used objects out of LRU order whenever a large write was
            # pending (seen as a flaky LRU test on a loaded 2-core VM, where writes batch up)
            fits = (shard.footprint + cost <= shard.limit
                    and shard.footprint + cost + need - victim.reserved <= shard.limit)
            if not (fits and self._copy_forward(shard, key, loc)):
                with self._lock:
                    if shard.index.get(key) is loc:
                        self._evict(shard, key)
        self._delete_segment(shard, victim)
        with self._lock:
            self._counters["segments_reclaimed"] += 1
        return True

    def _evict_lru(self, shard: _Shard, need: int) -> None:
        """Evict least recently used objects on disk until they and `need` fit under the low watermark
        (puts still queued are skipped: evicting them frees no disk space)."""
        target = self._low * (shard.limit - self._reserve)
        excess = shard.live_bytes + need - target
        victims = []
        for key in shard.lru:
            if excess <= 0:
                break
            loc = shard.index.get(key)
            if loc is not None:
                victims.append(key)
                excess -= padded(loc.length)
        for key in victims:
            self._evict(shard, key)

    def _evict(self, shard: _Shard, key: str) -> None:
        loc = self._unindex(shard, key, gone=True)
        self._counters["evictions"] += 1
        self._counters["evicted_bytes"] += loc.length

    def _copy_forward(self, shard: _Shard, key: str, loc: _Loc) -> bool:
        """Rewrite a live record at the head, a group of its own with a new seq; the payload is copied as
        is (its checksum is verified when it is served)."""
        kb = key.encode()
        head, pay = head_bytes(entry_span(len(kb))), padded(loc.length)
        seg = self._segment_for(shard, head + pay)
        if seg is None:
            return False
        with self._lock:
            seq = shard.next_seq
            shard.next_seq += 1
        buf, base = shard.scratch, seg.size
        pack_group(memoryview(buf), [kb], [DATA], [seq], [loc.length], [loc.checksum])
        if self._pwrite(shard, seg, [buf[:head]], base) != head:
            return False
        for pos in range(0, pay, self._max_io):
            n = min(self._max_io, pay - pos)
            try:
                ok = _preadv(loc.seg.fd, [buf[:n]], loc.offset + pos) == n
            except OSError:
                ok = False
            if not ok or self._pwrite(shard, seg, [buf[:n]], base + head + pos) != n:
                return False
        at = base + head
        with self._lock:
            seg.entries.append((key, RecordInfo(seg.number, at, loc.length, loc.checksum, seq, DATA)))
            seg.entry_bytes += entry_bytes(kb)
            seg.size = at + pay
            shard.written_seq = max(shard.written_seq, seq)
            self._set_reserved(shard, seg)
            self._counters["copied_forward"] += 1
            self._counters["copied_forward_bytes"] += head + pay
            if shard.index.get(key) is loc:  # else removed meanwhile: the copy is dead, a tombstone follows
                shard.index[key] = _Loc(seg, at, loc.length, loc.checksum)  # same place in the LRU
                del loc.seg.live[key]
                seg.live[key] = None
        return True

    def _delete_segment(self, shard: _Shard, seg: _Segment) -> None:
        with self._lock:
            for key in list(seg.live):
                self._unindex(shard, key, gone=True)
            for key in seg.ghosts:  # deleted with the segment: nothing left to shadow
                if shard.ghosts.get(key) is seg:
                    del shard.ghosts[key]
            seg.ghosts.clear()
            shard.segments.remove(seg)
            if shard.active is seg:
                shard.active = None
            shard.footprint -= seg.reserved
            seg.reserved = 0
            seg.dead = True
            close = seg.pins == 0 and seg.fd >= 0
            fd = seg.fd
            if close:
                seg.fd = -1
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("umbp: cannot delete %s: %s", seg.path, exc)
        if close:
            os.close(fd)

    def _health_check(self, shard: _Shard) -> None:
        """Notice segments deleted under us (their objects become misses), a vanished directory, and how
        much room the filesystem really has (capacity is lowered while it has less)."""
        with self._lock:
            segs = list(shard.segments)
        lost = [s for s in segs if s.fd >= 0 and os.fstat(s.fd).st_nlink == 0]
        for seg in lost:
            log.error("umbp: SSD segment %s was deleted by someone else; its objects are now misses", seg.path)
            self._delete_segment(shard, seg)
        with self._lock:
            self._counters["segments_lost"] += len(lost)
        if not os.path.isdir(shard.directory):
            self._fail(shard, "the directory vanished")
        else:
            self._refresh_limit(shard)

    def _refresh_limit(self, shard: _Shard) -> None:
        try:
            st = os.statvfs(shard.directory)
        except OSError:
            return
        with self._lock:  # the bytes already in files plus the free space: seals still to come count in
            on_disk = sum(seg.size for seg in shard.segments)
            shard.limit = min(shard.capacity, on_disk + st.f_bavail * st.f_frsize)
