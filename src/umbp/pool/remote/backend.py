"""Where each key lives on the shared tier: one server, or a Redis Cluster's masters. Layer 2; imports
redis-py (the `redis` extra).

Redis key layout (documented in docs/remote.md):

* one server: ``<key_prefix>d:<key>`` holds the value (header + bytes), ``<key_prefix>m:<key>`` holds the
  1-byte marker ``1`` that lookups read (an MGET of markers answers 8,192 keys in one command, where the
  values themselves would be gigabytes);
* cluster: ``<key_prefix>{<tag>}d:<key>`` and ``<key_prefix>{<tag>}m:<key>``, tag = the key's last
  `hash_tag_chars` characters. umbp keys end in the engine's prefix hash (hex), so every rank's and every
  group's shard at one prefix boundary shares a tag, hence a hash slot and a master: a lookup costs one MGET
  per tag (at most 16**N) instead of one command per key, value and marker live on one master (written in
  order on one connection), and a master that dies takes whole logical objects with it rather than one
  shard of many.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from umbp.pool.remote.config import RemoteConfig

MGET_CHUNK = 768  # keys per MGET: small enough that packing stays off mmap-sized allocations


@dataclass(frozen=True)
class Group:
    """Keys sharing one Redis key prefix (and so, in a cluster, one slot): indices into the caller's batch."""

    prefix: str
    indices: range | list[int]

    def keys(self, keys: list[str]) -> list[str]:
        idx = self.indices
        if isinstance(idx, range):
            return keys[idx.start : idx.stop]
        return [keys[i] for i in idx]


def bounded_connection(base: type, seconds: float) -> type:
    """A redis-py connection class bounded where redis-py is not. Time: its set-up after the TCP connect
    (AUTH, CLIENT SETNAME, SELECT: what redis-py sends before the connection is handed out) is held to
    `seconds` as a whole. redis-py reads those replies with its per-receive socket timeout, so a server
    dripping one held the call that needed a new connection for as long as it dripped; here a timer shuts
    the socket down once `seconds` have passed, the read fails, and the call is a miss. (redis-py 5-7 set
    up in on_connect, 8 in on_connect_check_health, which on_connect calls: one timer either way.)
    Memory and time of each reply: every reply redis-py parses on it is held to MAX_REPLY_BYTES and to
    `seconds` from the start of its read (_capped_parser)."""

    def guarded(name: str):
        def method(self, *args, **kwargs):
            inner = getattr(super(cls, self), name)
            if getattr(self, "_umbp_setup_timer", None) is not None:  # the outer set-up call's timer
                return inner(*args, **kwargs)
            timer = threading.Timer(seconds, _shut, (self._sock,))
            timer.daemon = True
            self._umbp_setup_timer = timer
            timer.start()
            try:
                return inner(*args, **kwargs)
            finally:
                timer.cancel()
                self._umbp_setup_timer = None

        return method

    methods: dict[str, Any] = {
        n: guarded(n) for n in ("on_connect", "on_connect_check_health") if hasattr(base, n)
    }
    methods["umbp_reply_seconds"] = seconds  # read by the capped parser's socket
    if _CappedParser is not None:

        def __init__(self, *args, **kwargs):
            kwargs["parser_class"] = _CappedParser
            super(cls, self).__init__(*args, **kwargs)

        methods["__init__"] = __init__
    cls = type(f"Umbp{base.__name__}", (base,), methods)
    return cls


MAX_REPLY_BYTES = 8 << 20
"""The most one reply read by redis-py's parser may hold. Those replies (set-up, the cluster topology,
SCAN pages, STRLEN counts, PING) are small: a 1,000-shard CLUSTER SLOTS reply is well under 1 MiB."""


def _capped_parser() -> type | None:
    """redis-py's RESP2 parser, each reply held to MAX_REPLY_BYTES and to the connection's timeout_s.
    redis-py's parser keeps what a server sends (a bulk string until its claimed length has arrived, an
    array's elements as they come) and its socket timeout bounds each receive, not a reply: a node
    streaming an endless CLUSTER SLOTS reply grew the topology thread's memory for as long as it
    streamed, and a server dripping a reply (a byte per receive, each inside the timeout) held a remove,
    a clear or a scan for as long as it dripped. The parser's read buffer holds the reply being read (it
    is emptied after each one), so the socket the buffer reads from checks its size before every
    receive, and gives each receive only what is left of the reply's time. None where this redis-py has
    no such parser: its own then runs uncapped."""
    try:
        from redis._parsers import _RESP2Parser
    except ImportError:
        return None

    class CappedParser(_RESP2Parser):
        def on_connect(self, connection):
            super().on_connect(connection)
            buffer = getattr(self, "_buffer", None)
            if hasattr(getattr(buffer, "_buffer", None), "getbuffer") and hasattr(buffer, "_sock"):
                seconds = getattr(connection, "umbp_reply_seconds", None)
                buffer._sock = _CappedSocket(buffer._sock, buffer, seconds)

        def read_response(self, *args, **kwargs):
            sock = getattr(getattr(self, "_buffer", None), "_sock", None)
            if not isinstance(sock, _CappedSocket):
                return super().read_response(*args, **kwargs)
            sock.reply_started()  # only while a reply is read: can_read's polls have no deadline
            try:
                return super().read_response(*args, **kwargs)
            finally:
                sock.reply_ended()

    return CappedParser


class _CappedSocket:
    """The socket as redis-py's read buffer sees it: a receive past MAX_REPLY_BYTES held is refused, and
    while a reply is read each receive waits at most what is left of `seconds` from its start (only
    that buffer reads through this; umbp's own reads use the socket itself)."""

    def __init__(self, sock: Any, buffer: Any, seconds: float | None = None) -> None:
        self._sock, self._buffer, self._seconds = sock, buffer, seconds
        self._deadline: float | None = None

    def reply_started(self) -> None:
        self._deadline = time.monotonic() + self._seconds if self._seconds else None

    def reply_ended(self) -> None:
        self._deadline = None

    def recv(self, n: int) -> bytes:
        try:
            with self._buffer._buffer.getbuffer() as held:
                size = held.nbytes
        except (AttributeError, ValueError):  # closed meanwhile: the receive below reports it
            size = 0
        if size > MAX_REPLY_BYTES:
            raise redis.ConnectionError(
                f"umbp: a reply of more than {MAX_REPLY_BYTES >> 20} MiB; dropping the connection"
            )
        if self._deadline is None:
            return self._sock.recv(n)
        left = self._deadline - time.monotonic()
        if left <= 0:  # redis-py drops the connection on a timeout, as on this socket's own
            raise TimeoutError(f"umbp: a reply took longer than {self._seconds} s")
        before = self._sock.gettimeout()
        if before is not None and before <= left:
            return self._sock.recv(n)
        self._sock.settimeout(left)
        try:
            return self._sock.recv(n)
        finally:
            self._sock.settimeout(before)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


_CappedParser = _capped_parser()


def _shut(sock: Any) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError):  # closed meanwhile, or no socket
        pass


def client_kwargs(cfg: RemoteConfig) -> dict[str, Any]:
    """redis-py connection settings: no retries (a failure is a miss; the tier decides when to reconnect),
    RESP2, no health-check pings on the hot path, the set-up of a new connection (AUTH and what follows the
    TCP connect) held to timeout_s as a whole: no longer than the call that needs it may take."""
    base = redis.SSLConnection if cfg.tls else redis.Connection
    kw: dict[str, Any] = {
        "connection_class": bounded_connection(base, cfg.timeout_s),
        "username": cfg.username,
        "password": cfg.password,
        "socket_timeout": cfg.timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "max_connections": cfg.max_connections,
        "protocol": 2,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
        "client_name": "umbp",
        "socket_keepalive": True,
    }
    if cfg.tls:
        kw.update(
            ssl_ca_certs=cfg.tls_ca_file,
            ssl_certfile=cfg.tls_cert_file,
            ssl_keyfile=cfg.tls_key_file,
            ssl_cert_reqs="required" if cfg.tls_verify else "none",
            ssl_check_hostname=cfg.tls_check_hostname,
        )
    return kw


class Standalone:
    """One server: every key in one group, one connection pool."""

    def __init__(self, cfg: RemoteConfig) -> None:
        ep = cfg.endpoints[0]
        kw = client_kwargs(cfg)
        self.name = ep.name
        self._prefix = cfg.redis_prefix
        self._pool = redis.ConnectionPool(host=ep.host, port=ep.port, db=ep.db, **kw)
        self._client = redis.Redis(connection_pool=self._pool)

    def groups(self, keys: list[str]) -> dict[str, list[Group]]:
        n = len(keys)
        return {
            self.name: [
                Group(self._prefix, range(i, min(i + MGET_CHUNK, n))) for i in range(0, n, MGET_CHUNK)
            ]
        }

    def pool(self, node: str) -> redis.ConnectionPool:
        return self._pool

    def knows(self, node: str) -> bool:
        return node == self.name

    def client(self) -> redis.Redis:
        return self._client

    def pools(self) -> list[redis.ConnectionPool]:
        return [self._pool]

    def primaries(self) -> list[redis.Redis]:
        return [self._client]

    def refresh(self, wait_s: float = 0.0) -> None:
        """Nothing to rediscover on one server."""

    def close(self) -> None:
        self._pool.disconnect()


class Cluster:
    """Redis Cluster: keys grouped by hash tag, tags mapped to masters through redis-py's slot table.

    The topology (the RedisCluster client, whose constructor reads it, and every re-read after) is read
    by redis-py, whose socket timeout bounds each read but not a whole reply: a node dripping its
    CLUSTER SLOTS reply held the call that asked for as long as it dripped. So a thread of its own reads
    the topology; a call waits for the first read at most connect_timeout_s + timeout_s, and for a
    re-read what its caller allows (after a redirect, what is left of the call's deadline; else nothing).
    A tier built while the cluster is down still starts; until it is up every call is a
    counted miss."""

    def __init__(self, cfg: RemoteConfig) -> None:
        self._cfg = cfg
        self._chars = cfg.hash_tag_chars
        self._rc: RedisCluster | None = None
        self._slots: dict[str, int] = {}
        self._last_refresh = 0.0
        self.name = "cluster"
        self._cv = threading.Condition()
        self._asked = self._served = 0  # topology reads asked for, and served (in order)
        self._reader: threading.Thread | None = None
        self._closed = False
        self._error = "no answer yet"
        self._pid = os.getpid()

    def client(self) -> RedisCluster:
        rc = self._rc
        if rc is None:
            self._ask(self._cfg.connect_timeout_s + self._cfg.timeout_s)
            rc = self._rc
            if rc is None:
                raise redis.ConnectionError(f"umbp: cannot reach the cluster: {self._error}")
        return rc

    def _ask(self, wait_s: float) -> None:
        """Ask the topology thread for a read (the first connect, else a re-read); wait up to wait_s."""
        if self._pid != os.getpid():  # a forked child: no thread, and the lock may be held by a dead one
            self._pid, self._cv, self._reader = os.getpid(), threading.Condition(), None
            self._asked = self._served = 0
        with self._cv:
            if self._closed:
                return
            self._asked += 1
            mine = self._asked
            if self._reader is None:
                self._reader = threading.Thread(target=self._read_topology, name="umbp-cluster-topology")
                self._reader.daemon = True  # a read stuck on a dripping node must not hold up exit
                self._reader.start()
            self._cv.notify_all()
            if wait_s > 0:
                self._cv.wait_for(lambda: self._served >= mine or self._closed, timeout=wait_s)

    def _read_topology(self) -> None:
        """The topology thread: serve every read asked for so far with one read, until closed."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._asked > self._served or self._closed)
                if self._closed:
                    return
                mine = self._asked
            try:
                if self._rc is None:
                    rc = self._connect()
                    with self._cv:
                        if self._closed:
                            rc.close()
                            return
                        self._rc = rc
                else:
                    self._rc.nodes_manager.initialize()
            except Exception as exc:  # redis-py parses the nodes' replies: whatever it raises, no new table
                self._error = f"{type(exc).__name__}: {exc}"[:200]
            with self._cv:
                self._served = mine
                self._cv.notify_all()

    def _connect(self) -> RedisCluster:
        cfg = self._cfg
        nodes = [ClusterNode(ep.host, ep.port) for ep in cfg.endpoints]
        kw = client_kwargs(cfg)
        if cfg.tls:
            kw["ssl"] = True
        return RedisCluster(startup_nodes=nodes, require_full_coverage=False, **kw)  # _read_topology catches

    def groups(self, keys: list[str]) -> dict[str, list[Group]]:
        rc = self.client()
        chars = self._chars
        by_tag: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            t = k[-chars:]
            lst = by_tag.get(t)
            if lst is None:
                by_tag[t] = [i]
            else:
                lst.append(i)
        out: dict[str, list[Group]] = {}
        for tag, idx in _safe_tags(by_tag).items():
            prefix = f"{self._cfg.redis_prefix}{{{tag}}}"
            node = rc.nodes_manager.get_node_from_slot(self._slot(prefix)).name
            out.setdefault(node, []).append(Group(prefix, idx))
        return out

    def _slot(self, prefix: str) -> int:
        slot = self._slots.get(prefix)
        if slot is None:
            slot = self._slots[prefix] = key_slot(prefix.encode())
        return slot

    def knows(self, node: str) -> bool:
        """Whether `node` ('host:port') is in the topology the client last read (never connects)."""
        return self._rc is not None and self._rc.get_node(node_name=node) is not None

    def pool(self, node: str) -> redis.ConnectionPool:
        cn = self.client().get_node(node_name=node)
        if cn is None or cn.redis_connection is None:
            raise redis.ConnectionError(f"umbp: cluster node {node} is not in the topology any more")
        return cn.redis_connection.connection_pool

    def pools(self) -> list[redis.ConnectionPool]:
        """The pools of every node in the current topology (none before the first connect)."""
        if self._rc is None:
            return []
        nodes = list(self._rc.nodes_manager.nodes_cache.values())
        return [n.redis_connection.connection_pool for n in nodes if n.redis_connection is not None]

    def primaries(self) -> list[redis.Redis]:
        rc = self.client()
        return [n.redis_connection for n in rc.get_primaries() if n.redis_connection is not None]

    def refresh(self, wait_s: float = 0.0, min_interval_s: float = 0.5) -> None:
        """Re-read the slot table (after MOVED, or a node failure that may mean a failover), waiting up
        to wait_s for it; rate-limited. Until a re-read lands, keys routed to dead nodes are misses."""
        now = time.monotonic()
        if self._rc is None or now - self._last_refresh < min_interval_s:
            return
        self._last_refresh = now
        self._ask(wait_s)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._rc is not None:
            self._rc.close()


def _safe_tags(by_tag: dict[str, list[int]]) -> dict[str, list[int]]:
    """A tag must be non-empty and brace-free or Redis would hash a different part of the key than we
    routed on; such tags (only from unusual keys) are rewritten and their groups merged."""
    bad = [t for t in by_tag if not t or "{" in t or "}" in t]
    for t in bad:
        safe = t.replace("{", "(").replace("}", ")") or "_"
        by_tag.setdefault(safe, []).extend(by_tag.pop(t))
    return by_tag
