"""The writer thread of each SSD directory: takes staged items in batches, packs them into groups,
keeps io_hooks.WRITE_DEPTH writes in flight, commits what landed into the index."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time

import numpy as np

from umbp.pool.buffers import aligned_buffer
from umbp.pool.ssd import io_hooks
from umbp.pool.ssd.format import (
    BLOCK,
    DATA,
    TOMBSTONE,
    RecordInfo,
    entry_bytes,
    entry_span,
    head_bytes,
    pack_group,
    seal_bytes,
)
from umbp.pool.ssd.shard import (
    _CLEAR,
    _FATAL_ERRNOS,
    _MAX_BATCH_ITEMS,
    _PUT,
    _TOMB,
    DONE,
    WRITING,
    _Item,
    _Loc,
    _Segment,
    _Shard,
    _Write,
)

log = logging.getLogger("umbp.ssd")


class WriterMixin:
    """Part of SsdTier (umbp.pool.ssd.tier), split out by concern: it works on the tier's own state
    (`self`) under the tier's one lock, so the methods read exactly as they would in one class."""

    def _writer(self, shard: _Shard) -> None:
        next_check = time.monotonic() + self._health_interval
        while True:
            with self._lock:
                while (
                    not shard.queue
                    and not shard.inflight
                    and not self._stopping
                    and time.monotonic() < next_check
                ):
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
        self._submit(
            shard,
            _Write(
                seg,
                group,
                seqs,
                offset,
                total,
                ebytes,
                shard.io.submit(self._pwrite, shard, seg, iov, offset),
                image,
                head=head,
            ),
        )

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
        pack_group(
            memoryview(image),
            [it.key_bytes for it in group],
            [DATA if it.kind == _PUT else TOMBSTONE for it in group],
            seqs,
            [it.length for it in group],
            [it.checksum for it in group],
        )
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
        """Queue a planned write; then land the older ones, keeping io_hooks.WRITE_DEPTH - 1 in flight while the
        writer prepares the next group. A segment the new write left behind is sealed once its writes
        have landed."""
        shard.inflight.append(w)
        self._settle(shard, keep=io_hooks.WRITE_DEPTH - 1)

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
        if (
            seg is not shard.active
            and not seg.sealed
            and not seg.dead
            and all(w.seg is not seg for w in shard.inflight)
        ):
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
                return io_hooks.pwritev(seg.fd, iov, offset)
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
                    entries.append(
                        (
                            it.key,
                            RecordInfo(number, pos, it.length, it.checksum, seq, DATA if put else TOMBSTONE),
                        )
                    )
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
                log.error(
                    "umbp: SSD directory %s disabled: %s (reads of intact records continue)",
                    shard.directory,
                    why,
                )
