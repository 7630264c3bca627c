"""A TCP server on 127.0.0.1 for tests that script a peer below any protocol library: each accepted
connection is handed to `handle` (on a thread of its own with `threaded`, else on the accept thread),
and closed after it returns. Use as a context manager; it yields the port."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Handle = Callable[[socket.socket, threading.Event], None]


@contextmanager
def loopback_server(handle: Handle, threaded: bool = False) -> Iterator[int]:
    """`handle(conn, stop)`: `stop` is set when the server closes; an OSError from it (the client gave up)
    ends that connection only."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        with conn:
            try:
                handle(conn, stop)
            except OSError:
                pass

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            if threaded:
                threading.Thread(target=serve_one, args=(conn,), daemon=True).start()
            else:
                serve_one(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(15)
        listener.close()
