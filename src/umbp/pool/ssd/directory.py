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
    segment_number,
)
from umbp.pool.ssd.recovery import scan
from umbp.pool.ssd.shard import (
    SsdDirectoryError,
    SsdLockedError,
    _Loc,
    _Segment,
    _Shard,
)
from umbp.regular_file import NotRegularFile, open_regular

log = logging.getLogger("umbp.ssd")


class DirectoryMixin:
    """Part of SsdTier (umbp.pool.ssd.tier), split out by concern: it works on the tier's own state
    (`self`) under the tier's one lock, so the methods read exactly as they would in one class."""

    def _open_shard(self, number: int, directory: str, capacity: int) -> _Shard:
        _ensure_directory(directory)
        lock_fd, lock_file_fd = _lock_directory(directory)
        shard = _Shard(
            number,
            directory,
            lock_fd,
            capacity,
            threading.Condition(self._lock),
            direct=self._direct_mode is not False,
            scratch=aligned_buffer(self._max_io),
            limit=capacity,
            lock_file_fd=lock_file_fd,
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
        # push every later name up; a name in use by something else (found.skipped) is never reused
        taken = [s.number for s in found.segments if s.records] + [segment_number(n) for n in found.skipped]
        shard.next_segment = max(taken, default=0) + 1
        by_number = {}
        for s in found.segments:
            if not s.records:
                continue
            seg = self._adopt(shard, s)
            if seg is None:
                continue
            shard.segments.append(seg)
            by_number[s.number] = seg
            self._set_reserved(shard, seg)
        for key, r in sorted(found.records.items(), key=lambda kv: kv[1].seq):  # oldest write = LRU end
            if self._shard_number(key) != shard.number:  # written when the directory list was different
                self._counters["foreign_records"] += 1
                continue
            if r.segment not in by_number:  # its newest version is in a segment that could not be adopted:
                continue  # not served at all (an older version elsewhere must not come back in its place)
            self._index(shard, key, _Loc(by_number[r.segment], r.offset, r.length, r.checksum))

    def _adopt(self, shard: _Shard, s) -> _Segment | None:
        """Open a scanned segment for the tier (sealing one a crash left open), or None when the disk
        refuses (read-only file, I/O error): its records are then not served, counted and logged, and
        the file is left as it is."""
        seg = None
        try:
            seg = _Segment(
                s.number,
                s.path,
                self._open_fd(shard, s.path, create=False),
                s.size,
                s.sealed,
                list(s.records),
                sum(entry_bytes(k.encode()) for k, _ in s.records),
            )
            if not s.sealed:
                self._truncate(seg, s.valid_end)
                self._seal(shard, seg)
            return seg
        except SsdDirectoryError:
            raise
        except OSError as exc:
            if seg is not None and seg.fd >= 0:
                os.close(seg.fd)
            self._counters["restart_damaged_records"] += len(s.records)
            log.warning(
                "umbp: SSD %s: cannot adopt %s (%s): its %d records are not served",
                shard.directory,
                os.path.basename(s.path),
                exc.strerror or exc,
                len(s.records),
            )
            return None

    @staticmethod
    def _unlink_empty(shard: _Shard, segments: list) -> None:
        """Delete segments left with nothing to serve (created just before a crash, or holding only records
        a loss withholds), durably, before the walked segments are sealed: a seal ends their walks, so a
        withheld older record must be gone from the disk before the loss that withholds it is forgotten."""
        empty = [s for s in segments if not s.records]
        for s in empty:
            try:
                os.unlink(s.path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # left in place, its withheld records could be served after the seal
                raise SsdDirectoryError(
                    f"umbp: SSD directory '{shard.directory}': cannot delete {os.path.basename(s.path)}, "
                    f"which holds only records that must not be served ({exc.strerror}); make it deletable "
                    "or remove it"
                ) from None
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
        for name in ("lock_file_fd", "lock_fd"):
            fd = getattr(shard, name)
            if fd >= 0:
                os.close(fd)  # releases its flock
                setattr(shard, name, -1)


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


def _lock_directory(directory: str) -> tuple[int, int]:
    """flock the directory itself and its LOCK file (the one earlier versions lock; the holder's pid goes
    into it for the error message); returns both descriptors. The directory is what keeps a second owner
    out: a LOCK file deleted and made again while its owner runs would let a second process lock the new
    file and write beside the owner."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise SsdDirectoryError(f"umbp: cannot open SSD directory '{directory}' ({exc.strerror})") from None
    fd = -1
    try:
        fd = _open_lock(directory, path)
        for held in (dfd, fd):
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                raise SsdLockedError(
                    f"umbp: SSD directory '{directory}' is in use by another SsdTier (pid {holder}); two "
                    "processes must not share one directory: give each process (each TP rank) its own "
                    "subdirectory"
                ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return dfd, fd
    except BaseException:
        for opened in (fd, dfd):
            if opened >= 0:
                os.close(opened)
        raise


def _open_lock(directory: str, path: str) -> int:
    try:
        return open_regular(path, os.O_RDWR | os.O_CREAT, follow=False)
    except OSError as exc:
        if isinstance(exc, NotRegularFile) or exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise SsdDirectoryError(
                f"umbp: SSD directory '{directory}': its LOCK is not a regular file; remove it"
            ) from None
        raise SsdDirectoryError(
            f"umbp: SSD directory '{directory}' is not writable ({exc.strerror}); the SSD tier needs a "
            "writable directory (read-only media and read-only mounts cannot hold a cache)"
        ) from None
