"""The state of one SSD directory (a shard of the tier): its segments, staged items, in-flight writes.

Plain records the tier's parts share; the tier's lock guards every mutable field here.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from umbp.pool.errors import UmbpError
from umbp.pool.ssd.format import (
    BLOCK,
    RecordInfo,
    entry_bytes,
    padded,
)

log = logging.getLogger("umbp.ssd")
KiB, MiB = 1 << 10, 1 << 20
COPYING, QUEUED, WRITING, DONE = range(4)  # a staged put's life
_PUT, _TOMB, _CLEAR = range(3)
_OK, _MISS, _BAD, _IOERR = range(4)
_MAX_BATCH_ITEMS = 512  # below IOV_MAX (1024) for one pwritev
_SUM_RUN_BYTES = 1 << 20  # put: checksums of side-by-side small records taken this much at a time
_ENTRY_BYTES = entry_bytes(b"")  # a summary entry's bytes before its key
_FATAL_ERRNOS = (errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)


def _staging_pages(length: int) -> int:
    """Staging pages a put of `length` bytes takes: its padded payload (one page for an empty one)."""
    return max(padded(length) // BLOCK, 1)


class SsdError(UmbpError):
    """A directory the SSD tier cannot use."""


class SsdDirectoryError(SsdError):
    """The directory is missing and cannot be created, is not a directory, or is read-only."""


class SsdLockedError(SsdError):
    """Another process (or another SsdTier in this one) owns the directory."""


class _Loc(NamedTuple):
    seg: _Segment
    offset: int  # of the payload
    length: int
    checksum: int  # psum64 of the payload, from the record's header


@dataclass(eq=False, slots=True)
class _Segment:
    number: int
    path: str
    fd: int
    size: int = 0  # bytes of valid records (the append offset)
    sealed: bool = False
    entries: list[tuple[str, RecordInfo]] = field(default_factory=list)  # for the summary
    entry_bytes: int = 0
    live: dict[str, None] = field(default_factory=dict)  # keys whose current record is here
    ghosts: dict[str, None] = field(default_factory=dict)  # keys whose unindexed newest record is here
    reserved: int = 0  # bytes counted against capacity: size, plus the seal to come if unsealed
    pins: int = 0
    dead: bool = False  # deleted; the fd is closed at the last unpin


@dataclass(eq=False, slots=True)
class _Item:
    """A queued operation: a put (its record image sits in staging), a tombstone, or a clear."""

    kind: int
    key: str = ""
    key_bytes: bytes = b""
    length: int = 0
    start: int = -1  # first staging page (puts)
    npages: int = 0
    checksum: int = 0
    state: int = COPYING
    cancelled: bool = False
    pins: int = 0
    done: threading.Event | None = None
    nbytes: int = (
        0  # bytes of its payload on disk (padded; 0 for a tombstone), a field: read ~30 times a record
    )


@dataclass(eq=False, slots=True)
class _Write:
    """A group of records on its way into a segment: planned at `offset`, written by an I/O thread while
    the writer thread prepares the next group, so the disk is not idle while Python runs."""

    seg: _Segment
    group: list[_Item]
    seqs: list[int]
    offset: int
    nbytes: int  # the group's bytes: head and payloads
    ebytes: int
    future: Future
    buffer: np.ndarray | None = None  # memory the write reads besides staging (the group's head, a seal's
    # image), kept alive until it is written
    head: int = 0  # bytes of the group's head
    seal: bool = False  # the segment's summary and trailer (no records): lands as _sealed


@dataclass(eq=False)
class _Shard:
    """One directory: its lock, segments (oldest first), index, LRU, queue and writer thread."""

    number: int
    directory: str
    lock_fd: int  # the flocked directory (umbp.pool.ssd.directory._lock_directory)
    capacity: int
    cv: threading.Condition
    direct: bool
    scratch: np.ndarray
    limit: int = 0  # capacity, lowered while the filesystem has less free space
    lock_file_fd: int = -1  # its flocked LOCK file, which names the owner's pid
    segments: list[_Segment] = field(default_factory=list)
    active: _Segment | None = None
    next_seq: int = 1
    next_segment: int = 1
    written_seq: int = 0  # the highest seq of a record whose write reached the file (what flush() marks)
    index: dict[str, _Loc] = field(default_factory=dict)
    ghosts: dict[str, _Segment] = field(
        default_factory=dict
    )  # left the index without remove(), still on disk
    lru: OrderedDict[str, None] = field(default_factory=OrderedDict)
    staged: dict[str, _Item] = field(default_factory=dict)
    queue: deque[_Item] = field(default_factory=deque)
    live_bytes: int = 0  # on-disk bytes of the indexed records
    stored_bytes: int = 0  # their payload bytes
    footprint: int = 0  # sum of segments' reserved bytes
    busy: bool = False
    failed: str = ""
    thread: threading.Thread | None = None
    io: ThreadPoolExecutor | None = (
        None  # runs the writes the writer thread plans (io_hooks.WRITE_DEPTH at once) and seals
    )
    inflight: deque[_Write] = field(default_factory=deque)  # oldest first; touched by the writer thread only
