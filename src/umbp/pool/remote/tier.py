"""RedisTier: the shared tier on Redis >= 7 / Valkey, one server or a Redis Cluster. Layer 2.

    from umbp.pool.remote.tier import RedisTier, RemoteConfig
    tier = RedisTier(RemoteConfig.from_options({"url": "redis://127.0.0.1:6379/0", "ttl_s": 3600}))
    tier.exists(keys)                 # one pipelined round trip per server, however many keys
    tier.put(keys, buffers)           # or put_async: copies, returns at once, a background writer sends
    tier.get_into(keys, buffers)      # header + checksum (+ tag) verified, bytes land in the caller's buffers

Failure semantics (why this shape): the tier is a cache. A server that is down, slow or restarting must
cost the engine a recompute, never a stall, an exception or a wrong byte. So every network failure turns
into misses (lookups, loads) or dropped saves, all counted; the server is then left alone for
`retry_interval_s` (calls answer at once), and the next call after that reconnects. A key whose load
failed is quarantined for `quarantine_s`: `exists` says False, so a rescheduled request does not retry the
same failing load every step. Bad *input* (wrong buffer type, unknown option) still raises, as in DramPool.
A broken or hostile server gets the same treatment: replies are bounded by what was asked, every call has
one deadline, and nothing a server sends makes a call raise. With a tenant secret (`auth_key_env`) every
value carries a tag keyed by it (umbp.pool.remote.auth), so no one without the secret can plant a value
that loads; without one the tier warns at start-up that it is unauthenticated.

The hot paths use redis-py's connections with a minimal RESP codec (`umbp.pool.remote.resp`); connecting, auth,
TLS, pooling, and the cluster's slot table and MOVED/ASK handling are redis-py's. See docs/remote.md.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import redis

from umbp.pool import psum
from umbp.pool.base import Pool
from umbp.pool.buffers import aligned_buffer, prepare_buffers
from umbp.pool.dram.allocator import PageAllocator
from umbp.pool.errors import BufferSizeError
from umbp.pool.keycheck import check_keys
from umbp.pool.psum import checksum_u8, copy_with_checksum
from umbp.pool.remote.auth import PlainCodec, SealedCodec, codec_for, old_codecs
from umbp.pool.remote.backend import Cluster, Group, Standalone
from umbp.pool.remote.config import RemoteConfig, redact_url
from umbp.pool.remote.conns import KeptConnections, discard
from umbp.pool.remote.resp import (
    ProtocolError,
    ReplyError,
    Wire,
    bulk,
    command,
    multi_key_command,
    parse_length,
)

__all__ = ["RedisTier", "RemoteConfig"]

log = logging.getLogger("umbp.remote")

_NET_ERRORS = (OSError, redis.RedisError, ValueError)  # ValueError: a reply that does not parse
# What redis-py's own reply parser (connection set-up, the slow paths) can raise on a hostile reply: it is
# not bounded like umbp.pool.remote.resp (deeply nested arrays recurse, huge counts allocate), and a cache call
# must still not raise on what a server sends.
_REDIS_PY_FAULTS = (*_NET_ERRORS, redis.exceptions.RedisClusterException, RecursionError, MemoryError, OverflowError)
_PAGE = 4096  # put_async arena page: copies start page-aligned, so they are summed and sent whole
_REDIRECT = "redirect"  # a result slot whose key must go through redis-py's cluster client
_HIT, _ABSENT, _UNANSWERED, _MOVED = 1, 0, -1, -2  # exists() result codes
GET_WINDOW_BYTES = 4 << 20
PUT_SEND_BYTES = 256 << 10  # a put sends whenever this much payload is ready (see _store_job)
_MULTI, _EXEC = b"*1\r\n$5\r\nMULTI\r\n", b"*1\r\n$4\r\nEXEC\r\n"
_STORED = b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n+OK\r\n+OK\r\n"  # MULTI, SET value, SET marker, EXEC
_REMOVABLE = ("checksum_failures", "auth_failures", "unauthenticated_values")  # deleted after a failed load
_STORED_RUN = 4096  # saves whose all-OK replies are matched at once (160 KiB of replies)
_VALUE_SLACK = 4096  # a stored value may be this much longer than expected (a later format's header)
_HEAL = ("if redis.call('EXISTS', KEYS[1]) == 0 then return redis.call('DEL', KEYS[2]) end return 0")
_DROP = "return redis.call('UNLINK', KEYS[1], KEYS[2])"  # a script: cluster pipelines refuse multi-key UNLINK

_COUNTERS = (
    "exists_keys", "exists_present", "lookup_errors", "quarantine_skips", "unavailable_skips",
    "hits", "misses", "misses_absent", "load_errors", "checksum_failures", "header_failures",
    "size_mismatches", "version_mismatches", "key_mismatches", "bytes_read",
    "puts", "put_duplicates", "puts_dropped", "puts_dropped_queue_full", "puts_dropped_unavailable",
    "puts_dropped_checksum", "bytes_written", "async_accepted", "auth_failures", "unauthenticated_values", "unsupported_values",
    "old_key_hits", "write_queue_hits",
    "connection_errors", "timeouts", "protocol_errors", "unexpected_replies", "reply_errors", "pool_exhausted", "redirects", "quarantined", "stale_markers_removed",
    "corrupt_removed",
)


def _now() -> float:
    """The clock of the retry interval and the quarantine: time.monotonic, looked up at each call so a
    test can move it instead of sleeping past an interval (a sleep's outcome depends on the machine's load)."""
    return time.monotonic()


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


@dataclass
class _Job:
    """One server's share of a batch: `send` writes all its commands, `read` consumes all its replies."""

    node: str
    send: Callable[[Wire], None]
    read: Callable[[Wire], None]
    n: int  # keys it covers (for the unavailable_skips counter)
    nbytes: int = 0  # payload bytes it moves: the call's deadline grows with them (RemoteConfig.deadline_s)


class _Session:
    """A checked-out connection; kept for the next call only when its replies were fully read."""

    def __init__(self, kept: KeptConnections, pool: redis.ConnectionPool) -> None:
        self.kept, self.pool = kept, pool
        self.conn = kept.take(pool)
        try:
            self.wire = Wire.of(self.conn)
        except BaseException:
            self.fail()
            raise

    def close(self) -> None:
        if self.wire.drained:
            self.kept.give(self.pool, self.conn)
            return
        self.fail()

    def fail(self) -> None:
        discard(self.pool, self.conn)


class _Quarantine:
    """key -> time until which `exists` reports it absent; bounded, oldest dropped first."""

    def __init__(self, seconds: float, max_keys: int) -> None:
        self.seconds, self.max_keys = seconds, max_keys
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._until)

    def add(self, keys: Sequence[str]) -> int:
        if self.seconds <= 0 or not keys:
            return 0
        until = _now() + self.seconds
        with self._lock:
            for k in keys:
                self._until.pop(k, None)
                self._until[k] = until
            while len(self._until) > self.max_keys:
                del self._until[next(iter(self._until))]
        return len(keys)

    def discard(self, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                self._until.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self._until.clear()

    def held(self, keys: Sequence[str]) -> list[int]:
        """Indices of keys still quarantined (expired entries are dropped on the way)."""
        now = _now()
        out: list[int] = []
        with self._lock:
            until = self._until
            for i, k in enumerate(keys):
                t = until.get(k)
                if t is not None:
                    if t > now:
                        out.append(i)
                    else:
                        del until[k]
        return out


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


class _GetWindow:
    """Keeps about GET_WINDOW_BYTES of values in flight per connection. A deeper pipeline makes the
    server buffer every pending reply (tens of MiB for a batch of 4 MiB pages) and is measurably slower
    (0.5 vs 0.9 GB/s at 4 MiB); one GET at a time would pay a round trip per value. It refills only once
    less than half of the window is left (`due`), so a long batch of small values costs one send per
    half window rather than one per value, and the reader checks a single int per value."""

    def __init__(self, commands: list[bytes], sizes: list[int]) -> None:
        self.commands = commands
        self.ends = list(accumulate(sizes))  # ends[k]: bytes of replies 0..k
        self.sent = 0
        self.due = 0  # the next reply before which top_up must run (len(commands): never)

    def top_up(self, wire: Wire, done: int) -> None:
        """Called before reading reply `done`: send until the window is full (at least one command in
        flight), then set `due` to the reply at which less than half of it will be left."""
        ends, n, start = self.ends, len(self.commands), self.sent
        read = ends[done - 1] if done else 0
        sent = start
        while sent < n and (sent == done or ends[sent - 1] - read < GET_WINDOW_BYTES):
            sent += 1
        if sent > start:
            wire.send(self.commands[start:sent])
        self.sent = sent
        self.due = n if sent == n else bisect_right(ends, ends[sent - 1] - GET_WINDOW_BYTES // 2) + 1


class RedisTier(Pool):
    """The shared tier. Thread-safe; one instance per process (scheduler or worker)."""

    def __init__(self, config: RemoteConfig | None = None) -> None:
        self.config = cfg = (config or RemoteConfig()).validate()
        self._backend: Standalone | Cluster = Cluster(cfg) if cfg.cluster else Standalone(cfg)
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._lock = threading.Lock()
        self._down_until: dict[str, float] = {}
        self._last_error = ""
        self._quarantine = _Quarantine(cfg.quarantine_s, cfg.quarantine_max_keys)
        self._conns = KeptConnections(cfg.max_connections)
        self._writer = _Writer(self, cfg.write_queue_bytes, cfg.write_batch)
        self._ttl_ms = None if cfg.ttl_s is None else max(1, round(cfg.ttl_s * 1000))
        # 'SET k v NX [PX ms]': the array header, and the arguments after the value (command() minus its header)
        ttl = () if self._ttl_ms is None else ("PX", self._ttl_ms)
        self._set_head = b"*%d\r\n$3\r\nSET\r\n" % (4 + len(ttl))
        self._set_tail = command("NX", *ttl)[4:]
        self._codec = codec_for(cfg)
        self._old = old_codecs(cfg)  # key rotation: (namespace, codec) of previous secrets, read-only
        self._closed = False
        if not self._codec.sealed:
            log.warning("umbp: the shared tier at %s is unauthenticated: anyone who can write to it can plant "
                        "values this process loads, and read its KV bytes; set auth_key_env or auth_key_file "
                        "(docs/remote.md)", ", ".join(redact_url(u) for u in cfg.urls))

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> RedisTier:
        """Build from a config mapping (see RemoteConfig.from_options)."""
        return cls(RemoteConfig.from_options(options))

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counters[name] += d

    def _node_failed(self, node: str, exc: BaseException) -> None:
        """Leave the server alone for retry_interval_s; drop its idle connections (stale after a restart)."""
        timeout = isinstance(exc, TimeoutError | redis.TimeoutError)
        kind = "timeouts" if timeout else "protocol_errors" if isinstance(exc, ProtocolError) else "connection_errors"
        msg = redact_url(f"{node}: {type(exc).__name__}: {exc}")
        with self._lock:
            self._counters[kind] += 1
            self._last_error = msg
            self._down_until[node] = _now() + self.config.retry_interval_s
        log.warning("umbp: remote tier %s; treating it as down for %.1fs", msg, self.config.retry_interval_s)
        if node == self._backend.name and isinstance(self._backend, Cluster):
            return  # the cluster as a whole is unreachable: nothing to disconnect or refresh
        try:
            pool = self._backend.pool(node)
            self._conns.drop(pool)
            pool.disconnect(inuse_connections=False)
        except _NET_ERRORS:
            pass
        self._refresh()

    def _refresh(self) -> None:
        """Re-read a cluster's topology; kept connections of nodes that left it are dropped."""
        self._backend.refresh()
        self._conns.keep_only(self._backend.pools())

    def _is_down(self, node: str) -> bool:
        until = self._down_until.get(node)
        return until is not None and until > _now()

    def _groups(self, keys: list[str]) -> dict[str, list[Group]] | None:
        """Keys per server, or None when the whole backend is unreachable (cluster not yet connected)."""
        if self._is_down(self._backend.name):
            self._count(unavailable_skips=len(keys))
            return None
        try:
            return self._backend.groups(keys)
        except _NET_ERRORS as exc:
            self._node_failed(self._backend.name, exc)
            return None

    def _run(self, jobs: list[_Job]) -> None:
        """Send every server's commands first, then read every server's replies: servers work in parallel
        and each costs one round trip. A server that fails leaves its results unset (None)."""
        open_: list[tuple[_Job, _Session]] = []
        began = time.monotonic()
        for job in jobs:
            if self._is_down(job.node):
                self._count(unavailable_skips=job.n)
                continue
            try:
                sess = _Session(self._conns, self._backend.pool(job.node))
            except redis.exceptions.MaxConnectionsError:  # our own pool is busy, the server is fine
                self._count(pool_exhausted=job.n)
                continue
            except _REDIS_PY_FAULTS as exc:  # connecting: redis-py's set-up commands and their replies
                self._node_failed(job.node, exc)
                continue
            sess.wire.deadline = began + self.config.deadline_s(job.nbytes)
            try:
                job.send(sess.wire)
                open_.append((job, sess))
            except _NET_ERRORS as exc:
                sess.fail()
                self._node_failed(job.node, exc)
            except BaseException:  # e.g. interrupted while summing a put's payload: half a command was sent
                for _, s in [*open_, (job, sess)]:
                    s.fail()
                raise
        for k, (job, sess) in enumerate(open_):
            try:
                job.read(sess.wire)
                sess.close()
            except _NET_ERRORS as exc:
                sess.fail()
                self._node_failed(job.node, exc)
            except BaseException:  # e.g. Ctrl-C mid-read: replies are left unread on this and later ones
                for _, s in open_[k:]:
                    s.fail()
                raise

    def _reply_error(self, err: ReplyError) -> str | None:
        """_REDIRECT for MOVED/ASK (redis-py's cluster client will follow it), else None (a counted miss)."""
        if err.redirect and isinstance(self._backend, Cluster):
            self._count(redirects=1)
            return _REDIRECT
        with self._lock:
            self._counters["reply_errors"] += 1
            self._last_error = err.message[:200]
        return None

    # ---- exists --------------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """One MGET over marker keys per server (per hash tag in a cluster), all pipelined. Results are
        kept as int8 codes (_HIT/_ABSENT/_UNANSWERED/_MOVED) so 8,192 keys need no Python step per key."""
        keys = list(keys)
        check_keys("exists", keys)
        res = np.full(len(keys), _UNANSWERED, np.int8)
        queued = self._writer.holding(keys)  # before the server: see _Writer.holding
        groups = self._groups(keys) if keys else {}
        if groups is None:
            groups = {}
        self._run([self._exists_job(node, gs, keys, res) for node, gs in groups.items()])
        if (res == _MOVED).any():
            self._exists_slow(keys, res)
        if self._old and (res == _ABSENT).any():
            self._exists_old(keys, res)
        res[queued] = _HIT  # saved by put_async and not yet written: present (its load is served locally)
        return self._finish_exists(keys, res)

    def _exists_job(self, node: str, groups: list[Group], keys: list[str], res: np.ndarray) -> _Job:
        def send(wire: Wire) -> None:  # chunk by chunk: the server parses one while we pack the next
            for g in groups:
                wire.send(multi_key_command(b"MGET", g.prefix + "m:", g.keys(keys)))

        def read(wire: Wire) -> None:
            for g in groups:
                flags = wire.markers(len(g.indices))
                idx = slice(g.indices.start, g.indices.stop) if isinstance(g.indices, range) else g.indices
                if isinstance(flags, ReplyError):
                    res[idx] = _MOVED if self._reply_error(flags) is _REDIRECT else _UNANSWERED
                else:
                    res[idx] = flags

        return _Job(node, send, read, sum(len(g.indices) for g in groups))

    def _exists_slow(self, keys: list[str], res: np.ndarray) -> None:
        idx = np.flatnonzero(res == _MOVED).tolist()
        groups = self._groups([keys[i] for i in idx]) or {}
        names = [g.prefix + "m:" + keys[idx[j]] for gs in groups.values() for g in gs for j in g.indices]
        order = [idx[j] for gs in groups.values() for g in gs for j in g.indices]
        try:
            values = self._backend.client().mget_nonatomic(names)
        except _REDIS_PY_FAULTS as exc:
            self._count(reply_errors=1)
            self._last_error = f"{type(exc).__name__}: {exc}"[:200]
            values, order = [], []  # unanswered: counted as lookup errors
        res[idx] = _UNANSWERED
        for i, v in zip(order, values, strict=True):
            res[i] = v == b"1"
        self._refresh()

    def _finish_exists(self, keys: list[str], res: np.ndarray) -> list[bool]:
        errors = int((res < 0).sum())
        hit = res == _HIT
        skips = 0
        if len(self._quarantine):
            held = self._quarantine.held(keys)
            skips = int(hit[held].sum())
            hit[held] = False
        self._count(exists_keys=len(keys), exists_present=int(hit.sum()), lookup_errors=errors,
                    quarantine_skips=skips)
        return hit.tolist()

    # ---- get_into ------------------------------------------------------------------------------------

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Values stream straight into the caller's buffers; header, key and checksum are verified. Every
        miss is quarantined (see the module docstring)."""
        keys = list(keys)
        check_keys("get_into", keys)
        dsts = prepare_buffers("get_into", keys, buffers, writable=True)
        res: list[Any] = [None] * len(keys)
        held = set(self._quarantine.held(keys)) if len(self._quarantine) else set()
        live = [i for i in range(len(keys)) if i not in held]
        for i in held:
            res[i] = "quarantine_skips"
        live = self._from_queue(keys, dsts, live, res)
        groups = self._groups([keys[i] for i in live]) if live else {}
        jobs = [self._get_job(node, gs, keys, dsts, live, res) for node, gs in (groups or {}).items()]
        self._run(jobs)
        if _REDIRECT in res:
            self._get_slow(keys, dsts, res)
        if self._old and "misses_absent" in res:
            self._get_old(keys, dsts, res)
        return self._finish_get(keys, dsts, res)

    def _from_queue(self, keys: list[str], dsts: list[np.ndarray], live: list[int], res: list[Any]) -> list[int]:
        """Serve keys whose put_async copy is still queued (or being sent) from that copy, verified like a
        value read from the server; the rest of `live` is returned. Without this, an object demoted from
        DRAM is in neither place until the writer has sent it, and a lookup in between misses it."""
        held = set(self._writer.holding([keys[i] for i in live]))
        if not held:
            return live
        rest: list[int] = []
        for j, i in enumerate(live):
            header = self._writer.copy_out(keys[i], dsts[i]) if j in held else None
            # the server decides when there is no copy of this size (sent and given back since holding():
            # the server has it), or the copy does not verify (never a reason to delete the server's value)
            if header is not None and _verified(self._codec, header, keys[i], dsts[i], checksum_u8(dsts[i])) is True:
                res[i] = True
                self._count(write_queue_hits=1)
            else:
                rest.append(i)
        return rest

    def _get_job(self, node: str, groups: list[Group], keys: list[str], dsts: list[np.ndarray],
                 live: list[int], res: list[Any]) -> _Job:
        order = [live[j] for g in groups for j in g.indices]
        window = _GetWindow([b"*2\r\n$3\r\nGET\r\n" + bulk(g.prefix + "d:" + keys[live[j]])
                             for g in groups for j in g.indices], [dsts[i].size for i in order])

        sizes = {dsts[i].size for i in order}
        size = sizes.pop() if len(sizes) == 1 else 0

        def read(wire: Wire) -> None:
            if 0 < size <= psum.CHUNK_BYTES and size % psum.ROW_BYTES == 0:
                self._read_same_size(wire, window, [keys[i] for i in order], [dsts[i] for i in order], order, res)
                return
            for r, i in enumerate(order):
                if r >= window.due:
                    window.top_up(wire, r)
                res[i] = self._read_value(wire, keys[i], dsts[i])

        return _Job(node, lambda wire: window.top_up(wire, 0), read, len(order), sum(dsts[i].size for i in order))

    def _read_same_size(self, wire: Wire, window: _GetWindow, keys: list[str], dsts: list[np.ndarray],
                        order: list[int], res: list[Any]) -> None:
        """The common batch: values of one size in whole 4 KiB rows, each small enough to stay in cache
        (one model's pages). Up to each window refill, one Wire.framed_payloads call reads the replies
        (reply head and the header's fixed fields matched in the buffer, payload, row sums while it is in
        cache; in C when built); checksums are combined and compared for the whole batch at the end. What can be prepared per value is prepared first,
        while the server is still working on the first reply. Anything unexpected takes the
        reply-by-reply path (_read_other), which names the problem."""
        size, n, codec = dsts[0].size, len(keys), self._codec
        lead = b"$%d\r\n" % (codec.header_size + size) + codec.lead(size)
        tails = [codec.tail(k) for k in keys]
        rows = np.zeros((n, size // psum.ROW_BYTES), np.uint64)
        field = codec.field_size
        fields = bytearray(n * field)
        framed = np.zeros(n, bool)
        r = 0
        while r < n:
            if r >= window.due:
                window.top_up(wire, r)
            end = min(n, window.due)
            # a reply already seen not to be the framed value (a miss) skips the batched read, which
            # prepares the rest of the window's buffers each time it is called
            stop = r if wire.differs_from(lead) else wire.framed_payloads(lead, field, tails, dsts,
                                                                           rows, fields, r, end)
            framed[r:stop] = True
            if stop < end:  # not the expected frame: read it reply by reply
                res[order[stop]] = self._read_other(wire, keys[stop], dsts[stop])
                stop += 1
            r = stop
        stored = np.frombuffer(fields, np.uint8).reshape(n, field)[:, :8].copy().view("<u8").ravel()
        good = psum.combine_rows(rows, size) == stored
        fixed = lead[lead.index(b"\r\n") + 2 :]
        for r in np.flatnonzero(framed).tolist():
            if not good[r]:
                res[order[r]] = "checksum_failures"
            elif codec.sealed:  # the tag: a psum64 anyone can compute, a tag only the tenant's key can
                header = fixed + bytes(fields[r * field : (r + 1) * field]) + tails[r]
                res[order[r]] = codec.open(header, keys[r], dsts[r]) or True
            else:
                res[order[r]] = True

    def _read_value(self, wire: Wire, key: str, dst: np.ndarray) -> Any:
        """One GET reply into dst: True, or the counter that explains the miss. The reply of a stored
        object of the expected size is matched whole; anything else goes through _read_other."""
        hsize = self._codec.header_size
        header = wire.value_head(b"$%d\r\n" % (hsize + dst.size), hsize)
        if header is None:
            return self._read_other(wire, key, dst)
        return _take_payload(self._codec, wire, header, key, dst)

    def _read_other(self, wire: Wire, key: str, dst: np.ndarray) -> Any:
        """A reply that is not the expected value: an error, nil, another length, or a header that
        differs from what value_head matched (then it is read again here, to name the problem)."""
        head = wire.line()
        if head[:1] == b"-":
            return self._reply_error(ReplyError(head[1:].decode(errors="replace"))) or "load_errors"
        if head[:1] != b"$":
            raise ProtocolError(f"umbp: GET replied {head[:40]!r}")
        # never more than the object plus a header can legitimately be: a larger claim is a broken or
        # hostile server, and the connection is dropped rather than read (or allocated) on trust
        hsize = self._codec.header_size
        n = parse_length(head[1:], hsize + dst.size + _VALUE_SLACK)
        if n < 0:
            return "misses_absent"
        if n != hsize + dst.size:
            wire.discard(n)
            wire.expect_crlf()
            return "size_mismatches"
        return _take_payload(self._codec, wire, wire.take(hsize), key, dst)

    def _get_slow(self, keys: list[str], dsts: list[np.ndarray], res: list[Any]) -> None:
        """Keys that met MOVED/ASK: fetched through redis-py's cluster client, which follows redirects."""
        rc = self._backend.client()
        for i, r in enumerate(res):
            if r is not _REDIRECT:
                continue
            prefix = self._prefix_of(keys[i])
            try:
                value = rc.get(prefix + "d:" + keys[i])
            except _REDIS_PY_FAULTS as exc:
                self._last_error = f"{type(exc).__name__}: {exc}"[:200]
                res[i] = "load_errors"
                continue
            res[i] = _check_value(self._codec, keys[i], value, dsts[i])
        self._refresh()

    # ---- key rotation: reads under previous secrets -------------------------------------------------

    def _old_names(self, keys: list[str], kind: str) -> list[list[str]]:
        """For each previous secret, the Redis names ('d:' value or 'm:' marker) of keys in its namespace
        (the current group prefix with the current namespace swapped for the old one)."""
        cur, base = self.config.redis_prefix, self.config.key_prefix
        prefixes = [""] * len(keys)
        for gs in (self._backend.groups(keys) or {}).values():
            for g in gs:
                for j in g.indices:
                    prefixes[j] = g.prefix[len(cur):]
        return [[f"{base}{ns}:{p}{kind}:{k}" for p, k in zip(prefixes, keys, strict=True)] for ns, _ in self._old]

    def _exists_old(self, keys: list[str], res: np.ndarray) -> None:
        """Keys absent in the current namespace but stored under a previous secret (during a rotation)
        are present: their loads verify with that secret. One pipelined round per previous secret."""
        idx = np.flatnonzero(res == _ABSENT).tolist()
        try:
            for names in self._old_names([keys[i] for i in idx], "m"):
                pipe = self._backend.client().pipeline(transaction=False)
                for name in names:
                    pipe.exists(name)
                for i, found in zip(idx, pipe.execute(), strict=True):
                    if found:
                        res[i] = _HIT
        except _REDIS_PY_FAULTS as exc:
            self._last_error = f"exists (old keys): {type(exc).__name__}: {exc}"[:200]

    def _get_old(self, keys: list[str], dsts: list[np.ndarray], res: list[Any]) -> None:
        """Loads that found nothing under the current secret, tried under each previous one (verified
        with that secret's keys). Rotation-only, so through redis-py: one pipelined round per secret."""
        idx = [i for i, r in enumerate(res) if r == "misses_absent"]
        try:
            for (_, codec), names in zip(self._old, self._old_names([keys[i] for i in idx], "d"), strict=True):
                pipe = self._backend.client().pipeline(transaction=False)
                for name in names:
                    pipe.get(name)
                for i, value in zip(idx, pipe.execute(), strict=True):
                    if value is not None and res[i] == "misses_absent":
                        res[i] = _check_value(codec, keys[i], value, dsts[i])
                        self._count(old_key_hits=int(res[i] is True))
        except _REDIS_PY_FAULTS as exc:
            self._last_error = f"get (old keys): {type(exc).__name__}: {exc}"[:200]

    def _prefix_of(self, key: str) -> str:
        groups = self._backend.groups([key])
        return next(iter(groups.values()))[0].prefix

    def _finish_get(self, keys: list[str], dsts: list[np.ndarray], res: list[Any]) -> list[bool]:
        if res.count(True) == len(res):  # every key a hit (the usual batch): one counter update
            self._count(hits=len(res), bytes_read=sum(d.size for d in dsts))
            return [True] * len(res)
        tally: dict[str, int] = {}
        out: list[bool] = []
        failed: list[str] = []
        for key, dst, r in zip(keys, dsts, res, strict=True):
            if r is True:
                out.append(True)
                tally["bytes_read"] = tally.get("bytes_read", 0) + dst.size
                continue
            out.append(False)
            reason = "load_errors" if r is None or r is _REDIRECT else r
            tally[reason] = tally.get(reason, 0) + 1
            if reason != "quarantine_skips":
                failed.append(key)
        hits = sum(out)
        tally["quarantined"] = self._quarantine.add(failed)
        self._count(hits=hits, misses=len(out) - hits, **tally)
        self._repair(keys, res)
        return out

    def _repair(self, keys: list[str], res: list[Any]) -> None:
        """Best effort: delete values that failed their checksum, and markers whose value is gone (evicted
        or expired apart), so no other instance keeps trying them. One pipelined round trip for the
        batch: a command per key, each awaited, made a get of 1,024 absent 16 KiB keys take 132-146 ms
        on loopback against 8-15 ms for 1,024 hits (16-20 ms with the pipeline)."""
        # a value failing its tag is deleted like a damaged one: saves are SET NX, so a planted value left
        # in place would turn every later save of the key into a no-op and every load into a miss
        corrupt = [k for k, r in zip(keys, res, strict=True) if r in _REMOVABLE]
        absent = [k for k, r in zip(keys, res, strict=True) if r == "misses_absent"]
        if not corrupt and not absent:
            return
        affected = corrupt + absent
        try:
            prefixes = [""] * len(affected)
            for groups in self._backend.groups(affected).values():
                for g in groups:
                    for i in g.indices:
                        prefixes[i] = g.prefix
            pipe = self._backend.client().pipeline(transaction=False)  # EVAL via execute_command: a
            # cluster pipeline's eval() is blocked, its execute_command routes EVAL by its keys' slot
            for i, (k, p) in enumerate(zip(affected, prefixes, strict=True)):
                pipe.execute_command("EVAL", _DROP if i < len(corrupt) else _HEAL, 2, p + "d:" + k, p + "m:" + k)
            replies = pipe.execute(raise_on_error=False)
        except _REDIS_PY_FAULTS as exc:  # best effort: never fails a get
            self._last_error = f"repair: {type(exc).__name__}: {exc}"[:200]
            return
        done = [not isinstance(r, Exception) and int(r or 0) > 0 for r in replies]
        self._count(corrupt_removed=sum(done[:len(corrupt)]), stale_markers_removed=sum(done[len(corrupt):]))

    # ---- put -----------------------------------------------------------------------------------------

    def put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Synchronous: True once stored (or already present); False when the save was dropped (server
        unavailable: counted). The payload is sent from the caller's buffer without a copy."""
        keys = list(keys)
        check_keys("put", keys)
        srcs = prepare_buffers("put", keys, buffers, writable=False)
        items = [_Item(k, s, codec=self._codec) for k, s in zip(keys, srcs, strict=True)]
        return self._write(items)

    def put_async(self, keys: Sequence[str], buffers: Sequence[Any],
                  checksums: Sequence[int] | None = None) -> list[bool]:
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
        groups = (self._groups(keys) if items else {}) or {}
        self._run([self._store_job(node, gs, items, res) for node, gs in groups.items()])
        if _REDIRECT in res:
            self._write_slow(items, res)
        return self._finish_put(items, res)

    def _store_job(self, node: str, groups: list[Group], items: list[_Item], res: list[Any]) -> _Job:
        order = [(g.prefix, j) for g in groups for j in g.indices]

        def send(wire: Wire) -> None:
            """The first object goes out alone, the rest whenever PUT_SEND_BYTES of payload are ready: the
            server starts storing while the client still sums the rest, at one sendmsg per object only
            for objects of PUT_SEND_BYTES and more."""
            parts: list[bytes | memoryview] = []
            ready = 0
            for r, (prefix, j) in enumerate(order):
                parts.extend(self._store_parts(prefix, items[j]))
                ready += items[j].payload.size
                if r == 0 or ready >= PUT_SEND_BYTES:
                    wire.send(parts)
                    parts, ready = [], 0
            if parts:
                wire.send(parts)

        def read(wire: Wire) -> None:
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
        """True (written), 'dup' (the value was there already), _REDIRECT, or None (dropped: an error
        reply, counted in reply_errors, or a reply that is not what MULTI/SET/SET/EXEC answer, counted
        in unexpected_replies: only a server that said OK to the value counts it as stored)."""
        multi, queued_value, queued_marker, done = replies
        errors = [r for r in replies if isinstance(r, ReplyError)]
        if errors:
            redirect = next((r for r in errors if r.redirect), None)
            return self._reply_error(redirect or errors[0])
        if not (multi == b"OK" and queued_value == queued_marker == b"QUEUED" and isinstance(done, list)
                and len(done) == 2 and done[1] in (b"OK", None)):
            self._count(unexpected_replies=1)
            return None
        if done[0] == b"OK":
            return True
        if done[0] is None:
            return "dup"
        self._count(unexpected_replies=1)
        return None

    def _store_parts(self, prefix: str, item: _Item) -> list[bytes | memoryview]:
        """MULTI, SET value NX [PX], SET marker NX [PX], EXEC. In a transaction because ordering alone
        is not enough: with maxmemory + noeviction Redis refuses the value's SET (OOM: its bytes are in
        the query buffer) yet accepts the 1-byte marker's once they are freed, leaving a marker that
        promises a value that was never stored. A refused command inside MULTI aborts the EXEC, so the
        marker is written exactly when the value is. Two small commands more per object; no Lua."""
        tail, set_ = self._set_tail, self._set_head
        header = item.framed_header()
        return [
            _MULTI + set_ + bulk(prefix + "d:" + item.key) + b"$%d\r\n" % (len(header) + item.payload.size) + header,
            memoryview(item.payload),
            b"\r\n" + tail + set_ + bulk(prefix + "m:" + item.key) + b"$1\r\n1\r\n" + tail + _EXEC,
        ]

    def _write_slow(self, items: list[_Item], res: list[Any]) -> None:
        """Objects that met MOVED/ASK: written through redis-py's cluster client (value, then marker)."""
        rc = self._backend.client()
        px = self._ttl_ms
        for j, r in enumerate(res):
            if r is not _REDIRECT:
                continue
            it = items[j]
            p = self._prefix_of(it.key)
            try:
                header = it.framed_header()
                fresh = rc.set(p + "d:" + it.key, header + it.payload.tobytes(), nx=True, px=px)
                rc.set(p + "m:" + it.key, b"1", nx=True, px=px)  # only after the value's SET succeeded
                res[j] = True if fresh else "dup"
            except _REDIS_PY_FAULTS as exc:
                self._last_error = f"{type(exc).__name__}: {exc}"[:200]
                res[j] = None
        self._refresh()

    def _finish_put(self, items: list[_Item], res: list[Any]) -> list[bool]:
        stored = [it for it, r in zip(items, res, strict=True) if r is True]
        dups = sum(1 for r in res if r == "dup")
        unanswered = sum(1 for r in res if r is None)
        self._count(puts=len(stored), put_duplicates=dups, puts_dropped=len(items) - len(stored) - dups,
                    puts_dropped_unavailable=unanswered, bytes_written=sum(it.payload.size for it in stored))
        if stored:
            self._quarantine.discard([it.key for it in stored])
        return [r is True or r == "dup" for r in res]

    # ---- remove / clear ------------------------------------------------------------------------------

    def remove(self, keys: Sequence[str]) -> int:
        """UNLINK value and marker of each key; returns how many keys had either. Errors count as absent."""
        keys = list(keys)
        check_keys("remove", keys)
        self._quarantine.discard(keys)
        groups = self._groups(keys) or {}
        removed = 0
        try:
            client = self._backend.client()
            for gs in groups.values():
                for g in gs:
                    for k in g.keys(keys):
                        removed += int(client.unlink(g.prefix + "d:" + k, g.prefix + "m:" + k) > 0)
        except _NET_ERRORS as exc:
            self._last_error = f"remove: {type(exc).__name__}: {exc}"[:200]
            self._count(reply_errors=1)
        return removed

    def clear(self, startswith: str = "") -> None:
        """Drop this tier's objects: the Redis keys under `key_prefix` only (never FLUSHDB; other data on
        the server is untouched). With `startswith`, only objects whose umbp key starts with it, e.g.
        "umbp:v1:<namespace>:" for one model. Best effort: an unreachable server keeps its keys."""
        self._quarantine.clear()
        pattern = self._clear_pattern(startswith)
        try:
            for client in self._backend.primaries():
                _unlink_matching(client, pattern)
        except _NET_ERRORS as exc:
            self._last_error = f"clear: {type(exc).__name__}: {exc}"[:200]
            self._count(reply_errors=1)

    def _clear_pattern(self, startswith: str) -> str:
        esc = _glob_escape
        tag = "{*}" if isinstance(self._backend, Cluster) else ""
        if not startswith:
            return esc(self.config.redis_prefix) + "*"
        return f"{esc(self.config.redis_prefix)}{tag}[dm]:{esc(startswith)}*"

    def scan_objects(self, startswith: str = "", sizes: bool = True, limit: int | None = None,
                     batch: int = 1000) -> Iterator[tuple[str, int | None]]:
        """(umbp key, stored value bytes or None) of every visible object (marker key present) on every
        master, for operators (`umbp stats`); SCAN, so the server keeps serving. With sizes, one pipelined
        STRLEN per `batch` keys; a value of 0 bytes means its marker has no value (healed on next put).
        Stops after `limit` objects. Network errors raise: this is a tool, not the serving path."""
        marker = _glob_escape(self.config.redis_prefix) + ("{*}" if isinstance(self._backend, Cluster) else "")
        pattern = f"{marker}m:{_glob_escape(startswith)}*"
        seen = 0
        for client in self._backend.primaries():
            names: list[bytes] = []
            for name in client.scan_iter(match=pattern, count=batch):
                names.append(name)
                if len(names) == batch:
                    yield from self._sized(client, names, sizes)
                    seen += len(names)
                    names = []
                    if limit is not None and seen >= limit:
                        return
            yield from self._sized(client, names, sizes)
            seen += len(names)
            if limit is not None and seen >= limit:
                return

    def _sized(self, client: redis.Redis, names: list[bytes], sizes: bool) -> Iterator[tuple[str, int | None]]:
        split = [self._split_marker(n) for n in names]  # (everything before "m:", the umbp key)
        lengths: list[int | None] = [None] * len(names)
        if sizes and names:
            pipe = client.pipeline(transaction=False)
            for head, key in split:
                pipe.strlen(head + b"d:" + key)
            lengths = pipe.execute()
        for (_, key), n in zip(split, lengths, strict=True):
            yield key.decode(errors="replace"), n

    def _split_marker(self, name: bytes) -> tuple[bytes, bytes]:
        """`<prefix>[{tag}]m:<key>` -> (`<prefix>[{tag}]`, `<key>`)."""
        at = len(self.config.redis_prefix.encode())
        if name[at:at + 1] == b"{":
            at = name.index(b"}", at) + 1
        return name[:at], name[at + 2:]

    # ---- stats / lifecycle ---------------------------------------------------------------------------

    def quarantine(self, keys: Sequence[str]) -> None:
        """Report these keys absent for quarantine_s (e.g. the scheduler, told by a worker that a load
        failed, so its lookups stop offering the key)."""
        self._count(quarantined=self._quarantine.add(list(keys)))

    def ping(self) -> bool:
        """Whether every server answers now (ignores and resets the retry interval)."""
        try:
            ok = all(c.ping() for c in self._backend.primaries())
        except _NET_ERRORS:
            return False
        if ok:
            with self._lock:
                self._down_until.clear()
        return ok

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            now = _now()
            out["servers_down"] = sorted(n for n, t in self._down_until.items() if t > now)
            out["last_error"] = self._last_error
        loads = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / loads if loads else 0.0
        out["write_queue_items"], out["write_queue_bytes"] = self._writer.gauges()
        out["quarantine_size"] = len(self._quarantine)
        out["idle_connections"] = self._conns.idle_count()
        out["backend"] = "redis-cluster" if isinstance(self._backend, Cluster) else "redis"
        out["config"] = self.config.summary()
        out["config"]["values"] = self._codec.describe()
        return out

    def close(self, timeout: float | None = None) -> None:
        """Write what put_async queued (up to `timeout`, default 5 s), then drop the connections."""
        if self._closed:
            return
        self._closed = True
        self._writer.close(5.0 if timeout is None else timeout)
        self._conns.close()
        self._backend.close()


def _take_payload(codec: PlainCodec | SealedCodec, wire: Wire, header: bytes, key: str, dst: np.ndarray) -> Any:
    """The rest of a value whose length matched: payload into dst (checksummed on the way), the closing
    CRLF; True, or the counter naming what the header, checksum or tag says is wrong."""
    problem, stored = codec.inspect(header, key, dst.size)
    tag = codec.stream(header, key) if problem is None else None
    digest = _recv_with_checksum(wire, dst, None if tag is None else tag.update)
    wire.expect_crlf()
    if problem is None and digest != stored:
        problem = "checksum_failures"
    if problem is None:
        problem = codec.open(header, key, dst) if tag is None else tag.verdict()
    return problem or True


def _verified(codec: PlainCodec | SealedCodec, header: bytes, key: str, dst: np.ndarray, digest: int) -> Any:
    """True when header, psum64 and (sealed) tag fit; else the counter that names the miss."""
    problem, stored = codec.inspect(header, key, dst.size)
    if problem is None and digest != stored:
        problem = "checksum_failures"
    if problem is None:
        problem = codec.open(header, key, dst)
    return problem or True


def _recv_with_checksum(wire: Wire, dst: np.ndarray, on_chunk: Callable[[memoryview], Any] | None = None) -> int:
    """Receive into dst chunk by chunk and take each chunk's psum64 row values while it is still in cache (the
    same fused pass as psum.copy_with_checksum, with the socket as the source); equals checksum_u8(dst).
    `on_chunk` (a sealed value's tag) gets each chunk too, while it is in cache."""
    nbytes = dst.size
    if nbytes <= psum.CHUNK_BYTES:
        wire.read_into(memoryview(dst))
        if on_chunk is not None:
            on_chunk(memoryview(dst))
        return checksum_u8(dst)
    full = nbytes // psum.ROW_BYTES * psum.ROW_BYTES
    rows = np.empty(full // psum.ROW_BYTES, np.uint64)
    words = dst[:full].view(psum._LE_U64).reshape(-1, psum.ROW_WORDS)
    for c0 in range(0, nbytes, psum.CHUNK_BYTES):
        c1 = min(c0 + psum.CHUNK_BYTES, nbytes)
        wire.read_into(memoryview(dst[c0:c1]))
        if on_chunk is not None:
            on_chunk(memoryview(dst[c0:c1]))
        r0, r1 = c0 // psum.ROW_BYTES, min(c1, full) // psum.ROW_BYTES
        if r1 > r0:
            psum.row_sums_into(words[r0:r1], rows[r0:r1])
    return psum._combine(rows, dst, full)


def _check_value(codec: PlainCodec | SealedCodec, key: str, value: bytes | None, dst: np.ndarray) -> Any:
    """The slow path's version of RedisTier._read_value, for a value redis-py already read."""
    if value is None:
        return "misses_absent"
    hsize = codec.header_size
    if len(value) != hsize + dst.size:
        return "size_mismatches"
    np.copyto(dst, np.frombuffer(value, np.uint8, offset=hsize))
    return _verified(codec, value[:hsize], key, dst, checksum_u8(dst))


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def _unlink_matching(client: redis.Redis, pattern: str, batch: int = 512) -> None:
    """SCAN + UNLINK one key per command (keys of one server may sit in different cluster slots)."""
    pipe = client.pipeline(transaction=False)
    n = 0
    for name in client.scan_iter(match=pattern, count=1000):
        pipe.unlink(name)
        n += 1
        if n % batch == 0:
            pipe.execute()
    pipe.execute()
