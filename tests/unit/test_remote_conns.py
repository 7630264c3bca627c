"""The shared tier keeps drained connections between calls (umbp.pool.remote.conns). What redis-py's own
checkout guarantees must still hold: a connection the server closed while idle is replaced without a
failure, a forked child never uses or shuts down the parent's sockets, failed connections are not kept."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import blob, require_redis, start_server  # noqa: E402

require_redis()

from umbp.pool.remote.tier import RedisTier, RemoteConfig  # noqa: E402


@pytest.fixture
def server(tmp_path):
    s = start_server(tmp_path)
    yield s
    s.stop()


def make_tier(url: str, **opts) -> RedisTier:
    base = {"url": url, "retry_interval_s": 5.0, "timeout_s": 1.0, "quarantine_s": 0}
    return RedisTier(RemoteConfig.from_options({**base, **opts}))


def pool_of(tier: RedisTier):
    return tier._backend.pool(tier._backend.name)


def test_one_connection_serves_every_call(server):
    tier = make_tier(server.url)
    try:
        data = [blob(65536, i) for i in range(8)]
        keys = [f"k{i}" for i in range(8)]
        assert tier.put(keys, data) == [True] * 8
        out = [np.empty(65536, np.uint8) for _ in keys]
        for _ in range(20):
            assert tier.exists(keys) == [True] * 8
            assert tier.get_into(keys, out) == [True] * 8
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert tier._conns.idle_count() == 1 and tier.stats()["idle_connections"] == 1
        assert pool_of(tier)._created_connections == 1
    finally:
        tier.close()
    assert tier._conns.idle_count() == 0


def test_connection_the_server_closed_while_idle_is_replaced_not_a_failure(server):
    tier = make_tier(server.url)
    admin = server.client()
    try:
        data = blob(8192, 1)
        assert tier.put(["k"], [data]) == [True]
        assert tier._conns.idle_count() == 1
        assert admin.client_kill_filter(_type="normal", skipme=True) >= 1  # what an idle `timeout` does
        out = np.empty(8192, np.uint8)
        assert tier.get_into(["k"], [out]) == [True]
        assert np.array_equal(out, data)
        s = tier.stats()
        assert s["connection_errors"] == 0 and s["timeouts"] == 0 and s["servers_down"] == []
    finally:
        tier.close()


def test_failed_connection_is_not_kept(server, tmp_path):
    tier = make_tier(server.url, retry_interval_s=0.01)
    try:
        assert tier.put(["k"], [blob(100, 2)]) == [True]
        server.stop()
        assert tier.exists(["k"]) == [False]
        assert tier._conns.idle_count() == 0
        assert tier.stats()["connection_errors"] == 1
    finally:
        tier.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_leaves_the_parents_connection_alone(server):
    tier = make_tier(server.url)
    try:
        data = blob(4096, 3)
        assert tier.put(["k"], [data]) == [True]
        parent_conn = tier._conns._idle[pool_of(tier)][0]
        stop = threading.Event()
        holder = threading.Thread(target=lambda: stop.wait(5))  # another thread may hold locks at fork
        holder.start()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: a fresh connection of its own, never the parent's socket
            ok = 0
            try:
                out = np.empty(4096, np.uint8)
                ok = int(
                    tier.get_into(["k"], [out]) == [True]
                    and np.array_equal(out, data)
                    and tier._conns._idle[pool_of(tier)][0] is not parent_conn
                )
            finally:
                os.write(w, bytes([ok]))
                os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"\x01"
        os.waitpid(pid, 0)
        os.close(r)
        stop.set()
        holder.join()
        out = np.empty(4096, np.uint8)
        assert tier.get_into(["k"], [out]) == [True] and np.array_equal(out, data)
        assert tier._conns._idle[pool_of(tier)][0] is parent_conn  # still open and usable
        assert tier.stats()["connection_errors"] == 0
    finally:
        tier.close()


def test_threads_share_kept_connections_up_to_the_limit(server):
    tier = make_tier(server.url, max_connections=4)
    try:
        keys = [f"k{i}" for i in range(4)]
        data = [blob(16384, 10 + i) for i in range(4)]
        assert tier.put(keys, data) == [True] * 4
        errors: list[str] = []

        def work(t: int) -> None:
            out = [np.empty(16384, np.uint8) for _ in keys]
            for _ in range(50):
                if tier.get_into(keys, out) != [True] * 4:
                    errors.append(f"thread {t}: miss")
                elif not all(np.array_equal(a, b) for a, b in zip(out, data, strict=True)):
                    errors.append(f"thread {t}: wrong bytes")

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert 1 <= tier._conns.idle_count() <= 4
        assert pool_of(tier)._created_connections <= 4
        assert tier.stats()["pool_exhausted"] == 0
    finally:
        tier.close()


def test_pools_that_left_the_topology_lose_their_kept_connections(server):
    """keep_only (called after a cluster's slot table is re-read) drops what is kept for pools no longer
    in it: disconnected and handed back, so nothing lingers on a removed node."""
    import redis

    from umbp.pool.remote.conns import KeptConnections

    kept = KeptConnections(4)
    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1].split("/")[0])
    a, b = redis.ConnectionPool(host=host, port=port), redis.ConnectionPool(host=host, port=port)
    try:
        ca, cb = kept.take(a), kept.take(b)
        kept.give(a, ca)
        kept.give(b, cb)
        assert kept.idle_count() == 2
        kept.keep_only([a])
        assert kept.idle_count() == 1
        assert cb._sock is None and b._available_connections == [cb]  # disconnected, back in its pool
        assert kept.take(a) is ca  # the one kept is handed out again
        kept.give(a, ca)
        kept.close()
        assert kept.idle_count() == 0 and ca._sock is None
        kept.give(a, ca)  # after close, a connection goes straight back to redis-py
        assert kept.idle_count() == 0 and ca in a._available_connections
    finally:
        a.disconnect()
        b.disconnect()
