"""How RedisTier writes: `put` sends while it sums, `put_async` copies into a bounded arena that a
background writer thread sends in batches."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from umbp.pool.buffers import aligned_buffer, prepare_buffers
from umbp.pool.checksum import copy_with_checksum
from umbp.pool.dram.allocator import PageAllocator
from umbp.pool.errors import BufferSizeError
from umbp.pool.keycheck import check_keys
from umbp.pool.remote.auth import PlainCodec, SealedCodec
from umbp.pool.remote.backend import Group, Standalone
from umbp.pool.remote.calls import (
    _ASKING,
    _asked,
    _Job,
)
from umbp.pool.remote.resp import (
    ReplyError,
    Wire,
    bulk,
)

if TYPE_CHECKING:
    from umbp.pool.remote.tier import RedisTier

log = logging.getLogger("umbp.remote")

_PAGE = 4096  # put_async arena page: copies start page-aligned, so they are summed and sent whole
PUT_SEND_BYTES = 256 << 10  # a put sends whenever this much payload is ready (see _store_job)
_STORED = b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n+OK\r\n+OK\r\n"  # MULTI, SET value, SET marker, EXEC
_STORED_RUN = 4096  # saves whose all-OK replies are matched at once (160 KiB of replies)
_MULTI, _EXEC = b"*1\r\n$5\r\nMULTI\r\n", b"*1\r\n$4\r\nEXEC\r\n"


@dataclass
class _Item:
    """One object to send: header and payload kept apart so the payload is never concatenated. A
    synchronous put leaves the header (which holds the payload's psum64) to `framed_header`, called just
    before the object is sent, so the server stores the objects already sent while the client sums the
    next one; put_async has it from its checksummed copy."""

    key: str
    payload: np.ndarray
    header: bytes | None = None
    pages: tuple[int, int] | None = None  # put_async: (first page, count) of its copy in the writer's arena
    codec: PlainCodec | SealedCodec | None = None  # seals a synchronous put's payload when it is sent

    def framed_header(self) -> bytes:
        """The header (and for an encrypting codec, the ciphertext as the payload to send)."""
        if self.header is None:
            assert self.codec is not None
            self.header, self.payload = self.codec.seal(self.key, self.payload, None)
        return self.header


class _Writer:
    """put_async's background writer: a bounded byte queue and one daemon thread that sends batches.

    Queued copies live in one arena of max_bytes, mapped once and reused (4 KiB pages, runs handed out
    by a PageAllocator), not in a fresh array per object: a fresh array of a hybrid state's size is a new
    mmap whose every page faults on first touch, which made put_async's copy ~1.8x slower for 1.6 MiB
    objects (docs/remote.md). Pages are mapped on first use and stay resident afterwards."""

    def __init__(self, tier: RedisTier, max_bytes: int, batch: int) -> None:
        self._tier, self._batch = tier, batch
        self._arena = aligned_buffer(max_bytes, populate=False)
        self._pages = PageAllocator(max_bytes // _PAGE)
        self._queue: deque[_Item] = deque()
        # every reservation until its pages are given back: None while being copied, then its _Item (queued
        # or being sent); reads are served from it (see copy_out)
        self._queued: dict[str, _Item | None] = {}
        self._bytes = 0
        self._busy = False
        self._stop = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def reserve(self, key: str, nbytes: int) -> tuple[str, np.ndarray | None, tuple[int, int] | None]:
        """('dup', ...) already queued; ('full', ...) no room; ('ok', room, pages): nbytes of the arena to
        copy into, and the pages to give back (unreserve, or the writer once sent)."""
        with self._cv:
            if key in self._queued:
                return "dup", None, None
            npages = max(-(-nbytes // _PAGE), 1)
            start = None if self._stop else self._pages.alloc(npages)
            if start is None:
                return "full", None, None
            self._bytes += nbytes
            self._queued[key] = None
            return "ok", self._arena[start * _PAGE : start * _PAGE + nbytes], (start, npages)

    def push(self, item: _Item) -> None:
        with self._cv:
            self._queue.append(item)
            self._queued[item.key] = item
            if self._thread is None or not self._thread.is_alive():  # first use, or a forked child
                self._thread = threading.Thread(target=self._run, name="umbp-remote-writer", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def unreserve(self, key: str, nbytes: int, pages: tuple[int, int]) -> None:
        with self._cv:
            self._give_back(key, nbytes, pages)

    def _give_back(self, key: str, nbytes: int, pages: tuple[int, int]) -> None:
        """A reservation ends (its object sent, dropped, or never queued); the caller holds _cv."""
        self._bytes -= nbytes
        self._queued.pop(key, None)
        self._pages.free(*pages)

    def holding(self, keys: Sequence[str]) -> list[int]:
        """Indices of keys whose copy is queued or being sent. Checked before the server is asked: a copy
        is given back only after its write finished, so a key not held here then is on the server by the
        time the server is asked, or was never (or not successfully) written."""
        if not self._queued:  # a dict's truth test needs no lock; a miss here is re-checked by the server
            return []
        with self._cv:
            return [i for i, k in enumerate(keys) if self._queued.get(k) is not None]

    def copy_out(self, key: str, dst: np.ndarray) -> bytes | None:
        """Copy a queued (or being sent) object of dst's size into dst and return its header; None when
        none is held. Under the lock, so its pages cannot be reused meanwhile."""
        with self._cv:
            item = self._queued.get(key)
            if item is None or item.payload.size != dst.size:
                return None
            np.copyto(dst, item.payload)
            assert item.header is not None  # put_async items are sealed before they are pushed
            return item.header

    def _take(self) -> list[_Item] | None:
        with self._cv:
            while not self._queue and not self._stop:
                self._cv.wait()
            if not self._queue:
                return None
            n = min(self._batch, len(self._queue))
            self._busy = True
            return [self._queue.popleft() for _ in range(n)]

    def _run(self) -> None:
        while (items := self._take()) is not None:
            try:
                self._tier._write(items)
            except Exception:  # never let the writer die: the engine would silently stop saving
                log.exception("umbp: remote writer batch failed")
                self._tier._count(puts_dropped=len(items))
            finally:
                with self._cv:
                    for it in items:
                        self._give_back(it.key, it.payload.size, it.pages)
                    self._busy = False
                    self._cv.notify_all()

    def gauges(self) -> tuple[int, int]:
        with self._cv:
            return len(self._queue), self._bytes

    def flush(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        with self._cv:
            self._stop = True
            dropped = len(self._queue)
            for it in self._queue:
                self._give_back(it.key, it.payload.size, it.pages)
            self._queue.clear()
            self._cv.notify_all()
        if dropped:
            self._tier._count(puts_dropped=dropped)
        if self._thread is not None:
            self._thread.join(timeout)


class WriterMixin:
    """Part of RedisTier (umbp.pool.remote.tier), split out by concern: it works on the tier's own
    state (`self`), so the methods read exactly as they would in one class."""

    def put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Synchronous: True once stored (or already present); False when the save was dropped (server
        unavailable: counted). The payload is sent from the caller's buffer without a copy."""
        keys = list(keys)
        check_keys("put", keys)
        srcs = prepare_buffers("put", keys, buffers, writable=False)
        items = [_Item(k, s, codec=self._codec) for k, s in zip(keys, srcs, strict=True)]
        return self._write(items)

    def put_async(
        self, keys: Sequence[str], buffers: Sequence[Any], checksums: Sequence[int] | None = None
    ) -> list[bool]:
        """Copy each buffer (checksummed during the copy) into the write queue and return at once. True:
        accepted (or already queued); False: dropped because the queue is full, the server is down, or
        `checksums[i]` was given and the copied bytes do not match it. The worker passes the digests the
        GPU computed while saving, so bytes that changed in the arena slot since (a slot already reused
        by a later save) are never published under this key with a checksum of their own."""
        keys = list(keys)
        check_keys("put_async", keys)
        srcs = prepare_buffers("put_async", keys, buffers, writable=False)
        if checksums is not None and len(checksums) != len(keys):
            raise BufferSizeError(f"umbp: put_async got {len(keys)} keys but {len(checksums)} checksums")
        if isinstance(self._backend, Standalone) and self._is_down(self._backend.name):
            self._count(puts_dropped=len(keys), puts_dropped_unavailable=len(keys))
            return [False] * len(keys)
        expected = checksums if checksums is not None else [None] * len(keys)
        return [self._enqueue(k, s, c) for k, s, c in zip(keys, srcs, expected, strict=True)]

    @property
    def intake_bytes(self) -> int:
        return self.config.write_queue_bytes

    def write_behind(
        self, keys: Sequence[str], buffers: Sequence[Any], checksums: Sequence[int] | None = None
    ) -> list[bool]:
        """`put_async`: a checked copy into the write queue; the background writer sends it."""
        return self.put_async(keys, buffers, checksums=checksums)

    def _enqueue(self, key: str, src: np.ndarray, expected: int | None) -> bool:
        state, copy, pages = self._writer.reserve(key, src.size)
        if state == "dup":
            self._count(put_duplicates=1)
            return True
        if state == "full":
            self._count(puts_dropped=1, puts_dropped_queue_full=1)
            return False
        try:
            digest = copy_with_checksum(copy, src, to_region=True)
        except BaseException:
            self._writer.unreserve(key, src.size, pages)
            raise
        if expected is not None and digest != int(expected) & ((1 << 64) - 1):
            self._writer.unreserve(key, src.size, pages)
            self._count(puts_dropped=1, puts_dropped_checksum=1)
            return False
        try:
            header, stored = self._codec.seal(key, copy, digest)
            if stored is not copy:  # encrypted: the ciphertext replaces the plaintext copy in the arena
                copy[...] = stored
        except BaseException:
            self._writer.unreserve(key, src.size, pages)
            raise
        self._writer.push(_Item(key, copy, header, pages))
        self._count(async_accepted=1)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until put_async's queue is written (or dropped); False on timeout."""
        return self._writer.flush(timeout)

    def _write(self, items: list[_Item]) -> list[bool]:
        """One pipelined round per server: SET value NX, then SET marker NX, per object. NX makes a
        duplicate put a no-op without a probe round trip first (the duplicate's bytes still travel:
        duplicates are rare, since an engine saves what a lookup did not find)."""
        keys = [it.key for it in items]
        res: list[Any] = [None] * len(items)
        deadline = time.monotonic() + self.config.deadline_s(sum(it.payload.size for it in items))
        groups = (self._groups(keys) if items else {}) or {}
        self._run([self._store_job(node, gs, items, res) for node, gs in groups.items()])
        if res.count(True) != len(res) and any(isinstance(r, ReplyError) for r in res):
            self._write_slow(items, res, deadline)
        return self._finish_put(items, res)

    def _store_job(
        self, node: str, groups: list[Group], items: list[_Item], res: list[Any], ask: bool = False
    ) -> _Job:
        order = [(g.prefix, j) for g in groups for j in g.indices]

        def send(wire: Wire) -> None:
            """The first object goes out alone, the rest whenever PUT_SEND_BYTES of payload are ready: the
            server starts storing while the client still sums the rest, at one sendmsg per object only
            for objects of PUT_SEND_BYTES and more."""
            parts: list[bytes | memoryview] = []
            ready = 0
            for r, (prefix, j) in enumerate(order):
                parts.extend(self._store_parts(prefix, items[j], ask))
                ready += items[j].payload.size
                if r == 0 or ready >= PUT_SEND_BYTES:
                    wire.send(parts)
                    parts, ready = [], 0
            if parts:
                wire.send(parts)

        def read(wire: Wire) -> None:
            if ask:
                for _, j in order:
                    res[j] = self._asked_stored(wire)
                return
            for c0 in range(0, len(order), _STORED_RUN):  # matched a run at a time: a bounded buffer
                run = order[c0 : c0 + _STORED_RUN]
                if wire.try_consume(_STORED * len(run)):
                    for _, j in run:
                        res[j] = True
                    continue
                for _, j in run:
                    res[j] = self._stored([wire.reply(max_bulk=0, max_items=2, depth=2) for _ in range(4)])

        return _Job(node, send, read, len(order), sum(items[j].payload.size for _, j in order))

    def _stored(self, replies: list[Any]) -> Any:
        """True (written), 'dup' (the value was there already), a MOVED/ASK (to follow), or None
        (dropped: an error reply, counted in reply_errors, or a reply that is not what MULTI/SET/SET/EXEC
        answer, counted in unexpected_replies: only a server that said OK to the value counts it as
        stored)."""
        multi, queued_value, queued_marker, done = replies
        errors = [r for r in replies if isinstance(r, ReplyError)]
        if errors:
            redirect = next((r for r in errors if r.redirect), None)
            return self._reply_error(redirect or errors[0])
        if not (
            multi == b"OK"
            and queued_value == queued_marker == b"QUEUED"
            and isinstance(done, list)
            and len(done) == 2
            and done[1] in (b"OK", None)
        ):
            self._count(unexpected_replies=1)
            return None
        if done[0] == b"OK":
            return True
        if done[0] is None:
            return "dup"
        self._count(unexpected_replies=1)
        return None

    def _store_parts(self, prefix: str, item: _Item, ask: bool = False) -> list[bytes | memoryview]:
        """MULTI, SET value NX [PX], SET marker NX [PX], EXEC. In a transaction because ordering alone
        is not enough: with maxmemory + noeviction Redis refuses the value's SET (OOM: its bytes are in
        the query buffer) yet accepts the 1-byte marker's once they are freed, leaving a marker that
        promises a value that was never stored. A refused command inside MULTI aborts the EXEC, so the
        marker is written exactly when the value is. Two small commands more per object; no Lua.

        Following an ASK (`ask`): ASKING before each SET and no transaction, which a node importing the
        slot answers with TRYAGAIN while it holds neither key; a marker left without its value there is
        removed by the next load of the key (ReaderMixin._repair)."""
        tail, set_ = self._set_tail, self._set_head
        header = item.framed_header()
        first, between, last = (_ASKING, _ASKING, b"") if ask else (_MULTI, b"", _EXEC)
        return [
            first
            + set_
            + bulk(prefix + "d:" + item.key)
            + b"$%d\r\n" % (len(header) + item.payload.size)
            + header,
            memoryview(item.payload),
            b"\r\n" + tail + between + set_ + bulk(prefix + "m:" + item.key) + b"$1\r\n1\r\n" + tail + last,
        ]

    def _asked_stored(self, wire: Wire) -> Any:
        """The replies of _store_parts(ask=True), judged as _stored judges MULTI/SET/SET/EXEC's."""
        _asked(wire)
        value = wire.reply(max_bulk=0, max_items=0, depth=1)
        _asked(wire)
        marker = wire.reply(max_bulk=0, max_items=0, depth=1)
        errors = [r for r in (value, marker) if isinstance(r, ReplyError)]
        if errors:
            return self._reply_error(errors[0])
        if value in (b"OK", None) and marker in (b"OK", None):
            return True if value == b"OK" else "dup"
        self._count(unexpected_replies=1)
        return None

    def _write_slow(self, items: list[_Item], res: list[Any], deadline: float) -> None:
        """Objects that met MOVED/ASK: written again on the node the redirect names (`_follow`); one
        redirected again is dropped."""
        idx = [j for j, r in enumerate(res) if isinstance(r, ReplyError)]
        prefixes = self._prefixes([items[j].key for j in idx])
        redirected = [(Group(p, [j]), res[j]) for j, p in zip(idx, prefixes, strict=True) if p is not None]
        self._follow(redirected, lambda n, gs, ask: self._store_job(n, gs, items, res, ask), deadline)
        for j in idx:
            if isinstance(res[j], ReplyError):
                res[j] = None

    def _finish_put(self, items: list[_Item], res: list[Any]) -> list[bool]:
        stored = [it for it, r in zip(items, res, strict=True) if r is True]
        dups = sum(1 for r in res if r == "dup")
        unanswered = sum(1 for r in res if r is None)
        self._count(
            puts=len(stored),
            put_duplicates=dups,
            puts_dropped=len(items) - len(stored) - dups,
            puts_dropped_unavailable=unanswered,
            bytes_written=sum(it.payload.size for it in stored),
        )
        if stored:
            self._quarantine.discard([it.key for it in stored])
        return [r is True or r == "dup" for r in res]
