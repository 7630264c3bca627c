"""Failure semantics on one real redis-server: down, killed mid-run, restarted, slow. Lookups miss and saves
are dropped (all counted), nothing raises, no wrong byte is ever returned, reconnection is automatic."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import RedisServer, blob, require_redis, start_server  # noqa: E402

require_redis()

from umbp.pool.remote.tier import RedisTier, RemoteConfig  # noqa: E402


class MovedClock:
    """Stands in for the tier's clock (retry interval, quarantine): it stands still until the test moves
    it, so a retry interval neither ends early on a slow machine nor needs a sleep to end."""

    def __init__(self, monkeypatch) -> None:
        import umbp.pool.remote.tier as remote_mod

        self.now = time.monotonic()
        monkeypatch.setattr(remote_mod, "_now", lambda: self.now)

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_tier(url: str, **opts) -> RedisTier:
    base = {
        "url": url,
        "retry_interval_s": 0.2,
        "timeout_s": 0.3,
        "connect_timeout_s": 0.3,
        "quarantine_s": 0,
    }
    return RedisTier(RemoteConfig.from_options({**base, **opts}))


def test_server_down_from_the_start_then_up(tmp_path, monkeypatch):
    clock = MovedClock(monkeypatch)  # the 0.2 s retry interval lasts until the clock is moved
    server = RedisServer(tmp_path)  # a free port, nothing listening yet
    tier = make_tier(server.url)
    data = blob(1000, 1)
    t0 = time.monotonic()
    assert tier.exists(["k"]) == [False]
    assert tier.put(["k"], [data]) == [False]
    assert tier.put_async(["k"], [data]) == [False]  # dropped at once while the server is known down
    assert tier.get_into(["k"], [np.empty(1000, np.uint8)]) == [False]
    assert time.monotonic() - t0 < 1.0
    s = tier.stats()
    assert s["connection_errors"] >= 1 and s["lookup_errors"] == 1 and s["puts_dropped"] == 2
    assert s["load_errors"] == 1 and s["servers_down"] == [f"127.0.0.1:{server.port}"]
    server.start()
    try:
        clock.advance(0.25)  # the retry interval passes; the next call reconnects by itself
        assert tier.put(["k"], [data]) == [True]
        out = np.empty(1000, np.uint8)
        assert tier.get_into(["k"], [out]) == [True] and np.array_equal(out, data)
    finally:
        tier.close()
        server.stop()


def test_calls_answer_at_once_while_a_server_is_down(tmp_path):
    server = RedisServer(tmp_path)
    tier = make_tier(server.url, retry_interval_s=30)
    tier.exists(["k"])  # the failure that opens the interval
    t0 = time.perf_counter()
    for _ in range(100):
        assert tier.exists(["k"]) == [False]
    assert time.perf_counter() - t0 < 0.5
    assert tier.stats()["connection_errors"] == 1  # no reconnect attempts inside the interval
    tier.close()


def test_kill_mid_run_then_restart(tmp_path):
    server = start_server(tmp_path)
    tier = make_tier(server.url)
    keys = [f"k{i}" for i in range(20)]
    data = [blob(50_000, i) for i in range(20)]
    assert all(tier.put(keys, data))
    outs = [np.empty(50_000, np.uint8) for _ in keys]
    assert all(tier.get_into(keys, outs))
    server.stop()  # SIGKILL: pooled connections are now dead
    try:
        assert tier.exists(keys) == [False] * 20
        outs = [np.zeros(50_000, np.uint8) for _ in keys]
        assert tier.get_into(keys, outs) == [False] * 20
        assert tier.put(["new"], [data[0]]) == [False]
        s = tier.stats()
        assert s["hits"] == 20 and s["misses"] == 20 and s["puts_dropped"] == 1
        assert s["connection_errors"] + s["timeouts"] >= 1
        server.start()  # same port, empty (no persistence)
        time.sleep(0.25)
        assert tier.exists(keys) == [False] * 20  # the data went with the process: misses, not errors
        assert all(tier.put(keys[:5], data[:5]))
        outs = [np.empty(50_000, np.uint8) for _ in range(5)]
        assert all(tier.get_into(keys[:5], outs))
        assert all(np.array_equal(o, d) for o, d in zip(outs, data[:5], strict=True))
    finally:
        tier.close()
        server.stop()


def test_slow_server_times_out_into_misses(tmp_path, monkeypatch):
    clock = MovedClock(monkeypatch)  # the 0.5 s retry interval lasts until the clock is moved
    server = start_server(tmp_path)
    tier = make_tier(server.url, timeout_s=0.2, retry_interval_s=0.5)
    try:
        assert tier.put(["k"], [b"value"]) == [True]
        server.pause(2.0)
        t0 = time.monotonic()
        assert tier.exists(["k"]) == [False]
        assert tier.get_into(["k"], [bytearray(5)]) == [False]  # inside the retry interval: no wait at all
        assert time.monotonic() - t0 < 1.0  # bounded by timeout_s, not by the 2 s stall
        assert tier.stats()["timeouts"] == 1
        raw = server.client()
        assert raw.ping()  # answered once the pause is over
        raw.close()
        clock.advance(0.6)  # and the retry interval
        out = bytearray(5)
        assert tier.exists(["k"]) == [True] and tier.get_into(["k"], [out]) == [True] and out == b"value"
    finally:
        tier.close()
        server.stop()


def test_background_writer_survives_a_dead_server(tmp_path):
    server = start_server(tmp_path)
    tier = make_tier(server.url)
    try:
        assert tier.put_async(["a"], [b"1"]) == [True]
        assert tier.flush(5)
        server.stop()
        assert tier.put_async(["b", "c"], [b"2", b"3"]) == [
            True,
            True,
        ]  # accepted, then dropped by the writer
        assert tier.flush(5)
        s = tier.stats()
        assert s["puts"] == 1 and s["puts_dropped"] == 2 and s["write_queue_items"] == 0
        server.start()
        time.sleep(0.25)
        assert tier.put_async(["d"], [b"4"]) == [True] and tier.flush(5)
        assert tier.exists(["d"]) == [True]  # the writer thread is alive and reconnected
    finally:
        tier.close()
        server.stop()


@pytest.mark.parametrize("ops", [50])
def test_random_kills_never_return_wrong_bytes(tmp_path, ops):
    """Interleave puts/gets with kills and restarts: every get that says True returned the exact bytes."""
    rng = np.random.default_rng(7)
    server = start_server(tmp_path)
    tier = make_tier(server.url, retry_interval_s=0.0)
    truth = {f"k{i}": blob(int(rng.integers(1, 200_000)), i) for i in range(10)}
    try:
        for step in range(ops):
            if step % 17 == 8:
                server.stop()
            elif server.proc is None and step % 17 == 12:
                server.start()
            k = f"k{int(rng.integers(0, 10))}"
            tier.put([k], [truth[k]])
            out = np.empty(truth[k].size, np.uint8)
            if tier.get_into([k], [out]) == [True]:
                assert np.array_equal(out, truth[k])
    finally:
        tier.close()
        server.stop()


def test_exhausted_connection_pool_is_a_miss_not_a_dead_server(tmp_path):
    server = start_server(tmp_path)
    tier = make_tier(server.url, max_connections=1)
    try:
        assert tier.put(["k"], [b"v"]) == [True]
        pool = tier._backend.pool(tier._backend.name)
        held = tier._conns.take(pool)  # another thread of the tier holds the only connection
        assert tier.exists(["k"]) == [False]
        s = tier.stats()
        assert s["pool_exhausted"] == 1 and s["servers_down"] == [] and s["connection_errors"] == 0
        tier._conns.give(pool, held)
        assert tier.exists(["k"]) == [True]
    finally:
        tier.close()
        server.stop()
