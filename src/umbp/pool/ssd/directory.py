"""Opening an SSD directory: lock it against other processes, scan its segments, rebuild the index."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading

from umbp.pool.buffers import aligned_buffer
from umbp.pool.ssd.format import (
    LOCK_NAME,
    entry_bytes,
)
from umbp.pool.ssd.recovery import scan
from umbp.pool.ssd.shard import (
    SsdDirectoryError,
    SsdLockedError,
    _Loc,
    _Segment,
    _Shard,
)

log = logging.getLogger("umbp.ssd")


class DirectoryMixin:
    """Part of SsdTier (umbp.pool.ssd.tier), split out by concern: it works on the tier's own state
    (`self`) under the tier's one lock, so the methods read exactly as they would in one class."""

    def _open_shard(self, number: int, directory: str, capacity: int) -> _Shard:
        _ensure_directory(directory)
        lock_fd = _lock_directory(directory)
        shard = _Shard(
            number,
            directory,
            lock_fd,
            capacity,
            threading.Condition(self._lock),
            direct=self._direct_mode is not False,
            scratch=aligned_buffer(self._max_io),
            limit=capacity,
        )
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
            seg = _Segment(
                s.number,
                s.path,
                self._open_fd(shard, s.path, create=False),
                s.size,
                s.sealed,
                list(s.records),
                sum(entry_bytes(k.encode()) for k, _ in s.records),
            )
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
