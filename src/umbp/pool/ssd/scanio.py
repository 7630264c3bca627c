"""The restart scan's reads of files it cannot trust (umbp.pool.ssd.recovery): a segment or `FLUSHED` may be
damaged, unreadable, or not what its name says, so every read here is bounded by what the file really
holds, never by the lengths it claims, and an I/O error is an answer, not an exception.

* Opening never blocks (a FIFO) and never follows a symlink (the owner would write through it); callers
  then require a regular file.
* Payloads are read and checksummed a chunk at a time, and a long one only where the file holds data:
  a hole reads as zeros, and zero rows add nothing to psum64 (umbp.pool.ssd.format.psum_piece), so a
  sparse file's apparent size costs neither memory nor reads.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

import numpy as np

from umbp.pool.checksum import finish
from umbp.pool.ssd.format import BLOCK, RecordInfo, padded, psum_piece

READ_CHUNK = 1 << 20  # bytes of a payload or summary read at a time: what a scan holds of one
# never blocks (a FIFO), never follows a symlink: regular files only
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
# errors of the process, not of the file: start-up fails rather than lose (and delete) a good segment
NOT_THE_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def data_runs(fd: int, lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """The parts of [lo, hi) that may hold data, on 4 KiB boundaries from lo: the rest are holes, which
    read as zeros. Without hole information (the filesystem has none), all of it."""
    at = lo
    while at < hi:
        try:
            data = os.lseek(fd, at, os.SEEK_DATA)
            hole = os.lseek(fd, data, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no data at or after `at`
                yield at, hi
            return
        if data >= hi:
            return
        a = lo + (data - lo) // BLOCK * BLOCK
        at = min(hi, lo + padded(hole - lo))
        yield a, at


def payload_problem(fd: int, r: RecordInfo) -> str:
    """'' if the payload is intact, else why not. Read a chunk at a time, and for a long one only where
    the file holds data: zero rows add nothing to psum64, so a sparse file's claimed length costs neither
    memory nor reads."""
    end, h = r.offset + r.length, 0
    runs = data_runs(fd, r.offset, end) if r.length > READ_CHUNK else [(r.offset, end)]
    try:
        for lo, hi in runs:
            for at in range(lo, hi, READ_CHUNK):
                n = min(READ_CHUNK, hi - at)
                raw = os.pread(fd, n, at)
                if len(raw) != n:
                    return "runs past the end of the file"
                h ^= psum_piece(np.frombuffer(raw, np.uint8), (at - r.offset) // BLOCK)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    return "" if finish(h, r.length) == r.checksum else "fails its checksum"


def pread_blocks(fd: int, n: int, off: int) -> bytes:
    """n bytes at off, a block at a time, an unreadable block read as zeros (no head there)."""
    out = []
    for at in range(off, off + n, BLOCK):
        try:
            out.append(os.pread(fd, BLOCK, at).ljust(BLOCK, b"\0"))
        except OSError:
            out.append(bytes(BLOCK))
    return b"".join(out)
