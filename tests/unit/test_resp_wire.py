"""Wire's fast path for a value of known length (value_head, read_into, expect_crlf) on a scripted socket:
every split of the stream across receives, buffers smaller than one reply, the replies it must leave
untouched for the reply-by-reply parse, and truncated or garbled streams. No server needed."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("redis")

from umbp.pool.remote_format import HEADER_SIZE, pack_header  # noqa: E402
from umbp.pool.resp import ProtocolError, ReplyError, Wire  # noqa: E402


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


@pytest.mark.parametrize("bufsize", [8, 64, 256 * 1024])
def test_values_split_at_every_offset(bufsize):
    """One receive boundary at every offset of the stream, then byte-by-byte and odd-sized receives."""
    splits = [(cut, len(STREAM)) for cut in range(1, len(STREAM))] + [(1,), (7,), (33, 2)]
    for steps in splits:
        w = wire(STREAM, steps, bufsize)
        for key, payload in PAYLOADS.items():
            assert read_value(w, key, len(payload)) == payload, (steps, key)
        assert w.drained and w.sock.pos == len(STREAM), steps


@pytest.mark.parametrize("other, parsed", [
    (b"$-1\r\n", None),  # absent
    (b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
     ReplyError("WRONGTYPE Operation against a key holding the wrong kind of value")),
    (b"$3\r\nabc\r\n", b"abc"),  # another length, shorter digits
    (b"$" + str(HEADER_SIZE + 400).encode() + b"\r\n" + bytes(HEADER_SIZE + 400) + b"\r\n",
     bytes(HEADER_SIZE + 400)),  # another length that starts like the expected one ($72 vs $432)
    (b"$" + str(HEADER_SIZE + 40).encode() + b"0\r\n" + bytes(HEADER_SIZE * 10 + 400) + b"\r\n",
     bytes(HEADER_SIZE * 10 + 400)),  # the expected digits and one more
    (b"+OK\r\n", b"OK"),
])
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
