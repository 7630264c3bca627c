"""Space in an SSD directory: segments created, sealed, reclaimed oldest first (live objects copied
forward, LRU evicted down to the low watermark) and deleted; the directory's health check."""

from __future__ import annotations

import logging
import os

import numpy as np

from umbp.pool.buffers import aligned_buffer
from umbp.pool.checksum import checksum_u8
from umbp.pool.ssd import io_hooks
from umbp.pool.ssd.format import (
    BLOCK,
    DATA,
    MAX_SEGMENT_NUMBER,
    SUMMARY,
    RecordInfo,
    entry_bytes,
    entry_span,
    head_bytes,
    pack_group,
    pack_summary,
    pack_trailer,
    padded,
    record_bytes,
    segment_name,
)
from umbp.pool.ssd.shard import (
    _Loc,
    _Segment,
    _Shard,
    _Write,
)

log = logging.getLogger("umbp.ssd")


class SpaceMixin:
    """Part of SsdTier (umbp.pool.ssd.tier), split out by concern: it works on the tier's own state
    (`self`) under the tier's one lock, so the methods read exactly as they would in one class."""

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
            ok = io_hooks.pwritev(seg.fd, [image], offset) == image.size
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
            fits = (
                shard.footprint + cost <= shard.limit
                and shard.footprint + cost + need - victim.reserved <= shard.limit
            )
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
                ok = io_hooks.preadv(loc.seg.fd, [buf[:n]], loc.offset + pos) == n
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
            log.error(
                "umbp: SSD segment %s was deleted by someone else; its objects are now misses", seg.path
            )
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
