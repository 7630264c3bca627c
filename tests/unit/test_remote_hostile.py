"""RedisTier against a broken or hostile server (a scripted RESP server on 127.0.0.1): every behaviour is
a counted failure within a bounded time and bounded memory, never an exception out of put/get/exists.
Each runs on the C extension's read loop and on the pure-Python one (the `impl` fixture)."""

from __future__ import annotations

import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
pytest.importorskip("redis")

from fake_resp import FakeResp, drip, endless  # noqa: E402
from redis_servers import make_tls_files  # noqa: E402
from umbp.pool.checksum import checksum  # noqa: E402
from umbp.pool.remote.format import HEADER_SIZE, pack_header  # noqa: E402
from umbp.pool.remote.tier import RedisTier, RemoteConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("impl")

MiB = 1 << 20
KEY = "umbp:v1:ns:tp0:pcp0:dcp0:pp0:g0:" + "ab" * 32
SIZE = 4096  # one 4 KiB row: a get of such values takes the batched read (the C loop when built)


def tier_for(server: FakeResp, **options: Any) -> RedisTier:
    opts = {
        "url": server.url,
        "timeout_s": 0.5,
        "connect_timeout_s": 0.5,
        "quarantine_s": 0,
        "retry_interval_s": 0,
        **options,
    }
    return RedisTier(RemoteConfig.from_options(opts))


def bounded(call: Callable[[], Any], seconds: float, peak_bytes: int = 32 * MiB) -> Any:
    """Run `call`: it must not raise, and must finish within `seconds` and `peak_bytes` of new Python
    allocations (numpy's included: tracemalloc sees them)."""
    tracemalloc.start()
    began = time.monotonic()
    try:
        out = call()
    finally:
        took = time.monotonic() - began
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert took < seconds, f"took {took:.2f}s"
    assert peak < peak_bytes, f"allocated {peak / MiB:.0f} MiB"
    return out


def on(commands: tuple[bytes, ...], reply: Any) -> Callable[[list[bytes]], Any]:
    """Answer `reply` to these commands (the first one the client sends decides), +OK to the rest."""
    return lambda cmd: reply if cmd[0].upper() in commands else b"+OK\r\n"


WRITES = (b"MULTI", b"SET", b"EXEC")


def put_one(t: RedisTier) -> list[bool]:
    return t.put([KEY], [np.ones(SIZE, np.uint8)])


def get_one(t: RedisTier, size: int = SIZE) -> list[bool]:
    return t.get_into([KEY], [np.empty(size, np.uint8)])


@pytest.mark.parametrize("length", [1 << 62, 1 << 63, 1 << 30, 10**30])
def test_set_reply_with_a_huge_bulk_length_is_a_dropped_save(length):
    with FakeResp(on(WRITES, b"$%d\r\n" % length)) as server:
        t = tier_for(server)
        assert bounded(lambda: put_one(t), 3.0) == [False]
        s = t.stats()
        assert s["puts_dropped"] == 1 and s["protocol_errors"] == 1 and s["puts"] == 0
        t.close()


@pytest.mark.parametrize("length", [1 << 62, 1 << 63, 1 << 30, HEADER_SIZE + SIZE + 1 << 20])
@pytest.mark.parametrize("size", [SIZE, SIZE + 100])  # the batched read, and the value-by-value one
def test_get_reply_longer_than_the_object_is_a_miss_without_allocating_it(length, size):
    with FakeResp(on((b"GET",), b"$%d\r\n" % length)) as server:
        t = tier_for(server)
        assert bounded(lambda: get_one(t, size), 3.0) == [False]
        assert t.stats()["protocol_errors"] == 1
        t.close()


@pytest.mark.parametrize(
    "commands, call", [(WRITES, put_one), ((b"GET",), get_one), ((b"MGET",), lambda t: t.exists([KEY]))]
)
def test_deeply_nested_arrays_are_a_failure_not_a_recursion_error(commands, call):
    with FakeResp(on(commands, b"*1\r\n" * 100_000 + b":1\r\n")) as server:
        t = tier_for(server)
        assert bounded(lambda: call(t), 3.0) == [False]
        t.close()


@pytest.mark.parametrize(
    "commands, call", [(WRITES, put_one), ((b"GET",), get_one), ((b"MGET",), lambda t: t.exists([KEY]))]
)
def test_a_line_without_end_is_cut_off_early(commands, call):
    """256 MiB offered without a CRLF: the client stops reading after its line cap, not at 256 MiB."""
    with FakeResp(lambda cmd: None) as server:
        server.respond = on(commands, endless(b"+", b"a" * MiB, 256 * MiB, server))
        t = tier_for(server, timeout_s=5)
        assert bounded(lambda: call(t), 6.0, peak_bytes=8 * MiB) == [False]
        assert t.stats()["protocol_errors"] == 1
        t.close()


@pytest.mark.parametrize(
    "commands, call, reply",
    [
        (
            (b"GET",),
            get_one,
            b"$%d\r\n" % (HEADER_SIZE + SIZE) + pack_header(KEY, SIZE, 0) + b"\0" * SIZE + b"\r\n",
        ),
        ((b"GET",), lambda t: get_one(t, SIZE + 100), b"$-1\r\n"),
        ((b"MGET",), lambda t: t.exists([KEY]), b"*1\r\n$1\r\n1\r\n"),
        (WRITES, put_one, b"+OK\r\n"),
    ],
)
def test_a_dripping_server_is_held_to_the_whole_call_deadline(commands, call, reply):
    """One byte every 0.2 s: with timeout_s=0.5 the call ends at its deadline (~0.5 s), where a
    per-receive timeout would wait as long as the server keeps dripping."""
    with FakeResp(lambda cmd: None) as server:
        server.respond = on(commands, drip(reply * 4, 0.2, server))
        t = tier_for(server)
        assert bounded(lambda: call(t), 1.8) == [False]
        assert t.stats()["timeouts"] == 1
        t.close()


def test_a_server_that_stops_reading_holds_a_put_no_longer_than_its_deadline():
    """A 64 MiB put to a server that never reads: the send waits at most the call's deadline
    (timeout_s + bytes at min_throughput_mib_s), not a socket timeout per partial send."""
    with FakeResp(lambda cmd: None) as server:
        server.respond = on(WRITES, lambda conn: server._stop.wait(10))  # then stop reading
        t = tier_for(server, min_throughput_mib_s=128)
        data = np.ones(64 * MiB, np.uint8)
        # the put checksums its values before sending them; on the numpy path that alone takes about a second
        # here, and it is not time spent waiting on the server, so the bound allows for it as measured
        began = time.monotonic()
        checksum(data[: 32 * MiB]), checksum(data[32 * MiB :])
        summing = time.monotonic() - began
        began = time.monotonic()
        assert t.put(["a", "b"], [data[: 32 * MiB], data[32 * MiB :]]) == [False, False]
        assert time.monotonic() - began < 0.5 + 0.5 + 1.5 + 2 * summing
        assert t.stats()["timeouts"] == 1
        t.close()


@pytest.mark.parametrize("reply", [b"*0\r\n", b":1\r\n", b"$2\r\nOK\r\n", b"+QUEUED\r\n", b"$0\r\n\r\n"])
def test_a_save_counts_as_stored_only_when_the_server_said_so(reply):
    """Replies that are well-formed RESP but not what MULTI/SET/EXEC answer: the save is dropped and
    counted, and the connection stays usable (the stream is still in step)."""
    with FakeResp(lambda cmd: reply) as server:
        t = tier_for(server)
        assert bounded(lambda: put_one(t), 3.0) == [False]
        s = t.stats()
        assert s["puts"] == 0 and s["puts_dropped"] == 1
        # a bulk where only a status can come is refused by length (protocol error, connection dropped)
        assert (
            s["unexpected_replies" if reply[:1] != b"$" or reply == b"$0\r\n\r\n" else "protocol_errors"] == 1
        )
        t.close()


def test_garbage_replies_never_raise_out_of_the_tier():
    """A spread of malformed replies to every command: each call returns (all misses or drops)."""
    garbage = [
        b"$-5\r\n",
        b"$abc\r\n",
        b"*-7\r\n",
        b"?\r\n",
        b"\r\n",
        b":99999999999999999999999999\r\n",
        b"$" + b"9" * 5000 + b"\r\n",
        b"*2\r\n*2\r\n*2\r\n$99999999999\r\n",
    ]
    for g in garbage:
        with FakeResp(lambda cmd, g=g: g) as server:
            t = tier_for(server)
            for call in (put_one, get_one, lambda t: get_one(t, SIZE + 100), lambda t: t.exists([KEY])):
                assert bounded(lambda call=call, t=t: call(t), 3.0) == [False], g
            t.close()


@pytest.mark.parametrize("when", [b"CLIENT", b"EVAL"])
def test_hostile_replies_to_redis_py_paths_never_raise(when):
    """Replies that redis-py parses (connection set-up; the repair after a miss) nested 100,000 deep:
    redis-py's parser recurses, but the tier's call still returns misses."""
    nested = b"*1\r\n" * 100_000 + b":1\r\n"

    def respond(cmd):
        if cmd[0].upper() == when:
            return nested
        return b"$-1\r\n" if cmd[0].upper() == b"GET" else b"+OK\r\n"

    with FakeResp(respond) as server:
        if when == b"CLIENT":
            import fake_resp

            server_setup = fake_resp._SETUP
            fake_resp._SETUP = server_setup - {b"CLIENT"}
        try:
            t = tier_for(server)
            assert bounded(lambda: get_one(t), 3.0) == [False]
            assert bounded(lambda: t.exists([KEY]), 3.0) == [False]
            t.close()
        finally:
            if when == b"CLIENT":
                fake_resp._SETUP = server_setup


def test_a_dripping_server_over_tls_is_held_to_the_whole_call_deadline(tmp_path):
    """TLS sockets have no descriptor shortcut: each receive and send gets what is left of the deadline
    as its timeout (and the socket's own timeout back after it)."""
    import ssl

    tls = make_tls_files(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tls.cert, tls.key)
    reply = b"$%d\r\n" % (HEADER_SIZE + SIZE) + pack_header(KEY, SIZE, 0) + b"\0" * SIZE + b"\r\n"
    with FakeResp(lambda cmd: None, tls=ctx) as server:
        server.respond = on((b"GET", b"MULTI", b"SET"), drip(reply * 4, 0.2, server))
        t = tier_for(server, tls_ca_file=str(tls.ca), connect_timeout_s=5)
        assert bounded(lambda: get_one(t), 1.8) == [False]
        assert bounded(lambda: put_one(t), 1.8) == [False]
        assert t.stats()["timeouts"] == 2
        t.close()
