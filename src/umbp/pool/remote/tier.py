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
TLS, pooling and the cluster's slot table are redis-py's. MOVED/ASK are followed one hop by the tier itself
(`_follow`), with the same codec and deadline. See docs/remote.md.

Code: this module holds construction, bookkeeping, the quarantine, `exists`, redirects and lifecycle;
the read path (`reader`: get_into, the get window, value checks, old secrets, repair), the write path
(`writer`: put, put_async and its background writer) and removal (`admin`: remove, clear, the operators'
scans) live beside it as mixins on the same state; `calls` holds the per-server job and the fault classes
they share.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import redis

from umbp.pool.base import Pool
from umbp.pool.keycheck import check_keys
from umbp.pool.remote.admin import AdminMixin
from umbp.pool.remote.auth import codec_for, old_codecs
from umbp.pool.remote.backend import Cluster, Group, Standalone
from umbp.pool.remote.calls import (
    _ABSENT,
    _ASKING,
    _HIT,
    _MOVED,
    _NET_ERRORS,
    _REDIS_PY_FAULTS,
    _UNANSWERED,
    _asked,
    _Job,
)
from umbp.pool.remote.config import RemoteConfig, redact_url
from umbp.pool.remote.conns import KeptConnections, discard
from umbp.pool.remote.reader import GET_WINDOW_BYTES, ReaderMixin
from umbp.pool.remote.resp import (
    ProtocolError,
    ReplyError,
    Wire,
    command,
    multi_key_command,
)
from umbp.pool.remote.writer import PUT_SEND_BYTES, WriterMixin, _Writer

__all__ = ["GET_WINDOW_BYTES", "PUT_SEND_BYTES", "RedisTier", "RemoteConfig"]

log = logging.getLogger("umbp.remote")


_COUNTERS = (
    "exists_keys",
    "exists_present",
    "lookup_errors",
    "quarantine_skips",
    "unavailable_skips",
    "hits",
    "misses",
    "misses_absent",
    "load_errors",
    "checksum_failures",
    "header_failures",
    "size_mismatches",
    "version_mismatches",
    "key_mismatches",
    "bytes_read",
    "puts",
    "put_duplicates",
    "puts_dropped",
    "puts_dropped_queue_full",
    "puts_dropped_unavailable",
    "puts_dropped_checksum",
    "bytes_written",
    "async_accepted",
    "auth_failures",
    "unauthenticated_values",
    "unsupported_values",
    "old_key_hits",
    "write_queue_hits",
    "connection_errors",
    "timeouts",
    "protocol_errors",
    "unexpected_replies",
    "reply_errors",
    "pool_exhausted",
    "redirects",
    "quarantined",
    "stale_markers_removed",
    "corrupt_removed",
)


def _now() -> float:
    """The clock of the retry interval and the quarantine: time.monotonic, looked up at each call so a
    test can move it instead of sleeping past an interval (a sleep's outcome depends on the machine's load)."""
    return time.monotonic()


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


class RedisTier(ReaderMixin, WriterMixin, AdminMixin, Pool):
    """The shared tier. Thread-safe; one instance per process (scheduler or worker)."""

    shared = True
    async_writes = True

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
            log.warning(
                "umbp: the shared tier at %s is unauthenticated: anyone who can write to it can plant "
                "values this process loads, and read its KV bytes; set auth_key_env or auth_key_file "
                "(docs/remote.md)",
                ", ".join(redact_url(u) for u in cfg.urls),
            )

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
        kind = (
            "timeouts"
            if timeout
            else "protocol_errors"
            if isinstance(exc, ProtocolError)
            else "connection_errors"
        )
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

    def _refresh(self, wait_s: float = 0.0) -> None:
        """Re-read a cluster's topology (waiting up to wait_s for it); kept connections of nodes that left
        it are dropped."""
        self._backend.refresh(wait_s)
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
        except _REDIS_PY_FAULTS as exc:  # redis-py connects the cluster client and looks slots up
            self._node_failed(self._backend.name, exc)
            return None

    def _prefixes(self, keys: list[str]) -> list[str | None]:
        """Each key's Redis key prefix (None where the backend could not place it)."""
        out: list[str | None] = [None] * len(keys)
        try:
            groups = self._backend.groups(keys)
        except _REDIS_PY_FAULTS as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"[:200]
            return out
        for gs in groups.values():
            for g in gs:
                for j in g.indices:
                    out[j] = g.prefix
        return out

    def _follow(
        self,
        redirected: list[tuple[Group, ReplyError]],
        job: Callable[[str, list[Group], bool], _Job],
        deadline: float,
    ) -> None:
        """Follow MOVED/ASK one hop, through the same bounded codec and within the call's deadline: each
        group goes to the node its redirect names (after ASKING for an ASK), `job(node, groups, ask)`
        building that node's commands. Only a node of the cluster's own topology is contacted (the slot
        table is re-read, rate-limited, when a redirect names another); groups whose redirect names none,
        or that are redirected again, keep their redirect as their result (a miss, a dropped save)."""
        by_target: dict[tuple[str, bool], list[Group]] = {}
        for g, err in redirected:
            if err.target is not None:
                by_target.setdefault((err.target, err.ask), []).append(g)
        if any(not self._backend.knows(node) for node, _ in by_target):
            self._refresh(max(0.0, deadline - time.monotonic()))
        jobs = [job(node, gs, ask) for (node, ask), gs in by_target.items() if self._backend.knows(node)]
        self._run(jobs, deadline)
        self._refresh()  # a MOVED means the slot table changed

    def _run(self, jobs: list[_Job], deadline: float | None = None) -> None:
        """Send every server's commands first, then read every server's replies: servers work in parallel
        and each costs one round trip. A server that fails leaves its results unset (None). A round that
        follows up on a call (redirects, previous secrets, repair) gets the call's `deadline`; once it has
        passed, no further job starts (its keys keep the results they have)."""
        open_: list[tuple[_Job, _Session]] = []
        began = time.monotonic()
        for job in jobs:
            if deadline is not None and time.monotonic() >= deadline:
                break
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
            sess.wire.deadline = began + self.config.deadline_s(job.nbytes) if deadline is None else deadline
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

    def _reply_error(self, err: ReplyError) -> ReplyError | None:
        """`err` itself for MOVED/ASK in a cluster (the caller follows it: `_follow`), else None (a counted
        miss)."""
        if err.redirect and isinstance(self._backend, Cluster):
            self._count(redirects=1)
            return err
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
        deadline = time.monotonic() + self.config.deadline_s(0)
        queued = self._writer.holding(keys)  # before the server: see _Writer.holding
        groups = self._groups(keys) if keys else {}
        if groups is None:
            groups = {}
        moved: list[tuple[Group, ReplyError]] = []
        self._run([self._exists_job(node, gs, keys, res, moved) for node, gs in groups.items()])
        if moved:
            again: list[tuple[Group, ReplyError]] = []
            self._follow(moved, lambda n, gs, ask: self._exists_job(n, gs, keys, res, again, ask), deadline)
        res[res == _MOVED] = _UNANSWERED  # redirects not followed, or redirected again
        if self._old and (res == _ABSENT).any():
            self._exists_old(keys, res, deadline)
        res[queued] = _HIT  # saved by put_async and not yet written: present (its load is served locally)
        return self._finish_exists(keys, res)

    def _exists_job(
        self,
        node: str,
        groups: list[Group],
        keys: list[str],
        res: np.ndarray,
        moved: list[tuple[Group, ReplyError]],
        ask: bool = False,
    ) -> _Job:
        """MGET of the groups' markers on `node` (after ASKING each, when following an ASK); groups
        answered MOVED/ASK are set to _MOVED and listed in `moved` with their redirect."""

        def send(wire: Wire) -> None:  # chunk by chunk: the server parses one while we pack the next
            for g in groups:
                mget = multi_key_command(b"MGET", g.prefix + "m:", g.keys(keys))
                wire.send([_ASKING, *mget] if ask else mget)

        def read(wire: Wire) -> None:
            for g in groups:
                if ask:
                    _asked(wire)
                flags = wire.markers(len(g.indices))
                idx = slice(g.indices.start, g.indices.stop) if isinstance(g.indices, range) else g.indices
                if not isinstance(flags, ReplyError):
                    res[idx] = flags
                elif (redirect := self._reply_error(flags)) is not None:
                    res[idx] = _MOVED
                    moved.append((g, redirect))
                else:
                    res[idx] = _UNANSWERED

        return _Job(node, send, read, sum(len(g.indices) for g in groups))

    def _finish_exists(self, keys: list[str], res: np.ndarray) -> list[bool]:
        errors = int((res < 0).sum())
        hit = res == _HIT
        skips = 0
        if len(self._quarantine):
            held = self._quarantine.held(keys)
            skips = int(hit[held].sum())
            hit[held] = False
        self._count(
            exists_keys=len(keys), exists_present=int(hit.sum()), lookup_errors=errors, quarantine_skips=skips
        )
        return hit.tolist()

    @property
    def value_header_bytes(self) -> int:
        """Bytes each stored value carries before its payload (larger for sealed values)."""
        return self._codec.header_size

    # ---- stats / lifecycle ---------------------------------------------------------------------------

    def quarantine(self, keys: Sequence[str]) -> None:
        """Report these keys absent for quarantine_s (e.g. the scheduler, told by a worker that a load
        failed, so its lookups stop offering the key)."""
        self._count(quarantined=self._quarantine.add(list(keys)))

    def ping(self) -> bool:
        """Whether every server answers now (ignores and resets the retry interval)."""
        try:
            ok = all(c.ping() for c in self._backend.primaries())
        except _REDIS_PY_FAULTS:
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
