"""RedisTier against a broken or hostile server (a scripted RESP server on 127.0.0.1): every behaviour is
a counted failure within a bounded time and bounded memory, never an exception out of put/get/exists.
Each runs on the C extension's read loop and on the pure-Python one (the `impl` fixture)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
pytest.importorskip("redis")

from fake_resp import FakeResp, drip, endless  # noqa: E402
from loopback import loopback_server  # noqa: E402
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
    """Replies nested 100,000 deep to the connection set-up (redis-py's parser recurses on them) and to
    the repair after a miss (refused by umbp's codec): the tier's call still returns misses."""
    nested = b"*1\r\n" * 100_000 + b":1\r\n"

    def respond(cmd):
        if cmd[0].upper() == when:
            return nested
        return b"$-1\r\n" if cmd[0].upper() == b"GET" else b"+OK\r\n"

    with FakeResp(respond) as server, setup_answered_by_respond(when):
        t = tier_for(server)
        assert bounded(lambda: get_one(t), 3.0) == [False]
        assert bounded(lambda: t.exists([KEY]), 3.0) == [False]
        t.close()


@contextlib.contextmanager
def setup_answered_by_respond(command: bytes) -> Iterator[None]:
    """The fake server answers connection set-up commands +OK itself; this one goes to its respond."""
    import fake_resp

    setup = fake_resp._SETUP
    fake_resp._SETUP = setup - {command}
    try:
        yield
    finally:
        fake_resp._SETUP = setup


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


# ---- the rounds after a call's replies: repair, previous secrets, redirects; remove and clear ------------


def miss_then(reply: Any, on_eval: Any = b":0\r\n") -> Callable[[list[bytes]], Any]:
    """GET answers nil the first time (a miss, so the repair runs), `reply` after that; EVAL (the repair)
    answers `on_eval`."""
    gets = []

    def respond(cmd: list[bytes]) -> Any:
        name = cmd[0].upper()
        if name == b"GET":
            gets.append(cmd)
            return b"$-1\r\n" if len(gets) == 1 else reply
        return on_eval if name == b"EVAL" else b"+OK\r\n"

    return respond


@pytest.mark.parametrize("reply", [b"+OK\r\n", b"$3\r\nabc\r\n", b"*1\r\n:1\r\n"])
def test_a_repair_answered_with_anything_but_a_count_removes_nothing(reply):
    """The clean-up after a miss (a script per key) answers a count; a status, a bulk or an array there
    counted as nothing removed, never an exception out of get_into."""
    with FakeResp(miss_then(b"$-1\r\n", on_eval=reply)) as server:
        t = tier_for(server)
        assert bounded(lambda: get_one(t), 3.0) == [False]
        s = t.stats()
        assert s["misses_absent"] == 1 and s["stale_markers_removed"] == 0
        t.close()


def test_a_dripping_repair_is_held_to_the_call_deadline():
    """The clean-up after a miss is a round of the same call: a server dripping its reply (a byte every
    0.2 s, inside the 0.5 s per-receive timeout) holds get_into no longer than the call's deadline."""
    with FakeResp(lambda cmd: None) as server:
        server.respond = miss_then(b"$-1\r\n", on_eval=drip(b":" + b"0" * 12 + b"\r\n", 0.2, server))
        t = tier_for(server)
        assert bounded(lambda: get_one(t), 1.8) == [False]
        assert t.stats()["timeouts"] == 1
        t.close()


def test_a_repair_answered_with_a_huge_bulk_is_refused_unread():
    """A 128 MiB bulk where a count belongs: refused at its length line, nothing of it buffered."""
    with FakeResp(lambda cmd: None) as server:
        server.respond = miss_then(
            b"$-1\r\n", on_eval=endless(b"$%d\r\n" % (128 * MiB), b"x" * MiB, 128 * MiB, server)
        )
        t = tier_for(server, timeout_s=2)
        assert bounded(lambda: get_one(t), 3.0) == [False]
        assert t.stats()["protocol_errors"] == 1
        t.close()


@pytest.fixture
def rotated(monkeypatch):
    """Options of a tier in a key rotation: a current secret and a previous one."""
    monkeypatch.setenv("UMBP_TEST_HOSTILE_NEW", "new-secret-0123456789abcdef0123")
    monkeypatch.setenv("UMBP_TEST_HOSTILE_OLD", "old-secret-0123456789abcdef0123")
    return {"auth_key_env": "UMBP_TEST_HOSTILE_NEW", "auth_old_key_envs": ["UMBP_TEST_HOSTILE_OLD"]}


@pytest.mark.parametrize("reply", ["int", "huge"])
def test_a_read_under_a_previous_secret_is_bounded_like_any_load(rotated, reply):
    """A miss under the current secret is read again under the previous one: an integer there, or a bulk
    longer than the object, is a miss like on the first read (never an exception, nothing allocated on
    the claim's word)."""
    with FakeResp(lambda cmd: None) as server:
        huge = endless(b"$%d\r\n" % (128 * MiB), b"x" * MiB, 128 * MiB, server)
        server.respond = miss_then(b":5\r\n" if reply == "int" else huge)
        t = tier_for(server, timeout_s=2, **rotated)
        assert bounded(lambda: get_one(t), 3.0) == [False]
        assert t.stats()["old_key_hits"] == 0
        t.close()


@pytest.mark.parametrize("call", ["exists", "get_into"])
def test_reads_under_a_previous_secret_are_held_to_the_call_deadline(rotated, call):
    """The current namespace answers at once (absent); the previous secret's round drips."""
    with FakeResp(lambda cmd: None) as server:
        seen = []

        def respond(cmd):
            name = cmd[0].upper()
            if name not in (b"GET", b"MGET", b"EXISTS"):
                return b":0\r\n" if name == b"EVAL" else b"+OK\r\n"
            seen.append(name)
            if len(seen) == 1:
                return b"*1\r\n$-1\r\n" if name == b"MGET" else b"$-1\r\n"
            return drip(b":1\r\n" * 4, 0.2, server)

        server.respond = respond
        t = tier_for(server, **rotated)
        do = (lambda: t.exists([KEY])) if call == "exists" else (lambda: get_one(t))
        assert bounded(do, 1.8) == [False]
        assert t.stats()["timeouts"] == 1
        t.close()


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def cluster_of_one(server: FakeResp, get: Callable[[int], Any]) -> Callable[[list[bytes]], Any]:
    """A one-node cluster on the fake server (every slot its own): `get(n)` answers the n-th GET (from 1)."""
    gets = []

    def respond(cmd: list[bytes]) -> Any:
        name = cmd[0].upper()
        if name == b"CLUSTER":
            node = b"*3\r\n" + _bulk(b"127.0.0.1") + b":%d\r\n" % server.port + _bulk(b"a" * 40)
            return b"*1\r\n*3\r\n:0\r\n:16383\r\n" + node
        if name == b"COMMAND":
            specs = [(b"get", 2, 1, 1, 1), (b"set", -3, 1, 1, 1), (b"mget", -2, 1, -1, 1)]
            return b"*%d\r\n" % len(specs) + b"".join(
                b"*6\r\n" + _bulk(n) + b":%d\r\n*0\r\n:%d\r\n:%d\r\n:%d\r\n" % (a, f, last, step)
                for n, a, f, last, step in specs
            )
        if name == b"GET":
            gets.append(cmd)
            return get(len(gets))
        return b":0\r\n" if name == b"EVAL" else b"+OK\r\n"

    return respond


@pytest.mark.parametrize("reply", ["int", "huge", "drip"])
def test_a_followed_redirect_is_bounded_like_the_first_read(reply):
    """A cluster's MOVED is followed with the tier's own codec: an integer where a value belongs, a bulk
    longer than the object or a dripping reply on the second read are a miss within the call's deadline
    and without allocating the claim, like on the first read."""
    with FakeResp(lambda cmd: None) as server:
        second = {
            "int": b":5\r\n",
            "huge": endless(b"$%d\r\n" % (128 * MiB), b"x" * MiB, 128 * MiB, server),
            "drip": drip(b"$-1\r\n" * 4, 0.2, server),
        }[reply]
        moved = b"-MOVED 1234 127.0.0.1:%d\r\n" % server.port
        server.respond = cluster_of_one(server, lambda n: moved if n == 1 else second)
        t = tier_for(server, cluster=True)
        assert bounded(lambda: get_one(t), 1.8) == [False]
        assert t.stats()["redirects"] == 1
        t.close()


def test_a_redirect_to_a_node_outside_the_cluster_is_not_followed():
    """MOVED naming an address the cluster's own topology does not list: a miss, and nothing connects
    there (a hostile node must not steer the client to a host of its choosing)."""
    import socket

    with socket.create_server(("127.0.0.1", 0), backlog=8) as elsewhere:
        elsewhere.setblocking(False)
        with FakeResp(lambda cmd: None) as server:
            moved = b"-MOVED 1234 127.0.0.1:%d\r\n" % elsewhere.getsockname()[1]
            server.respond = cluster_of_one(server, lambda n: moved)
            t = tier_for(server, cluster=True)
            assert bounded(lambda: get_one(t), 1.8) == [False]
            with pytest.raises(BlockingIOError):
                elsewhere.accept()
            t.close()


def test_a_marker_reply_of_bare_digits_is_refused():
    """'1' bytes where '$1\\r\\n1\\r\\n' elements belong are not markers: a protocol error, not three
    hits (and never a read position past what was received)."""
    with FakeResp(on((b"MGET",), b"*3\r\n111")) as server:
        t = tier_for(server)
        keys = [KEY[:-1] + c for c in "abc"]
        assert bounded(lambda: t.exists(keys), 3.0) == [False] * 3
        assert t.stats()["protocol_errors"] == 1
        t.close()


@pytest.mark.parametrize(
    "command, reply, counted",
    [
        (b"UNLINK", b"+OK\r\n", "unexpected_replies"),
        (b"UNLINK", b"$1\r\n1\r\n", "unexpected_replies"),
        (b"UNLINK", b"*1\r\n" * 100_000 + b":1\r\n", "reply_errors"),
        (b"SCAN", b":5\r\n", "reply_errors"),
        (b"SCAN", b"*1\r\n" * 100_000 + b":1\r\n", "reply_errors"),
    ],
)
def test_remove_and_clear_never_raise_on_an_odd_reply(command, reply, counted):
    """remove and clear go through redis-py: a reply of another type, or one its parser recurses on, is
    counted (and nothing counted as removed), never an exception."""
    with FakeResp(on((command,), reply)) as server:
        t = tier_for(server)
        if command == b"UNLINK":
            assert bounded(lambda: t.remove([KEY]), 3.0) == 0
        else:
            assert bounded(lambda: t.clear(), 3.0) is None
        assert t.stats()[counted] == 1
        t.close()


@pytest.mark.parametrize(
    "command, reply",
    [
        (b"UNLINK", b":" + b"0" * 40 + b"1\r\n"),  # ~8.8 s of it
        (b"SCAN", b"*2\r\n$1\r\n0\r\n*0\r\n"),  # ~3.2 s
    ],
)
def test_remove_and_clear_are_held_to_timeout_s_per_reply_against_a_dripping_server(command, reply):
    """remove and clear read their replies through redis-py, whose socket timeout bounds each receive:
    a server dripping a reply (a byte every 0.2 s, inside timeout_s=0.5) held the call for as long as it
    dripped. Each reply is held to timeout_s from the start of its read: the call ends after ~0.5 s,
    counted, nothing removed on the server's word."""
    with FakeResp(lambda cmd: None) as server:
        server.respond = on((command,), drip(reply * 2, 0.2, server))
        t = tier_for(server)
        if command == b"UNLINK":
            assert bounded(lambda: t.remove([KEY]), 1.8) == 0
        else:
            assert bounded(lambda: t.clear(), 1.8) is None
        assert t.stats()["reply_errors"] == 1
        t.close()


def test_reserved_header_bytes_must_be_zero(rotated):
    """The header's reserved bytes are covered by neither the checksum nor, as stored, the tag (a sealed
    value's tag takes them as zero): a value with anything else there is a miss, not a hit."""
    payload = np.ones(SIZE, np.uint8)
    plain = bytearray(pack_header(KEY, SIZE, checksum(payload)))
    plain[28] = 1
    with FakeResp(lambda cmd: None) as server:
        sealed_tier = tier_for(server, **rotated)
        header, stored = sealed_tier._codec.seal(KEY, payload, None)
        sealed = bytearray(header)
        sealed[18] = 1
        for t, head in ((tier_for(server), plain), (sealed_tier, sealed)):
            value = bytes(head) + stored.tobytes()
            server.respond = on((b"GET",), b"$%d\r\n%s\r\n" % (len(value), value))
            out = np.zeros(SIZE, np.uint8)
            assert bounded(lambda t=t, out=out: t.get_into([KEY], [out]), 3.0) == [False]
            assert t.stats()["header_failures"] == 1
            t.close()


def _dripping_topology(server: FakeResp, after: int = 0) -> Callable[[list[bytes]], Any]:
    """A one-node cluster whose topology replies drip (one byte every 0.3 s) from the (after+1)-th
    CLUSTER command on; GETs answer MOVED to a node the topology does not list yet."""
    normal = cluster_of_one(server, lambda n: b"-MOVED 1234 127.0.0.2:%d\r\n" % server.port)
    asked = []

    def respond(cmd: list[bytes]) -> Any:
        if cmd[0].upper() == b"CLUSTER":
            asked.append(cmd)
            if len(asked) > after:
                return drip(normal(cmd), 0.3, server)
        return normal(cmd)

    return respond


def test_a_dripping_topology_holds_the_first_call_no_longer_than_its_timeouts():
    """A cluster's topology is read by redis-py, whose socket timeout bounds each read, not a reply: a
    node dripping its CLUSTER SLOTS reply held the first lookup for as long as it dripped. The topology
    is read off the caller's thread: the caller waits at most connect_timeout_s + timeout_s, then the
    call is a miss."""
    with FakeResp(lambda cmd: None) as server:
        server.respond = _dripping_topology(server)
        t = tier_for(server, cluster=True)
        assert bounded(lambda: t.exists([KEY]), 1.8) == [False]
        assert bounded(lambda: get_one(t), 1.8) == [False]
        t.close()


def test_a_dripping_topology_reread_after_a_redirect_holds_no_call():
    """A MOVED to a node the topology does not list re-reads the topology; a dripping reply to that
    re-read holds the call no longer than its deadline (a miss), nor the calls after it."""
    with FakeResp(lambda cmd: None) as server:
        server.respond = _dripping_topology(server, after=2)
        t = tier_for(server, cluster=True)
        for _ in range(3):
            assert bounded(lambda: get_one(t), 1.8) == [False]
            time.sleep(0.6)  # past the re-read's rate limit
        t.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_reads_the_topology_on_a_thread_of_its_own():
    """A child forked while the parent's topology thread is busy (its first read dripping) has no such
    thread: it starts its own, and connects."""
    with FakeResp(lambda cmd: None) as server:
        first = _dripping_topology(server)
        asked = []

        def respond(cmd: list[bytes]) -> Any:  # only the parent's first topology read drips
            if cmd[0].upper() == b"CLUSTER":
                asked.append(cmd)
                if len(asked) > 1:
                    return cluster_of_one(server, lambda n: b"$-1\r\n")(cmd)
            return first(cmd)

        server.respond = respond
        t = tier_for(server, cluster=True)
        assert t.exists([KEY]) == [False]  # the parent's read still drips
        pid = os.fork()
        if pid == 0:
            try:
                t.exists([KEY])
                os._exit(0 if t._backend._rc is not None else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        t.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_a_dripping_connection_setup_is_held_to_the_timeout(cluster):
    """redis-py sets a new connection up (CLIENT SETNAME, AUTH, ...) with its per-receive timeout: a
    server dripping that reply held the call that needed the connection for as long as it dripped.
    The set-up after the TCP connect is held to timeout_s as a whole; then the call is a miss."""
    with FakeResp(lambda cmd: None) as server:
        slow = drip(b"-ERR " + b"x" * 200 + b"\r\n", 0.05, server)
        normal = cluster_of_one(server, lambda n: b"$-1\r\n") if cluster else (lambda cmd: b"+OK\r\n")
        server.respond = lambda cmd: slow if cmd[0].upper() == b"CLIENT" else normal(cmd)
        with setup_answered_by_respond(b"CLIENT"):
            t = tier_for(server, cluster=cluster)
            assert bounded(lambda: get_one(t), 2.5) == [False]
            t.close()


@contextlib.contextmanager
def dripping_tls_handshake() -> Iterator[str]:
    """A TCP server that answers a TLS ClientHello with a record header promising 16 KiB, then sends
    that record a byte every 50 ms; yields its rediss:// URL."""

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.recv(1 << 16)
        conn.sendall(b"\x16\x03\x03\x40\x00")
        while not stop.wait(0.05):
            conn.sendall(b"\x02")

    with loopback_server(answer, threaded=True) as port:
        yield f"rediss://127.0.0.1:{port}/0"


def test_a_dripping_tls_handshake_is_held_to_the_connect_timeout(tmp_path):
    """The TLS handshake is redis-py's, under the socket timeout connect_timeout_s, which CPython's ssl
    applies to the handshake as a whole (not per receive): a server dripping its handshake (here ~14
    min of it) costs the call that needed a new connection connect_timeout_s, then it is a miss."""
    tls = make_tls_files(tmp_path)
    with dripping_tls_handshake() as url:
        opts = {"url": url, "tls_ca_file": str(tls.ca), "timeout_s": 0.5, "connect_timeout_s": 0.5}
        t = RedisTier(RemoteConfig.from_options({**opts, "quarantine_s": 0, "retry_interval_s": 0}))
        assert bounded(lambda: get_one(t), 2.5) == [False]
        assert bounded(lambda: put_one(t), 2.5) == [False]
        t.close()


def _streaming_topology(server: FakeResp) -> Callable[[list[bytes]], Any]:
    """A one-node cluster whose CLUSTER SLOTS reply is a node address claimed to be ~10 GB long, sent
    as fast as the client reads it (up to 256 MiB)."""
    normal = cluster_of_one(server, lambda n: b"$-1\r\n")
    head = b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9999999999\r\n"

    def respond(cmd: list[bytes]) -> Any:
        if cmd[0].upper() == b"CLUSTER":
            return endless(head, b"x" * (1 << 16), 256 * MiB, server)
        return normal(cmd)

    return respond


def test_an_endless_topology_reply_is_cut_off_in_bounded_memory():
    """redis-py's parser keeps what a node sends until the claimed length has arrived, and its socket
    timeout bounds each receive, not a reply: a node streaming its CLUSTER SLOTS reply grew the topology
    thread's memory for as long as it streamed (256 MiB here, then the stream's end). Each reply redis-py
    parses is held to MAX_REPLY_BYTES; the lookup is a miss."""
    from umbp.pool.remote.backend import MAX_REPLY_BYTES

    with FakeResp(lambda cmd: None) as server:
        server.respond = _streaming_topology(server)
        t = tier_for(server, cluster=True)

        def lookup_then_wait() -> list[bool]:
            out = t.exists([KEY])
            time.sleep(1.5)  # the topology thread reads on after the call has given up
            return out

        assert bounded(lookup_then_wait, 4.0, peak_bytes=4 * MAX_REPLY_BYTES) == [False]
        t.close()
