"""Just enough RESP2 to run the shared tier's three hot paths (lookup, load, save) on redis-py's own
connections.

Why not redis-py's command API for these: it builds a Python object per reply element and a bytes
object per value. An 8,192-key lookup then costs ~30 ms of client CPU instead of ~1 ms, and a 4 MiB load
is copied twice before it reaches the caller's buffer. Here a lookup is one MGET whose reply is decoded
with numpy, and a load streams the value straight into the destination (`recv_into`). The rounds that
follow up on a call (MOVED/ASK followed, reads under a previous secret, the clean-up after misses) use it
too. Connecting, AUTH/ACL, TLS, timeouts, the connection pool and the cluster's topology stay redis-py's.

The client is bounded like a server: what it reads is limited by what it asked for (a reply longer than
the request can receive, an endless line, deep nesting is a ProtocolError before anything is allocated
on the server's word), and every wait ends at the call's deadline (`Wire.deadline`), not a timeout per
receive, so a server that drips bytes cannot stretch a call.

A `Wire` is made per checkout of a connection and must be drained before the connection goes back to
the pool; any error (timeout, short read, unexpected reply) means the stream position is unknown, so the
caller disconnects the connection instead of returning it.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from umbp.pool import native
from umbp.pool.checksum import as_rows, row_sums_into

CRLF = b"\r\n"
_COALESCE = 128 * 1024  # parts below this are copied into one send; larger ones go out as they are
_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)
_NATIVE_MIN_BUFFER = 64 * 1024  # the C read loop buffers up to 16 KiB at a time and wants twice that free
# Bounds a reply can never legitimately exceed (umbp's replies are status lines, short errors, nil, small
# arrays and bulks whose length the caller knows): a server past them is broken or hostile, and the
# connection is dropped instead of growing memory or recursing without end.
MAX_LINE = 64 * 1024  # a status, error or length line
MAX_BUFFER = 16 << 20  # the read buffer grows only for one reply longer than it (a long all-OK batch)
MAX_DEPTH = 4  # nested arrays (umbp reads EXEC's array of SET replies: depth 2)
MAX_ITEMS = 64  # elements of one array reply read through reply()


class ProtocolError(ConnectionError):
    """The reply did not have the expected shape: the connection must be dropped."""


class DeadlineError(TimeoutError):
    """The call's deadline passed while waiting for the server (a slow or dripping server)."""


@dataclass(frozen=True)
class ReplyError:
    """An error reply ('-MOVED 3999 127.0.0.1:7001', '-CLUSTERDOWN ...'); returned, not raised, so a
    pipeline's later replies can still be read."""

    message: str

    @property
    def redirect(self) -> bool:
        return self.message.startswith(("MOVED ", "ASK "))

    @property
    def ask(self) -> bool:
        return self.message.startswith("ASK ")

    @property
    def target(self) -> str | None:
        """The node a MOVED/ASK names ('host:port'), or None when the message is not one of them."""
        parts = self.message.split(" ")
        if len(parts) != 3 or not self.redirect or not parts[1].isdigit() or ":" not in parts[2]:
            return None
        return parts[2]


def command(*args: bytes | str | int) -> bytes:
    """One command as RESP (small arguments only)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def bulk(s: str) -> bytes:
    """One RESP bulk string."""
    b = s.encode()
    return b"$%d\r\n%s\r\n" % (len(b), b)


def bulk_keys(prefix: str, keys: Sequence[str]) -> bytes:
    """`$len\\r\\n<prefix><key>\\r\\n` for every key, concatenated. When all keys are ASCII and of one
    length (one model's keys are), this is a single C-level join instead of a Python loop per key."""
    if not keys:
        return b""
    if len(set(map(len, keys))) == 1 and prefix.isascii():
        n = len(keys[0]) + len(prefix)
        body = f"\r\n${n}\r\n{prefix}".join(keys)
        if body.isascii():  # then characters are bytes and every '$n' is right
            # bytes concatenation, not an f-string around the body: formatting a 1 MB str costs ~1 ms
            return f"${n}\r\n{prefix}".encode() + body.encode() + b"\r\n"
    parts = []
    for k in keys:
        kb = (prefix + k).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(kb), kb))
    return b"".join(parts)


def multi_key_command(name: bytes, prefix: str, keys: Sequence[str]) -> list[bytes]:
    """`name <prefix>k1 <prefix>k2 ...` (e.g. MGET over marker keys), as parts for `Wire.send`."""
    return [b"*%d\r\n$%d\r\n%s\r\n" % (len(keys) + 1, len(name), name), bulk_keys(prefix, keys)]


class Wire:
    """Buffered reads and scatter writes on one connected redis-py connection's socket."""

    def __init__(self, conn: Any, bufsize: int = 256 * 1024) -> None:
        sock = getattr(conn, "_sock", None)
        if sock is None:
            raise ConnectionError("umbp: redis connection is not connected")
        self.sock = sock
        self.gather = not isinstance(sock, ssl.SSLSocket) and hasattr(sock, "sendmsg")
        self.fd = _nonblocking_fd(sock) if self.gather else -1  # for _recv_into's first try
        self.timeout_ms = _timeout_ms(sock)
        self.deadline: float | None = None  # monotonic time by which the whole call must be done
        self.buf = bytearray(bufsize)
        self.mv = memoryview(self.buf)
        self.start = self.end = 0
        self._poll_in = self._poll_out = None
        if self.fd >= 0:
            self._poll_in, self._poll_out = select.poll(), select.poll()
            self._poll_in.register(self.fd, select.POLLIN)
            self._poll_out.register(self.fd, select.POLLOUT)

    @classmethod
    def of(cls, conn: Any) -> Wire:
        """The connection's Wire, kept on it between checkouts instead of a new 256 KiB buffer per call. A
        Wire is handed out again only when drained and on the same socket (a reconnect gets a new one);
        the descriptor shortcut is re-checked, since the socket's timeout decides whether it is safe."""
        wire = getattr(conn, "_umbp_wire", None)
        if wire is None or wire.sock is not getattr(conn, "_sock", None) or not wire.drained:
            wire = cls(conn)
            conn._umbp_wire = wire
        elif wire.gather and _nonblocking_fd(wire.sock) != wire.fd:
            wire = cls(conn)
            conn._umbp_wire = wire
        wire.deadline = None
        return wire

    # ---- the call's deadline --------------------------------------------------------------------------

    def left_s(self) -> float | None:
        """Seconds left before the deadline (None: no deadline, the socket's timeout applies per wait);
        raises DeadlineError once it has passed."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineError("umbp: the server did not complete the call within its deadline")
        return left

    def left_ms(self) -> int:
        """The C loop's wait budget: milliseconds to the deadline (at least 1), else the socket's timeout."""
        left = self.left_s()
        return self.timeout_ms if left is None else max(1, int(left * 1000 + 0.999))

    def _wait(self, poller: Any) -> None:
        """Wait until the descriptor is ready, at most until the deadline (or one socket timeout)."""
        left = self.left_s()
        wait_ms = self.timeout_ms if left is None else max(1, int(left * 1000 + 0.999))
        if not poller.poll(wait_ms):
            self.left_s()  # raises when the deadline is what ran out
            raise TimeoutError("umbp: timed out waiting for the server")

    def _blocking(self, op: Any, data: Any) -> Any:
        """op(data) on a socket without the descriptor shortcut (TLS): its timeout is cut to what is left
        of the deadline for this one operation, so none can outlast the call, and restored after it
        (redis-py uses the same connection later with its own timeout)."""
        left = self.left_s()
        if left is None or not hasattr(self.sock, "settimeout"):
            return op(data)
        before = self.sock.gettimeout()
        self.sock.settimeout(left if before is None else min(left, before))
        try:
            return op(data)
        finally:
            self.sock.settimeout(before)

    # ---- writing ------------------------------------------------------------------------------------

    def send(self, parts: Sequence[bytes | memoryview]) -> None:
        """Send parts in order without copying them: gathering writes (writev) on plain TCP; on TLS (no
        sendmsg) small parts are coalesced into one write and large ones written as they are. Either way
        a server that stops reading holds the call no longer than its deadline."""
        if self.gather:
            if self._poll_out is not None:
                self._writev_all(parts)
            else:
                _sendmsg_all(self.sock, parts)
            return
        send = self._sendall
        pending: list[bytes | memoryview] = []
        size = 0
        for p in parts:
            if len(p) >= _COALESCE:
                if pending:
                    send(b"".join(pending))
                    pending, size = [], 0
                send(p)
            else:
                pending.append(p)
                size += len(p)
                if size >= _COALESCE:
                    send(b"".join(pending))
                    pending, size = [], 0
        if pending:
            send(b"".join(pending))

    def _sendall(self, data: bytes | memoryview) -> None:
        """sendall in 256 KiB pieces, each bounded by what is left of the deadline (TLS sockets' sendall
        applies its timeout per internal write, so one call could outlast the deadline)."""
        view = memoryview(data).cast("B")
        for at in range(0, len(view), _COALESCE * 2):
            self._blocking(self.sock.sendall, view[at : at + _COALESCE * 2])

    def _writev_all(self, parts: Sequence[bytes | memoryview]) -> None:
        """sendall for a list of buffers on the non-blocking descriptor: writev what the socket takes,
        wait (bounded by the deadline) while it takes nothing, continue from where it stopped."""
        views = [memoryview(p) for p in parts if len(p)]
        i = 0
        while i < len(views):
            try:
                sent = os.writev(self.fd, views[i : i + _IOV_MAX])
            except BlockingIOError:
                self._wait(self._poll_out)
                continue
            i = _advance(views, i, sent)

    # ---- reading ------------------------------------------------------------------------------------

    @property
    def drained(self) -> bool:
        return self.start == self.end

    def _fill(self) -> None:
        if self.start > self.end:  # a parse step consumed more than was read: never grow or shift on it
            raise ProtocolError("umbp: the reply stream is out of step")
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            if self.start == 0:  # one reply longer than the buffer: grow it (a new buffer, since
                if 2 * len(self.buf) > MAX_BUFFER:  # numpy views of the old one may still exist)
                    raise ProtocolError("umbp: a reply is longer than any umbp expects")
                grown = bytearray(2 * len(self.buf))
                grown[: self.end] = self.buf
                self.buf, self.mv = grown, memoryview(grown)
            else:
                n = self.end - self.start
                self.buf[:n] = self.buf[self.start : self.end]
                self.start, self.end = 0, n
        got = self._recv_into(self.mv[self.end :])
        if not got:
            raise ConnectionError("umbp: the server closed the connection")
        self.end += got

    def _recv_into(self, view: memoryview) -> int:
        """recv_into, first without waiting: a socket with a timeout (redis-py's always have one) makes
        Python poll() before every receive, a second syscall even when the bytes are already there. A
        plain read of the non-blocking descriptor skips it; only when nothing has arrived yet does the
        descriptor waits in poll(), bounded by the call's deadline (or, without one, the socket's timeout).
        Other sockets (TLS) wait in their own recv_into, their timeout cut to the deadline."""
        if self.fd >= 0:
            while True:
                try:
                    return os.readv(self.fd, (view,))
                except BlockingIOError:
                    self._wait(self._poll_in)
        return self._blocking(self.sock.recv_into, view)

    def line(self) -> bytes:
        """The next line without its CRLF; a line longer than MAX_LINE is a protocol error (a server
        that never ends its line must not grow the buffer without bound)."""
        while True:
            i = self.buf.find(CRLF, self.start, min(self.end, self.start + MAX_LINE + 2))
            if i >= 0:
                out = bytes(self.mv[self.start : i])
                self.start = i + 2
                return out
            if self.end - self.start > MAX_LINE:
                raise ProtocolError("umbp: a reply line is longer than any umbp expects")
            self._fill()

    def take(self, n: int) -> bytes:
        """The next n bytes (n small: a value's header)."""
        while self.end - self.start < n:
            self._fill()
        out = bytes(self.mv[self.start : self.start + n])
        self.start += n
        return out

    def read_into(self, dst: memoryview) -> None:
        """Fill dst exactly: first from the buffer, then straight from the socket (no extra copy)."""
        n = len(dst)
        have = min(n, self.end - self.start)
        if have:
            dst[:have] = self.mv[self.start : self.start + have]
            self.start += have
        got = have
        while got < n:
            k = self._recv_into(dst[got:])
            if not k:
                raise ConnectionError("umbp: the server closed the connection")
            got += k

    def value_head(self, head: bytes, extra: int) -> bytes | None:
        """The hot path of a bulk reply whose length the caller knows: if the stream continues with
        exactly `head` ("$<len>" CRLF), consume it and return the `extra` bytes after it (a value's
        header); otherwise consume nothing and return None, for a reply-by-reply parse. Usually one
        buffer check instead of line() + int() + take(); reads more only while what is buffered still
        matches `head`, so it never waits for bytes that will not come."""
        start, n = self.start, len(head)
        if self.end - start >= n + extra and self.buf.startswith(head, start, self.end):
            self.start = start + n + extra
            return bytes(self.mv[start + n : start + n + extra])
        if not self.try_consume(head):
            return None
        return self.take(extra)

    def framed_payload(self, lead: bytes, field: int, tail: bytes, dst: memoryview) -> bytes | None:
        """The hot path of a bulk reply whose framing the caller knows, for a batch of small values: if
        the stream continues with `lead` ("$<len>" CRLF and the value's first bytes), `field` bytes of
        any content and `tail`, consume them, fill dst with the rest of the bulk and consume its CRLF;
        return the `field` bytes. Otherwise consume nothing and return None, for a reply-by-reply parse.
        One call per value instead of value_head + read_into + expect_crlf; like value_head, it reads
        more only while what is buffered still matches `lead` (after that the bulk's length is known)."""
        n = len(lead) + field + len(tail)
        if not (self.end - self.start >= n and self.buf.startswith(lead, self.start, self.end)):
            if not self._continues_with(lead):
                return None
            while self.end - self.start < n:
                self._fill()
        at = self.start + len(lead)
        if not self.buf.startswith(tail, at + field, self.end):
            return None
        out = bytes(self.mv[at : at + field])
        self.start = at + field + len(tail)
        self.read_into(dst)
        self.expect_crlf()
        return out

    def framed_payloads(
        self,
        lead: bytes,
        field: int,
        tails: Sequence[bytes],
        dsts: Sequence[np.ndarray],
        rows: np.ndarray,
        fields: bytearray,
        r0: int,
        r1: int,
    ) -> int:
        """framed_payload for replies r0..r1-1 of a batch of same-size values, each value's 4 KiB row
        sums (umbp.pool.checksum.row_sums_into) into rows[r] and its `field` bytes into fields[r * field:]. Returns
        the first reply not read: r1, or one that is not so framed (nothing of it consumed). On a plain
        TCP socket the C extension runs the whole loop without the GIL (receive, match, copy, sum);
        otherwise, and when it is not built, the same steps run here."""
        lib = native.lib
        if lib is not None and self.fd >= 0 and len(self.buf) >= _NATIVE_MIN_BUFFER:
            r, self.start, self.end, err, errnum = lib.read_frames(
                self.fd,
                self.left_ms(),
                self.buf,
                self.start,
                self.end,
                lead,
                field,
                tails,
                dsts,
                rows,
                fields,
                r0,
                r1,
            )
            if err:
                raise _stream_error(err, errnum)
            return r
        for r in range(r0, r1):
            got = self.framed_payload(lead, field, tails[r], memoryview(dsts[r]))
            if got is None:
                return r
            fields[r * field : (r + 1) * field] = got
            row_sums_into(as_rows(dsts[r]), rows[r])
        return r1

    def differs_from(self, expected: bytes) -> bool:
        """Whether the bytes already buffered show that the stream does not continue with `expected`
        (without reading): e.g. the next reply of a batch is a miss, not the framed value."""
        have = min(len(expected), self.end - self.start)
        return have > 0 and not self.buf.startswith(expected[:have], self.start, self.start + have)

    def _continues_with(self, expected: bytes) -> bool:
        """Whether the stream continues with `expected`, consuming nothing; reads more only while what
        is buffered still matches."""
        while not self.differs_from(expected):
            if self.end - self.start >= len(expected):
                return True
            self._fill()
        return False

    def discard(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            step = min(n, len(scratch))
            self.read_into(scratch[:step])
            n -= step

    def try_consume(self, expected: bytes) -> bool:
        """Consume `expected` if the stream continues with exactly it (the common all-OK replies of a
        batch, matched at once); otherwise consume nothing, for a reply-by-reply parse. Reads more only
        while what is buffered still matches, so it never waits for bytes that will not come."""
        if not self._continues_with(expected):
            return False
        self.start += len(expected)
        return True

    def expect_crlf(self) -> None:
        if self.buf.startswith(CRLF, self.start, self.end):  # the usual case: already buffered
            self.start += 2
            return
        if self.line() != b"":
            raise ProtocolError("umbp: a bulk reply did not end where its length said")

    def reply(self, max_bulk: int = MAX_LINE, max_items: int = MAX_ITEMS, depth: int = MAX_DEPTH) -> Any:
        """One reply: bytes (status/bulk), int, None, list, or ReplyError. Bounded like a server bounds
        requests: a bulk longer than `max_bulk`, an array of more than `max_items` elements or nested
        deeper than `depth` is a ProtocolError (the caller knows what it asked for; the server's claimed
        length is never allocated on trust)."""
        head = self.line()
        if not head:
            raise ProtocolError("umbp: empty reply line")
        kind, rest = head[:1], head[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return ReplyError(rest.decode(errors="replace"))
        if kind == b":":
            return parse_length(rest, 1 << 63, signed=True)
        if kind == b"$":
            n = parse_length(rest, max_bulk)
            if n < 0:
                return None
            out = bytearray(n)
            self.read_into(memoryview(out))
            self.expect_crlf()
            return bytes(out)
        if kind == b"*":
            n = parse_length(rest, max_items)
            if n >= 0 and depth <= 1:
                raise ProtocolError("umbp: a reply nests arrays deeper than any umbp expects")
            return None if n < 0 else [self.reply(max_bulk, max_items, depth - 1) for _ in range(n)]
        raise ProtocolError(f"umbp: unexpected reply type {kind[:1]!r}")

    def markers(self, n: int) -> np.ndarray | ReplyError:
        """Decode an MGET reply over n marker keys (values are the 1-byte '1') into a bool array."""
        head = self.line()
        if head.startswith(b"-"):
            return ReplyError(head[1:].decode(errors="replace"))
        if head != b"*%d" % n:
            raise ProtocolError(f"umbp: expected an array of {n} markers, got {head[:40]!r}")
        longest = n * len(_HIT)  # never look past this reply (the next ones of a pipeline may follow)
        while True:
            flags, used = scan_markers(bytes(self.mv[self.start : min(self.end, self.start + longest)]), n)
            if flags is not None:
                if used > self.end - self.start:  # scan_markers never claims more than it was given
                    raise ProtocolError("umbp: the reply stream is out of step")
                self.start += used
                return flags
            self._fill()


def parse_length(text: bytes, limit: int, signed: bool = False) -> int:
    """A RESP length (or integer): -1 (nil) or 0..limit; anything else (not a number, -2, a length past
    what the caller can receive) is a ProtocolError, never a huge allocation or an OverflowError."""
    if not (0 < len(text) <= 20) or not (text.isdigit() or (text[:1] == b"-" and text[1:].isdigit())):
        raise ProtocolError("umbp: a reply length is not a number")
    n = int(text)
    if n > limit or (n < -limit if signed else n < -1):
        raise ProtocolError(f"umbp: a reply claims {n} bytes or elements where at most {limit} can come")
    return n


def _nonblocking_fd(sock: Any) -> int:
    """The descriptor of a plain socket with a timeout (Python keeps it non-blocking, so a read on it
    never waits), or -1: a socket without a timeout blocks, and a read there could wait forever."""
    if isinstance(sock, socket.socket) and sock.gettimeout():
        return sock.fileno()
    return -1


def _timeout_ms(sock: Any) -> int:
    """The socket's timeout for the C loop's poll(), in whole milliseconds (at least 1)."""
    t = sock.gettimeout() if isinstance(sock, socket.socket) else None
    return max(1, int(t * 1000 + 0.999)) if t else -1


def _stream_error(err: int, errnum: int) -> OSError:
    """The exception the socket calls would have raised for read_frames' error code."""
    if err == 1:
        return ConnectionError("umbp: the server closed the connection")
    if err == 2:
        return DeadlineError("umbp: timed out waiting for the server's reply")
    if err == 3:
        return OSError(errnum, f"umbp: receive failed: {os.strerror(errnum)}")
    return ProtocolError("umbp: a bulk reply did not end where its length said")


def _sendmsg_all(sock: Any, parts: Sequence[bytes | memoryview]) -> None:
    """sendall for a list of buffers: sendmsg may send part of them; continue from where it stopped."""
    views = [memoryview(p) for p in parts if len(p)]
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i : i + _IOV_MAX]))


def _advance(views: list[memoryview], i: int, sent: int) -> int:
    """After a vectored send from views[i] took `sent` bytes: the index of the first buffer not wholly sent,
    that buffer trimmed to what is left of it."""
    while sent:
        n = views[i].nbytes
        if sent < n:
            views[i] = views[i][sent:]
            break
        sent -= n
        i += 1
    return i


_HIT, _MISS = b"$1\r\n1\r\n", b"$-1\r\n"


def scan_markers(data: bytes, n: int) -> tuple[np.ndarray | None, int]:
    """(present flags, bytes used) once `data` starts with all n elements, else (None, 0). Each element
    is '$1\r\n1\r\n' (present) or '$-1\r\n' (absent): two C-level replaces turn them into '1'/'0',
    so an 8,192-key reply decodes without a Python step per key. A '0' or '1' the server sent as such
    would read as an element too: the elements found are turned back into bytes and must be exactly
    what the reply starts with, or it is a ProtocolError."""
    t = data.replace(_HIT, b"1").replace(_MISS, b"0")
    done = len(t) - len(t.lstrip(b"01"))  # complete elements at the front
    lead = t[: min(done, n)]
    used = lead.replace(b"1", _HIT).replace(b"0", _MISS)  # '1' first: _MISS holds a '1', _HIT no '0'
    if not data.startswith(used):
        raise ProtocolError("umbp: a marker reply holds something other than marker elements")
    if done < n:
        if len(t) - done >= len(_HIT):  # not a partial element at the end: something else is there
            raise ProtocolError("umbp: a marker key holds something other than umbp's marker")
        return None, 0
    return np.frombuffer(lead, np.uint8) == ord("1"), len(used)
