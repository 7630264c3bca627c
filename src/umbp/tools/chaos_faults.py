"""The fault injectors of `umbp chaos` (umbp.tools.chaos): what they damage, and how, on each tier.

Every injector damages one object a restore is about to read (a `Target`: the scheduler has already
decided to load it, from DRAM, the SSD tier or the shared Redis tier), on the medium itself:

* DRAM: the bytes of the worker's arena slot (the worker verifies them against the digest it recorded);
* SSD: the record's bytes in its segment file, through a second file descriptor (the tier reads the disk);
* Redis: the value key, through a direct client (not through umbp), or the replies on the wire, through
  `ManglingProxy`, a TCP proxy on 127.0.0.1 that umbp is pointed at instead of the server.

Some kinds are NOT defended by today's checks, and the campaign keeps them on purpose (see
chaos.UNDEFENDED): psum64 sums the 8-byte words of each 4 KiB row before weighting the rows, so swapping two
words inside a row keeps the checksum ("reordered"); and a co-tenant who can read one value can relabel
it under another key of the same size ("forged": the header's key CRC is public arithmetic, no secret).
"""

from __future__ import annotations

import os
import random
import re
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from umbp.tools.local_redis import LocalRedis

ROW = 4096  # psum64's row: the words of a row are summed unweighted
KEY_CRC_AT = 24  # the shared tier's value header: crc32 of the key at bytes 24..28 (remote_format)
VALUE_HEADER = 32
DRIP_S = 1.5  # how long the dripping proxy holds a reply before it gives up and closes


@dataclass
class Target:
    """One object the scheduler just decided to load: its logical and rank key, and where it comes from."""

    logical: str
    group: int
    rank_key: str
    source: str  # "dram" | "ssd" | "remote"
    offset: int  # arena slot (DRAM loads), else -1
    nbytes: int


class RedisServer(LocalRedis):
    """A redis-server on a fixed loopback port that can be killed (-9) and started again on that port,
    empty (no persistence): the shared tier's "server lost its data and came back"."""

    def __init__(self) -> None:
        super().__init__("umbp chaos", prefix="umbp-chaos-redis-")

    def stop(self) -> None:
        self.kill()
        super().stop()


_BULK = re.compile(rb"\$(\d{4,})\r\n")  # a bulk reply of >= 1000 bytes: a stored value, not a status


class ManglingProxy:
    """A TCP proxy on 127.0.0.1 in front of the Redis server. `arm(mode)` makes it damage the next reply
    (one shot), as a broken or hostile server would:

    flip      one payload byte of the next large bulk reply (a value) flipped
    huge_len  the next large bulk's length rewritten to 2^62
    garbage   the next reply replaced by bytes that are not RESP, then the connection closed
    nested    the next reply replaced by 100,000 nested one-element arrays, then closed
    close     the connection closed as the next reply arrives
    drip      the next reply sent one byte every 50 ms for DRIP_S, then closed
    """

    MODES = ("flip", "huge_len", "garbage", "nested", "close", "drip")

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self._mode: str | None = None
        self.fired = 0  # replies damaged so far
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="umbp-chaos-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self, mode: str | None) -> None:
        if mode is not None and mode not in self.MODES:
            raise ValueError(f"unknown proxy mode {mode!r}")
        with self._lock:
            self._mode = mode

    def armed(self) -> str | None:
        return self._mode

    def _take(self, data: bytes) -> tuple[str | None, re.Match | None]:
        with self._lock:
            mode = self._mode
            if mode is None:
                return None, None
            match = _BULK.search(data) if mode in ("flip", "huge_len") else None
            if mode in ("flip", "huge_len") and match is None:
                return None, None
            self._mode = None
            self.fired += 1
            return mode, match

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=1.0)
            except OSError:
                client.close()  # the server is down: the client sees a refused/closed connection
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        """Both directions on one thread (select): requests pass untouched, replies may be damaged."""
        flip_next = False
        try:
            while True:
                ready, _, _ = select.select([client, upstream], [], [], 1.0)
                if self._closed:
                    return
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    if sock is client:
                        upstream.sendall(data)
                        continue
                    if flip_next:
                        data, flip_next = bytes([data[0] ^ 0xFF]) + data[1:], False
                    mode, match = self._take(data)
                    if mode is None:
                        client.sendall(data)
                    elif not self._damage(client, data, mode, match):
                        return
                    elif mode == "flip" and match is not None and match.end() + 64 >= len(data):
                        flip_next = True
        except (OSError, ValueError):  # ValueError: select on a socket closed meanwhile (the proxy closing)
            return
        finally:
            for s in (client, upstream):
                try:
                    s.close()
                except OSError:
                    pass

    def _damage(self, client: socket.socket, data: bytes, mode: str, match: re.Match | None) -> bool:
        """Send the damaged reply; False when the connection must close."""
        if mode == "flip" and match is not None:
            at = match.end() + 64
            if at < len(data):
                data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
            client.sendall(data)
            return True
        if mode == "huge_len" and match is not None:
            client.sendall(data[: match.start()] + b"$4611686018427387904\r\n" + data[match.end() :])
            return True
        if mode == "garbage":
            client.sendall(b"%\x00\xffnot resp at all\r\n" + os.urandom(64))
        elif mode == "nested":
            client.sendall(b"*1\r\n" * 100_000)
        elif mode == "drip":
            deadline = time.monotonic() + DRIP_S
            for i in range(len(data)):
                if time.monotonic() > deadline:
                    break
                client.sendall(data[i : i + 1])
                time.sleep(0.05)
        return False  # close (and after garbage, nested, drip: the stream is out of step anyway)

    def close(self) -> None:
        self._closed = True
        try:  # close() alone does not wake a thread blocked in accept() on Linux; shutdown() does
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.close()
            except OSError:
                pass


# ---------------------------------------------------------------- byte damage, one medium at a time


def flip_byte(buf: np.ndarray, rng: random.Random) -> None:
    buf[rng.randrange(buf.size)] ^= 0xFF


def zero_block(buf: np.ndarray, rng: random.Random) -> bool:
    """Zero one 4 KiB block that is not zero already; False if there is none."""
    blocks = [b for b in range(0, buf.size, ROW) if buf[b : b + ROW].any()]
    if not blocks:
        return False
    b = rng.choice(blocks)
    buf[b : b + ROW] = 0
    return True


def swap_words(buf: np.ndarray, rng: random.Random) -> bool:
    """Swap two different 8-byte words inside one whole 4 KiB row: psum64 cannot see this. False if no
    row has two different words. The first such row: the rows at the end of an attention page may hold
    token positions past the prompt, which nothing reads (a swap there would be harmless)."""
    for r in range(buf.size // ROW):
        words = buf[r * ROW : (r + 1) * ROW].view(np.uint64)
        distinct = np.flatnonzero(words != words[0])
        if distinct.size:
            i, j = 0, int(rng.choice(distinct.tolist()))
            words[i], words[j] = words[j].copy(), words[i].copy()
            return True
    return False


Damage = Callable[[np.ndarray, random.Random], Any]
DAMAGE: dict[str, Damage] = {"bitflip": flip_byte, "zeroed": zero_block, "reordered": swap_words}


class FileBytes:
    """Read-modify-write of a byte range of a file through its own descriptor (the page cache keeps it
    coherent with the tier's O_DIRECT reads)."""

    def __init__(self, path: str, offset: int, length: int) -> None:
        self.path, self.offset, self.length = path, offset, length

    def edit(self, fn: Callable[[np.ndarray], Any]) -> Any:
        fd = os.open(self.path, os.O_RDWR)
        try:
            buf = np.frombuffer(bytearray(os.pread(fd, self.length, self.offset)), np.uint8)
            out = fn(buf)
            os.pwrite(fd, buf.tobytes(), self.offset)
            os.fsync(fd)
            return out
        finally:
            os.close(fd)

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read(self.length)

    def truncate_inside(self) -> None:
        os.truncate(self.path, self.offset + self.length // 2)


def ssd_record(ssd_tier, rank_key: str) -> FileBytes | None:
    """Where the SSD tier's current record of rank_key lies (payload only), or None if it holds none."""
    shard = ssd_tier._route(rank_key)
    with ssd_tier._lock:
        loc = shard.index.get(rank_key)
    if loc is None:
        return None
    return FileBytes(loc.seg.path, loc.offset, loc.length)
