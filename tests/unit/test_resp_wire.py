"""Wire's fast path for a value of known length (value_head, read_into, expect_crlf) on a scripted socket:
every split of the stream across receives, buffers smaller than one reply, the replies it must leave
untouched for the reply-by-reply parse, and truncated or garbled streams. No server needed."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

pytest.importorskip("redis")

from umbp.pool.checksum import as_rows, row_values  # noqa: E402
from umbp.pool.remote.format import (  # noqa: E402
    CHECKSUM_SIZE,
    HEADER_SIZE,
    header_after_checksum,
    header_before_checksum,
    pack_header,
)
from umbp.pool.remote.resp import ProtocolError, ReplyError, Wire  # noqa: E402


class ScriptedSocket:
    """Serves `data`, each receive returning at most the next of `steps` bytes (cycled); then EOF."""

    def __init__(self, data: bytes, steps: tuple[int, ...]) -> None:
        self.data, self.steps, self.pos, self.calls = data, steps, 0, 0

    def recv_into(self, buf: memoryview, nbytes: int = 0) -> int:
        step = self.steps[self.calls % len(self.steps)]
        self.calls += 1
        k = min(len(buf), step, len(self.data) - self.pos)
        buf[:k] = self.data[self.pos : self.pos + k]
        self.pos += k
        return k

    def sendmsg(self, parts: list[memoryview]) -> int:
        return sum(len(p) for p in parts)


class Conn:
    def __init__(self, sock: ScriptedSocket) -> None:
        self._sock = sock


def wire(data: bytes, steps: tuple[int, ...] = (1 << 30,), bufsize: int = 256 * 1024) -> Wire:
    return Wire(Conn(ScriptedSocket(data, steps)), bufsize=bufsize)


def head(n: int) -> bytes:
    return b"$%d\r\n" % (HEADER_SIZE + n)


def value_reply(key: str, payload: bytes) -> bytes:
    return head(len(payload)) + pack_header(key, len(payload), 0) + payload + b"\r\n"


def read_value(w: Wire, key: str, n: int) -> bytes | None:
    """What RedisTier._read_value does on the wire: the header, the payload into a buffer, the CRLF."""
    header = w.value_head(head(n), HEADER_SIZE)
    if header is None:
        return None
    assert header == pack_header(key, n, 0)
    out = np.zeros(n, np.uint8)
    w.read_into(memoryview(out))
    w.expect_crlf()
    return out.tobytes()


PAYLOADS = {"a": bytes(range(40)), "b": b"", "c": bytes(range(97, 97 + 26)) * 3}
STREAM = b"".join(value_reply(k, p) for k, p in PAYLOADS.items())


def splits(stream: bytes, *odd: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Receive schedules: one boundary at every offset of the stream, then the given odd-sized ones."""
    return [(cut, len(stream)) for cut in range(1, len(stream))] + list(odd)


@pytest.mark.parametrize("bufsize", [8, 64, 256 * 1024])
def test_values_split_at_every_offset(bufsize):
    """One receive boundary at every offset of the stream, then byte-by-byte and odd-sized receives."""
    for steps in splits(STREAM, (1,), (7,), (33, 2)):
        w = wire(STREAM, steps, bufsize)
        for key, payload in PAYLOADS.items():
            assert read_value(w, key, len(payload)) == payload, (steps, key)
        assert w.drained and w.sock.pos == len(STREAM), steps


@pytest.mark.parametrize(
    "other, parsed",
    [
        (b"$-1\r\n", None),  # absent
        (
            b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
            ReplyError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        ),
        (b"$3\r\nabc\r\n", b"abc"),  # another length, shorter digits
        (
            b"$" + str(HEADER_SIZE + 400).encode() + b"\r\n" + bytes(HEADER_SIZE + 400) + b"\r\n",
            bytes(HEADER_SIZE + 400),
        ),  # another length that starts like the expected one ($72 vs $432)
        (
            b"$" + str(HEADER_SIZE + 40).encode() + b"0\r\n" + bytes(HEADER_SIZE * 10 + 400) + b"\r\n",
            bytes(HEADER_SIZE * 10 + 400),
        ),  # the expected digits and one more
        (b"+OK\r\n", b"OK"),
    ],
)
def test_other_replies_are_left_whole_for_the_generic_parse(other, parsed):
    """value_head consumes nothing and never waits for bytes past a reply that is not the expected one:
    the stream ends right after it, so waiting would hit EOF and raise."""
    for steps in [(1 << 30,), (1,), (3,)]:
        w = wire(other, steps)
        assert w.value_head(head(40), HEADER_SIZE) is None
        assert w.reply() == parsed
        assert w.drained


def test_an_error_mid_batch_leaves_the_next_value_readable():
    stream = value_reply("a", b"x" * 40) + b"-ERR boom\r\n" + b"$-1\r\n" + value_reply("c", b"y" * 40)
    for steps in [(1 << 30,), (1,), (5, 11)]:
        w = wire(stream, steps)
        assert read_value(w, "a", 40) == b"x" * 40
        assert read_value(w, "b", 40) is None and w.reply() == ReplyError("ERR boom")
        assert read_value(w, "b", 40) is None and w.reply() is None
        assert read_value(w, "c", 40) == b"y" * 40
        assert w.drained


def test_a_truncated_stream_raises_at_every_cut():
    whole = value_reply("a", bytes(range(40)))
    for cut in range(len(whole)):
        for steps in [(1 << 30,), (1,)]:
            w = wire(whole[:cut], steps)
            with pytest.raises(ConnectionError):
                read_value(w, "a", 40)


def test_bytes_after_the_payload_must_be_crlf():
    w = wire(value_reply("a", b"z" * 40)[:-2] + b"XY\r\n")
    with pytest.raises(ProtocolError):
        read_value(w, "a", 40)


# ---- framed_payload: the batched get's one call per value ------------------------------------------

DIGEST = 0x1122334455667788


def framed_reply(key: str, payload: bytes, digest: int = DIGEST) -> bytes:
    return head(len(payload)) + pack_header(key, len(payload), digest) + payload + b"\r\n"


def read_framed(w: Wire, key: str, n: int) -> tuple[bytes, bytes] | None:
    """What RedisTier._read_same_size does on the wire for one value: (checksum field, payload)."""
    out = np.zeros(n, np.uint8)
    field = w.framed_payload(
        head(n) + header_before_checksum(n), CHECKSUM_SIZE, header_after_checksum(key), memoryview(out)
    )
    return None if field is None else (field, out.tobytes())


FRAMED = {"a": bytes(range(64)), "b": bytes(range(100, 164)), "c": bytes(range(7, 71))}
FRAMED_STREAM = b"".join(framed_reply(k, p) for k, p in FRAMED.items())


@pytest.mark.parametrize("bufsize", [8, 64, 256 * 1024])
def test_framed_values_split_at_every_offset(bufsize):
    for steps in splits(FRAMED_STREAM, (1,), (5,), (41, 3)):
        w = wire(FRAMED_STREAM, steps, bufsize)
        for key, payload in FRAMED.items():
            assert read_framed(w, key, len(payload)) == (DIGEST.to_bytes(8, "little"), payload), (steps, key)
        assert w.drained and w.sock.pos == len(FRAMED_STREAM), steps


def _other_header(key: str, n: int, at: int) -> bytes:
    """A value reply of the expected length whose header differs from the expected one at byte `at`."""
    header = bytearray(pack_header(key, n, DIGEST))
    header[at] ^= 0x40
    return head(n) + bytes(header) + bytes(n) + b"\r\n"


@pytest.mark.parametrize(
    "other",
    [
        b"$-1\r\n",
        b"-WRONGTYPE x\r\n",
        b"$3\r\nabc\r\n",
        b"+OK\r\n",
        head(64 + 1) + bytes(HEADER_SIZE + 65) + b"\r\n",  # another length
        _other_header("a", 64, 0),  # magic
        _other_header("a", 64, 4),  # version
        _other_header("a", 64, 9),  # length field
        _other_header("a", 64, 25),  # key crc (a value under another key)
        _other_header("a", 64, 30),  # reserved
    ],
)
def test_framed_leaves_any_other_reply_whole(other):
    """Anything but the expected value consumes nothing (the reply-by-reply parse then names it), and
    never waits for bytes past that reply; the value after it still reads."""
    for steps in [(1 << 30,), (1,), (3,)]:
        w = wire(other + framed_reply("b", FRAMED["b"]), steps)
        assert read_framed(w, "a", 64) is None
        assert w.reply() is not None or other == b"$-1\r\n"
        assert read_framed(w, "b", 64) == (DIGEST.to_bytes(8, "little"), FRAMED["b"])
        assert w.drained
        w = wire(other, steps)  # the stream ends right after the other reply: no wait for more
        assert read_framed(w, "a", 64) is None


def test_framed_truncated_stream_raises_at_every_cut():
    whole = framed_reply("a", FRAMED["a"])
    for cut in range(len(head(64)) + 1, len(whole)):  # past the head: the bulk's length is known
        for steps in [(1 << 30,), (1,)]:
            with pytest.raises(ConnectionError):
                read_framed(wire(whole[:cut], steps), "a", 64)


def test_framed_bytes_after_the_payload_must_be_crlf():
    with pytest.raises(ProtocolError):
        read_framed(wire(framed_reply("a", FRAMED["a"])[:-2] + b"XY\r\n"), "a", 64)


# ---- a real socket: the non-blocking read first, the timed wait second; the Wire kept per connection ---


class SockConn:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock


def test_real_socket_reads_what_is_there_and_waits_for_the_rest():
    """Bytes that are already there come from the descriptor without a wait; bytes that arrive later
    are waited for with the socket's timeout; EOF is a ConnectionError."""
    a, b = socket.socketpair()
    a.settimeout(5)
    w = Wire(SockConn(a))
    assert w.fd == a.fileno()
    stream = FRAMED_STREAM * 50
    b.sendall(stream[:1000])
    sender = threading.Timer(0.05, lambda: (b.sendall(stream[1000:]), b.shutdown(socket.SHUT_WR)))
    sender.start()
    try:
        for _ in range(50):
            for key, payload in FRAMED.items():
                assert read_framed(w, key, len(payload)) == (DIGEST.to_bytes(8, "little"), payload)
        with pytest.raises(ConnectionError):
            read_framed(w, "a", 64)
    finally:
        sender.join()
        a.close()
        b.close()


def test_real_socket_times_out_when_nothing_comes():
    a, b = socket.socketpair()
    a.settimeout(0.05)
    try:
        with pytest.raises(TimeoutError):
            read_framed(Wire(SockConn(a)), "a", 64)
    finally:
        a.close()
        b.close()


def test_wire_is_kept_per_connection_only_while_drained_and_on_the_same_socket():
    conn = SockConn(socket.socket())
    try:
        first = Wire.of(conn)
        assert Wire.of(conn) is first
        first.end = 3  # bytes left unread: never handed out again
        assert Wire.of(conn) is not first
        kept = Wire.of(conn)
        conn._sock.close()
        conn._sock = socket.socket()  # a reconnect
        assert Wire.of(conn) is not kept and Wire.of(conn).sock is conn._sock
    finally:
        conn._sock.close()


def test_markers_refuse_bare_digits_and_the_buffer_never_shifts_past_its_end():
    """An MGET reply of bare '1' bytes (not '$1\\r\\n1\\r\\n' elements) is a ProtocolError, not eight hits
    that move the read position past what was received; and should any step do that, the next fill
    refuses instead of resizing a buffer that numpy views may still hold (a BufferError)."""
    w = wire(b"*8\r\n11111111*1\r\n$1\r\n1\r\n", bufsize=16)
    with pytest.raises(ProtocolError):
        w.markers(8)
    w = wire(b"*1\r\n$1\r\n1\r\n*1\r\n$1\r\n1\r\n", bufsize=16)
    assert w.markers(1).tolist() == [True] and w.end == 16
    w.start = w.end + 4
    with pytest.raises(ProtocolError):
        w.markers(1)


def test_descriptor_shortcut_only_on_a_socket_with_a_timeout():
    """Without a timeout the descriptor blocks: the shortcut would wait forever, so it is not used
    (also not by a kept Wire whose socket lost its timeout)."""
    a, b = socket.socketpair()
    try:
        conn = SockConn(a)
        assert Wire.of(conn).fd == -1
        a.settimeout(1)
        assert Wire.of(conn).fd == a.fileno()
        a.settimeout(None)
        assert Wire.of(conn).fd == -1
    finally:
        a.close()
        b.close()


# ---- framed_payloads: a run of same-size values in one call (the C loop when built) ------------------

ROWS = 4096
BATCH = {
    f"key-{i}": np.random.default_rng(i).integers(0, 256, 3 * ROWS, dtype=np.uint8).tobytes()
    for i in range(12)
}
BATCH_STREAM = b"".join(framed_reply(k, p, digest=i) for i, (k, p) in enumerate(BATCH.items()))


def _feed(sock: socket.socket, data: bytes, step: int, pause: float = 0.0) -> threading.Thread:
    """Send data in pieces of `step` bytes from a thread (pausing between them), then close for writing."""
    import time

    def run() -> None:
        for i in range(0, len(data), step):
            sock.sendall(data[i : i + step])
            if pause:
                time.sleep(pause)
        sock.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _read_batch(w: Wire, keys: list[str], size: int, r0: int = 0, r1: int | None = None):
    """framed_payloads over keys[r0:r1]: (stop, payloads, fields, rows) as RedisTier._read_same_size reads them."""
    n = len(keys)
    dsts = [np.zeros(size, np.uint8) for _ in keys]
    rows = np.zeros((n, size // ROWS), np.uint64)
    fields = bytearray(n * CHECKSUM_SIZE)
    lead = head(size) + header_before_checksum(size)
    stop = w.framed_payloads(
        lead,
        CHECKSUM_SIZE,
        [header_after_checksum(k) for k in keys],
        dsts,
        rows,
        fields,
        r0,
        n if r1 is None else r1,
    )
    return stop, dsts, fields, rows


def _pair(timeout: float = 5.0) -> tuple[socket.socket, socket.socket, Wire]:
    a, b = socket.socketpair()
    a.settimeout(timeout)
    return a, b, Wire(SockConn(a))


@pytest.mark.parametrize("step, pause", [(1 << 20, 0.0), (1, 0.0), (4093, 0.0), (9000, 0.001), (60, 0.0)])
def test_framed_payloads_reads_a_batch_however_it_arrives(impl, step, pause):
    """Every value, checksum field and psum64 row value, whatever the receive boundaries; the buffer drained."""
    keys = list(BATCH)
    a, b, w = _pair()
    sender = _feed(b, BATCH_STREAM, step, pause)
    try:
        stop, dsts, fields, rows = _read_batch(w, keys, 3 * ROWS)
        assert stop == len(keys) and w.drained
        for i, key in enumerate(keys):
            assert dsts[i].tobytes() == BATCH[key]
            assert fields[i * 8 : i * 8 + 8] == i.to_bytes(8, "little")
            assert rows[i].tolist() == row_values(as_rows(dsts[i])).tolist()
    finally:
        sender.join()
        a.close()
        b.close()


@pytest.mark.parametrize(
    "other", [b"$-1\r\n", b"-ERR boom\r\n", b"$3\r\nabc\r\n", _other_header("key-3", 3 * ROWS, 25)]
)
def test_framed_payloads_stops_at_another_reply_and_goes_on_after_it(impl, other):
    """A reply that is not the expected value stops the run there, unconsumed and without waiting for more
    bytes (the sender has not closed: a wait would time out); after the generic parse the run goes on."""
    keys = list(BATCH)
    replies = [framed_reply(k, p, digest=i) for i, (k, p) in enumerate(BATCH.items())]
    first = b"".join(replies[:3]) + other
    a, b, w = _pair(timeout=5.0)
    try:
        b.sendall(first)
        import time

        t0 = time.monotonic()
        stop, dsts, _fields, _rows = _read_batch(w, keys, 3 * ROWS)
        assert stop == 3 and time.monotonic() - t0 < 2.0
        assert [d.tobytes() for d in dsts[:3]] == [BATCH[k] for k in keys[:3]]
        assert w.reply() is not None or other == b"$-1\r\n"
        assert w.drained
        b.sendall(b"".join(replies[4:]))
        stop, dsts, _fields, _rows = _read_batch(w, keys, 3 * ROWS, r0=4)
        assert stop == len(keys) and [d.tobytes() for d in dsts[4:]] == [BATCH[k] for k in keys[4:]]
    finally:
        a.close()
        b.close()


def test_framed_payloads_errors(impl):
    """EOF mid-value is a ConnectionError, silence a TimeoutError, bytes other than CRLF after a payload a
    ProtocolError: the caller then drops the connection."""
    keys = list(BATCH)
    one = framed_reply(keys[0], BATCH[keys[0]], digest=0)
    for cut in (len(head(3 * ROWS)) + 3, len(one) // 2, len(one) - 1):
        a, b, w = _pair()
        try:
            b.sendall(one[:cut])
            b.shutdown(socket.SHUT_WR)
            with pytest.raises(ConnectionError):
                _read_batch(w, keys[:1], 3 * ROWS)
        finally:
            a.close()
            b.close()
    a, b, w = _pair(timeout=0.05)
    try:
        b.sendall(one[:100])
        with pytest.raises(TimeoutError):
            _read_batch(w, keys[:1], 3 * ROWS)
    finally:
        a.close()
        b.close()
    a, b, w = _pair()
    try:
        b.sendall(one[:-2] + b"XY\r\n")
        with pytest.raises(ProtocolError):
            _read_batch(w, keys[:1], 3 * ROWS)
    finally:
        a.close()
        b.close()


class _Interrupted(Exception):
    pass


def test_framed_payloads_stops_at_once_on_a_signal_that_raises(impl):
    """A signal whose handler raises (Ctrl-C) ends a read that waits for the server at once, not at the
    socket timeout: the C loop runs Python's handlers when its wait is interrupted, as a recv would."""
    import signal
    import time

    def handler(signum, frame):
        raise _Interrupted

    keys = list(BATCH)
    one = framed_reply(keys[0], BATCH[keys[0]], digest=0)
    a, b, w = _pair(timeout=20.0)
    old = signal.signal(signal.SIGALRM, handler)
    try:
        b.sendall(one[:100])  # part of a value; the rest never comes
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        with pytest.raises(_Interrupted):
            _read_batch(w, keys[:1], 3 * ROWS)
        assert time.monotonic() - t0 < 5.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        a.close()
        b.close()
