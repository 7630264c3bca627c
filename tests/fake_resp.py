"""A scripted RESP server on 127.0.0.1 for hostile-server tests: it parses the client's commands, answers
redis-py's connection set-up (CLIENT SETNAME/SETINFO, HELLO, AUTH, PING, SELECT) with +OK, and hands every
other command to the test's `respond` function, which returns the reply bytes to send, a callable that
writes to the socket itself (a dripping or endless server), or None to read on without answering."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

HOST = "127.0.0.1"
_SETUP = {b"CLIENT", b"HELLO", b"AUTH", b"PING", b"SELECT"}

Respond = Callable[[list[bytes]], "bytes | Callable[[socket.socket], None] | None"]


class FakeResp:
    """One listening socket; each client connection is served by a daemon thread until it closes or the
    server is stopped. Use as a context manager."""

    def __init__(
        self, respond: Respond, read_commands: bool = True, tls: ssl.SSLContext | None = None
    ) -> None:
        self.respond, self.read_commands, self.tls = respond, read_commands, tls
        self.commands: list[list[bytes]] = []
        self._listener = socket.create_server((HOST, 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{HOST}:{self.port}/0"

    def __enter__(self) -> FakeResp:
        self._accepting.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._accepting.join(5)
        for t in self._threads:
            t.join(5)
        self._listener.close()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        if self.tls is not None:
            conn.settimeout(5)
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except OSError:
                conn.close()
                return
        conn.settimeout(0.1)
        reader = _Reader(conn, self._stop)
        try:
            while not self._stop.is_set():
                cmd = reader.command()
                if cmd is None:
                    return
                if cmd[0].upper() in _SETUP:
                    conn.sendall(b"+OK\r\n")
                    continue
                self.commands.append(cmd)
                out = self.respond(cmd)
                if callable(out):
                    out(conn)
                elif out:
                    conn.sendall(out)
        except OSError:
            pass
        finally:
            conn.close()


class _Reader:
    """Reads RESP arrays of bulk strings (what clients send) from a socket with a short timeout, so the
    serving thread notices the server stopping."""

    def __init__(self, conn: socket.socket, stop: threading.Event) -> None:
        self.conn, self.stop, self.buf = conn, stop, bytearray()

    def _more(self) -> bool:
        while not self.stop.is_set():
            try:
                got = self.conn.recv(1 << 20)
            except TimeoutError:
                continue
            if not got:
                return False
            self.buf += got
            return True
        return False

    def _line(self) -> bytes | None:
        while (i := self.buf.find(b"\r\n")) < 0:
            if not self._more():
                return None
        out = bytes(self.buf[:i])
        del self.buf[: i + 2]
        return out

    def _exactly(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not self._more():
                return None
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def command(self) -> list[bytes] | None:
        head = self._line()
        if head is None or not head.startswith(b"*"):
            return None
        args = []
        for _ in range(int(head[1:])):
            size = self._line()
            if size is None:
                return None
            arg = self._exactly(int(size[1:]) + 2)
            if arg is None:
                return None
            args.append(arg[:-2])
        return args


def drip(data: bytes, every_s: float, server: FakeResp) -> Callable[[socket.socket], None]:
    """A reply sent one byte every `every_s` seconds (until the server stops or the client leaves)."""

    def send(conn: socket.socket) -> None:
        for b in data:
            if server.stopping:
                return
            conn.sendall(bytes([b]))
            server._stop.wait(every_s)

    return send


def endless(prefix: bytes, chunk: bytes, limit: int, server: FakeResp) -> Callable[[socket.socket], None]:
    """`prefix`, then `chunk` repeated up to `limit` bytes (or until the client stops reading)."""

    def send(conn: socket.socket) -> None:
        conn.settimeout(2.0)
        conn.sendall(prefix)
        sent = 0
        while sent < limit and not server.stopping:
            conn.sendall(chunk)
            sent += len(chunk)

    return send
