"""Connections the shared tier keeps checked out of redis-py's pools between its calls.

Why: redis-py's `get_connection` + `release` cost ~8 µs a call on the dev VM (two `getpid` syscalls, a
`can_read` probe, two locks, observability hooks), paid by every lookup, load and save batch. A batch of
16 x 4 KiB spends a fifth of its client time there, 16 x 64 KiB a few percent. Here a checkout is a list
pop and one `poll(0)` on the socket.

What redis-py's checkout guarantees is kept:

* a connection the server closed while it sat idle (an idle `timeout`, a restart) shows as readable; it
  is dropped and a fresh one taken from redis-py, which reconnects — so that is not a failure;
* after a fork the child forgets every kept connection (they are the parent's sockets) without touching
  them, and redis-py's own pid check resets the pool on the child's first checkout;
* connections that failed, or were not fully read, never come back here: the tier disconnects them.

Kept connections count as in use in redis-py's pool, so `max_connections` still bounds the total.
"""

from __future__ import annotations

import os
import select
import threading
import weakref
from typing import Any

import redis

_instances: weakref.WeakSet[KeptConnections] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """The kept sockets are the parent's: forget them without a syscall on them (a disconnect would shut
    the parent's connection down). The lock is new too: another thread may have held it at the fork."""
    for kept in list(_instances):
        kept._lock = threading.Lock()
        kept._idle = {}


os.register_at_fork(after_in_child=_after_fork_in_child)


def discard(pool: redis.ConnectionPool, conn: Any) -> None:
    """Close a connection whose stream cannot be trusted (failed, unread replies, stale) and give its slot
    back to redis-py's pool."""
    conn.disconnect()
    pool.release(conn)


def _stale(conn: Any) -> bool:
    """True when the idle connection has something to read (EOF or an unsolicited reply): not usable."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return True
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(0))


class KeptConnections:
    """Per pool, a LIFO list of idle, drained connections (LIFO: the warmest socket goes out first)."""

    def __init__(self, keep_per_pool: int) -> None:
        self._keep = keep_per_pool
        self._lock = threading.Lock()
        self._idle: dict[redis.ConnectionPool, list[Any]] = {}
        self._closed = False
        _instances.add(self)

    def take(self, pool: redis.ConnectionPool) -> Any:
        """A connected connection of `pool`; raises what redis-py's checkout raises."""
        conn = self._pop(pool)
        while conn is not None:
            if not _stale(conn):
                return conn
            discard(pool, conn)
            conn = self._pop(pool)
        return pool.get_connection()

    def give(self, pool: redis.ConnectionPool, conn: Any) -> None:
        """Keep a fully read connection for the next call (or hand it back to redis-py when enough are
        kept, or after close)."""
        with self._lock:
            if not self._closed:
                idle = self._idle.setdefault(pool, [])
                if len(idle) < self._keep:
                    idle.append(conn)
                    return
        pool.release(conn)

    def drop(self, pool: redis.ConnectionPool | None = None) -> None:
        """Disconnect and hand back the kept connections of one pool (a server that failed: after a
        restart they are stale), or of every pool."""
        with self._lock:
            pools = list(self._idle) if pool is None else [pool]
            taken = [(p, self._idle.pop(p, [])) for p in pools]
        for p, conns in taken:
            for conn in conns:
                discard(p, conn)

    def keep_only(self, pools: list[redis.ConnectionPool]) -> None:
        """Drop pools that left the topology (a cluster node removed or replaced)."""
        live = set(pools)
        with self._lock:
            gone = [p for p in self._idle if p not in live]
        for p in gone:
            self.drop(p)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.drop()

    def idle_count(self) -> int:
        with self._lock:
            return sum(map(len, self._idle.values()))

    def _pop(self, pool: redis.ConnectionPool) -> Any:
        with self._lock:
            idle = self._idle.get(pool)
            return idle.pop() if idle else None
