"""What a restart may serve from an SSD tier directory: the scanner, its resync past damage, and the flush mark.

Two promises hold across every restart, whatever crash or damage came before it (docs/ssd.md, "Recovery"):

* a record is never dropped because an earlier one is bad: the walk of an unsealed segment steps over a
  damaged payload (its extent is known from the head), and after an unreadable head it resyncs on the next
  4 KiB block that holds a valid group head (magic, crc32, lengths bounded by the file);
* a key never goes back in time: its newest record wins even when that record is damaged (then the key is
  a miss, never the older version), and when bytes are lost whose keys cannot be known (a corrupt head or
  entry, a truncated file) and those bytes held flushed records, every record older than the loss is
  withheld, since any of them may have been replaced or removed by a lost one.

Telling flushed loss from a crash's torn tail needs to know how far the directory was synced. Sealed
segments were (sealing ends with fdatasync); for the open segment, `flush()` writes the highest synced seq
into the directory's FLUSHED file (two checksummed slots, so a write torn by a power loss leaves the
previous value). Lost bytes whose seqs may lie at or below that mark are damage to acknowledged data;
above it they are writes a crash cut short, which nobody was promised.

`seq` increases with every record a directory receives, in file order (segments oldest first, each in
offset order), which is what lets a loss be placed among seqs although its own were not read.

A file is data, never an instruction: whatever a directory holds, the scan neither raises nor blocks, and
its memory and time follow the bytes the files really hold, not the sizes they claim. Entries that are not
regular files (directories, symlinks, FIFOs, devices) are skipped unopened; an I/O error costs what it
hides (an unreadable payload is a shadow, an unreadable head a loss the walk resyncs past, a segment that
cannot be opened a loss); a head holds at most MAX_GROUP_ENTRIES entries; payloads and summaries are read a
chunk at a time, and only where the file holds data (a hole reads as zeros, which add nothing to psum64 and
hold no head).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import struct
import threading
import zlib
from dataclasses import dataclass, field

import numpy as np

from umbp.pool.checksum import finish
from umbp.pool.ssd.format import (
    _GROUP,
    _HEADER,
    BLOCK,
    DATA,
    GROUP_MAGIC,
    MAGIC,
    SUMMARY,
    TOMBSTONE,
    VERSION,
    VERSION_1,
    Header,
    RecordInfo,
    entry_span,
    padded,
    parse_group_head,
    parse_header,
    parse_trailer,
    psum_piece,
    record_bytes,
    segment_name,
    segment_number,
    unpack_summary_into,
)
from umbp.pool.ssd.scanio import (
    NOT_THE_FILES,
    OPEN_FLAGS,
    READ_CHUNK,
    data_runs,
    payload_problem,
    pread_blocks,
)
from umbp.regular_file import open_regular

log = logging.getLogger("umbp.ssd")

FLUSH_MARK_NAME = "FLUSHED"
_MARK = struct.Struct("<8sHHIQ")  # magic, version, 0, 0, seq; then crc32 of these 24 bytes
_MARK_MAGIC = b"UMBP-FLS"
_MARK_SLOT = 512  # two slots, written alternately: a torn write spoils one, the other holds the previous mark
_RESYNC_CHUNK = 1 << 20  # bytes read at a time while looking for the next valid head past damage
_LOOKS_LIKE_SEGMENT = re.compile(r"^seg-\d+\.umbp$")
_MARK_LOCK = threading.Lock()  # concurrent flush() calls: the slot choice and its write go together


# ---- the flush mark --------------------------------------------------------------------------------------


def _pack_mark(seq: int) -> bytes:
    head = _MARK.pack(_MARK_MAGIC, 1, 0, 0, seq)
    return (head + struct.pack("<I", zlib.crc32(head))).ljust(_MARK_SLOT, b"\0")


def _unpack_mark(raw: bytes) -> int | None:
    if len(raw) < _MARK.size + 4 or raw[:8] != _MARK_MAGIC:
        return None
    (crc,) = struct.unpack_from("<I", raw, _MARK.size)
    if zlib.crc32(raw[: _MARK.size]) != crc:
        return None
    return _MARK.unpack_from(raw)[4]


def _mark_slots(raw: bytes) -> list[int | None]:
    return [_unpack_mark(raw[i * _MARK_SLOT : (i + 1) * _MARK_SLOT]) for i in (0, 1)]


def read_flush_mark(directory: str) -> int:
    """The highest seq `flush()` reported synced in `directory` (0: none, no intact slot, or not a regular
    file: a FIFO there must not block the scan)."""
    try:
        fd = open_regular(os.path.join(directory, FLUSH_MARK_NAME), follow=False)
        try:
            raw = os.pread(fd, 2 * _MARK_SLOT, 0)
        finally:
            os.close(fd)
    except OSError:
        return 0
    return max((s for s in _mark_slots(raw) if s is not None), default=0)


def write_flush_mark(directory: str, seq: int) -> bool:
    """Record that every record of seq <= `seq` is synced (called after the data's fdatasync). Overwrites
    the slot holding the lower (or no) mark, then syncs, so one valid slot survives a torn write. False
    (logged) if it could not be written: a restart then judges losses against the previous mark."""
    path = os.path.join(directory, FLUSH_MARK_NAME)
    with _MARK_LOCK:
        return _write_mark(path, directory, seq)


def _write_mark(path: str, directory: str, seq: int) -> bool:
    try:
        fd = open_regular(path, os.O_RDWR | os.O_CREAT, follow=False)
        try:
            slots = _mark_slots(os.pread(fd, 2 * _MARK_SLOT, 0))
            if any(s is not None and s >= seq for s in slots):
                return True
            slot = 0 if slots[0] is None else 1 if slots[1] is None else int(slots[1] < slots[0])
            os.pwrite(fd, _pack_mark(seq), slot * _MARK_SLOT)
            os.fdatasync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("umbp: cannot write the flush mark in %s: %s", directory, exc)
        return False
    return True


# ---- one segment -----------------------------------------------------------------------------------------


@dataclass
class SegmentScan:
    """What one segment file holds. `records` lists its data and tombstone records in file order; a record
    whose payload is damaged or missing is listed as a tombstone at its seq (its key is a miss, and stays
    one: an older version never wins over it). `losses` are indexes into `records` where bytes of unknown
    content were lost (before that record). `valid_end` is where the last located record ends: the owner
    cuts the file there and seals it."""

    number: int
    path: str
    size: int
    sealed: bool
    valid_end: int
    records: list[tuple[str, RecordInfo]] = field(default_factory=list)
    losses: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    shadows: int = 0  # records listed as tombstones because their payload is damaged or missing

    @property
    def discarded(self) -> str:
        """What the walk could not use, '' if nothing."""
        return "; ".join(self.problems)

    def lose(self, why: str) -> None:
        if not self.losses or self.losses[-1] != len(self.records):
            self.losses.append(len(self.records))
        self.problems.append(why)

    def shadow(self, key: str, r: RecordInfo, why: str = "") -> None:
        """A record whose key and seq are known and whose payload is not: it hides every older version."""
        self.records.append((key, r._replace(flags=TOMBSTONE)))
        self.shadows += 1
        if why:
            self.problems.append(why)


def _read_summary(fd: int, size: int, number: int) -> list[tuple[str, RecordInfo]] | None:
    """The records a sealed segment's summary lists, or None (then the segment is walked): no valid
    trailer, summary head or checksum, an entry no writer makes, or an I/O error. The trailer's claims are
    checked before anything they point at is read, and the summary is read a chunk at a time."""
    if size < 2 * BLOCK or size % BLOCK:
        return None
    try:
        trailer = parse_trailer(os.pread(fd, BLOCK, size - BLOCK))
        if trailer is None:
            return None
        version, off, nbytes = trailer
        if off + nbytes != size - BLOCK or nbytes < BLOCK or off % BLOCK:
            return None
        first = os.pread(fd, BLOCK, off)  # a summary's head is one block in either format
        if version == VERSION_1:  # one record: its header block, then the payload
            head = parse_header(first, VERSION_1)
        else:  # a group of one summary entry
            group = parse_group_head(first)
            entries = _entries(first, 1)[0] if group is not None and group[:2] == (1, BLOCK) else []
            head = entries[0] if entries else None
        # the summary lists records of the bytes before it, each of which took more than its entry
        if (
            head is None
            or head.flags != SUMMARY
            or BLOCK + padded(head.length) != nbytes
            or head.length > off
        ):
            return None
        entries = _summary_entries(fd, off + BLOCK, head.length, head.checksum, number)
    except OSError:
        return None
    if entries is not None and version == VERSION_1:  # format 1 lists header offsets
        entries = [(key, r._replace(offset=r.offset + BLOCK)) for key, r in entries]
    return entries


def _summary_entries(
    fd: int, off: int, length: int, checksum: int, number: int
) -> list[tuple[str, RecordInfo]] | None:
    """A summary payload parsed and checksummed a chunk at a time: it stops at the first entry no writer
    makes, so a forged length over zeros costs one chunk, not the whole claim."""
    out: list[tuple[str, RecordInfo]] = []
    carry, h = b"", 0
    for pos in range(0, length, READ_CHUNK):
        raw = os.pread(fd, min(READ_CHUNK, length - pos), off + pos)
        if len(raw) != min(READ_CHUNK, length - pos):
            return None
        h ^= psum_piece(np.frombuffer(raw, np.uint8), pos // BLOCK)
        buf = carry + raw
        used = unpack_summary_into(buf, number, out)
        if used is None:
            return None
        carry = buf[used:]
    return out if not carry and finish(h, length) == checksum else None


def _entries(head: bytes, count: int) -> tuple[list[Header], list[Header]]:
    """The entries of a group head: those in order up to the first unreadable one, and the intact ones
    found after it (8-byte aligned, by magic and crc): their keys and seqs are known, their payloads'
    places are not, since the unreadable entry's length is lost."""
    ordered, at = [], _GROUP.size
    view = memoryview(head)
    for _ in range(count):
        h = parse_header(view[at:], VERSION) if at < len(head) else None
        if h is None:
            break
        ordered.append(h)
        at += entry_span(len(h.key.encode()))
    if len(ordered) == count:
        return ordered, []
    stray = []
    at += 8
    while at + _HEADER.size <= len(head) and len(ordered) + len(stray) < count:
        found = head.find(MAGIC, at)  # the next magic; only 8-aligned ones can start an entry
        if found < 0:
            break
        if found % 8:
            at = found - found % 8 + 8
            continue
        h = parse_header(view[found:], VERSION) if found + _HEADER.size <= len(head) else None
        if h is not None:
            stray.append(h)
        at = found + (entry_span(len(h.key.encode())) if h is not None else 8)
    return ordered, stray


def _head_at(off: int, size: int, block: bytes) -> str:
    """'group', 'record' (format 1) or '' for the block at `off`: valid magic, crc and lengths within the
    file, so a resync never stops on stray bytes (payload bytes could hold a magic by chance)."""
    if block[:8] == GROUP_MAGIC:
        group = parse_group_head(block)
        return "group" if group is not None and off + group[1] <= size else ""
    if block[:8] == MAGIC:
        return "record" if parse_header(block, VERSION_1) is not None else ""
    return ""


def _resync(fd: int, off: int, size: int) -> int:
    """The offset of the next 4 KiB block at or after `off` that starts a valid group or format-1 record,
    or `size` if none does. Reads a chunk at a time, only where the file holds data: past a zeroed region
    of a 256 MiB segment this is one pass, not one read a block, and a hole costs nothing."""
    off = -(-off // BLOCK) * BLOCK
    while off + BLOCK <= size:
        run = next(data_runs(fd, off, size), None)
        if run is None:
            break
        off = run[0]
        n = min(_RESYNC_CHUNK, run[1] - off, size - off) // BLOCK * BLOCK
        if not n:
            break
        try:
            chunk = os.pread(fd, n, off)
        except OSError:
            chunk = pread_blocks(fd, n, off)
        if not chunk:
            break
        for at in range(0, len(chunk), BLOCK):
            if chunk[at : at + 8] in (GROUP_MAGIC, MAGIC) and _head_at(
                off + at, size, chunk[at : at + BLOCK]
            ):
                return off + at
        off += len(chunk)
    return size


def _is_last_trailer(block: bytes, off: int, size: int) -> bool:
    return off + BLOCK == size and parse_trailer(block) is not None


def _walk(fd: int, scan: SegmentScan) -> None:
    """Group by group (format-1 record by record) from the start, every data payload verified: with several
    writes in flight a crash can cut short an earlier write while a later one, behind it, is whole. What
    cannot be read is stepped over, and the walk goes on at the next valid head. A seal (summary and
    trailer) ends the walk: it holds no records of its own."""
    off, size = 0, scan.size
    while off + BLOCK <= size:
        try:
            block = os.pread(fd, BLOCK, off)
        except OSError as exc:
            block, why = b"", f"an unreadable block ({exc.strerror})"
        else:
            why = "a group head that runs past the end of the file" if parse_group_head(block) else ""
        kind = _head_at(off, size, block)
        if kind == "group":
            off = _walk_group(fd, scan, off, block)
        elif kind == "record":
            off = _walk_record(fd, scan, off, block)
        elif _is_last_trailer(block, off, size):
            break
        else:
            nxt = _resync(fd, off + BLOCK, size)
            why = why or "no valid header"
            scan.lose(f"{why} at offset {off} (corrupt or torn): bytes {off}..{nxt} skipped")
            off = nxt


def _walk_group(fd: int, scan: SegmentScan, off: int, block: bytes) -> int:
    """A group: each entry's payload verified, a damaged one listed as a shadow. Returns where the walk
    goes on (the file's size when a seal begins here: only its trailer follows)."""
    count, nbytes = parse_group_head(block)
    head = block
    if nbytes > BLOCK:
        try:
            head = os.pread(fd, nbytes, off)  # at most MAX_GROUP_ENTRIES entries: 540 KiB
        except OSError as exc:  # the entries in its first block are still read
            scan.problems.append(
                f"the head at offset {off} is unreadable past its first block ({exc.strerror})"
            )
    ordered, stray = _entries(head, count)
    size = scan.size
    if ordered and ordered[0].flags == SUMMARY:
        return size
    pos = off + nbytes
    scan.valid_end = max(scan.valid_end, pos)
    for i, h in enumerate(ordered):
        r = RecordInfo(scan.number, pos, h.length, h.checksum, h.seq, h.flags)
        where = f"record {i} of the group at offset {off}"
        if h.flags == SUMMARY:
            scan.lose(f"{where} is a summary inside a group")
        elif pos + r.nbytes > size:
            scan.shadow(h.key, r, f"{where} runs past the end of the file")
        elif h.flags == DATA and (bad := payload_problem(fd, r)):
            scan.shadow(h.key, r, f"{where} {bad}")
        else:
            scan.records.append((h.key, r))
        if pos + r.nbytes <= size:
            scan.valid_end = pos + r.nbytes
        pos += r.nbytes
    if len(ordered) == count:
        return min(pos, size)
    scan.lose(f"entry {len(ordered)} of the group at offset {off} is corrupt")
    for h in stray:  # known keys and seqs, payloads not located: each hides the older versions of its key
        scan.shadow(h.key, RecordInfo(scan.number, 0, 0, h.checksum, h.seq, h.flags))
    if len(ordered) + len(stray) + 1 < count:  # more entries unreadable: lost after the strays too
        scan.lose(f"{count - len(ordered) - len(stray)} entries of the group at offset {off} are unreadable")
    return _resync(fd, min(pos, size), size)


def _walk_record(fd: int, scan: SegmentScan, off: int, block: bytes) -> int:
    """A format-1 record: its header block, then its payload."""
    head = parse_header(block, VERSION_1)
    if head.flags == SUMMARY:  # a format-1 seal
        return scan.size
    nbytes = BLOCK if head.flags == TOMBSTONE else record_bytes(head.length)
    info = RecordInfo(scan.number, off + BLOCK, head.length, head.checksum, head.seq, head.flags)
    if off + nbytes > scan.size:
        scan.shadow(head.key, info, f"record at offset {off} runs past the end of the file")
        return scan.size
    if head.flags == DATA and (bad := payload_problem(fd, info)):
        scan.shadow(head.key, info, f"record at offset {off} {bad}")
    else:
        scan.records.append((head.key, info))
    scan.valid_end = off + nbytes
    return off + nbytes


def scan_segment(path: str, number: int) -> SegmentScan | None:
    """What a segment holds; None if it vanished or is not a regular file (a directory, symlink, FIFO or
    device named like a segment: opened without following or blocking, and left alone). Read-only; safe
    while its owner appends to it. An I/O error the walk cannot step over (opening the file, its size)
    ends the segment there, as a loss of what it held."""
    scan = SegmentScan(number, path, 0, sealed=False, valid_end=0)
    fd = -1
    try:
        fd = os.open(path, OPEN_FLAGS)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        scan.size = st.st_size
        entries = _read_summary(fd, scan.size, number)
        if entries is not None:
            scan.sealed, scan.valid_end, scan.records = True, scan.size, entries
        else:
            _walk(fd, scan)
    except OSError as exc:
        if fd < 0 and exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):  # vanished, a symlink, a socket
            return None
        if exc.errno in NOT_THE_FILES:
            raise
        scan.lose(f"unreadable ({exc.strerror or exc}): the rest of the segment is lost")
    finally:
        if fd >= 0:
            os.close(fd)
    return scan


# ---- a directory ---------------------------------------------------------------------------------------


@dataclass
class DirectoryScan:
    segments: list[SegmentScan]
    records: dict[str, RecordInfo]  # the winner of each present key (data records only)
    next_seq: int
    next_segment: int
    flushed_seq: int = 0  # the flush mark, or the newest sealed record if higher
    # records of seq <= horizon are withheld: flushed bytes of unknown keys were lost after them
    horizon: int = 0
    withheld: int = 0  # records withheld for that
    damaged: int = 0  # records whose payload the walk found damaged or missing (misses)
    skipped: list[str] = field(default_factory=list)  # names of segments that are not regular files

    @property
    def discarded(self) -> list[str]:
        out = [f"{name}: not a regular file, ignored" for name in self.skipped]
        out += [f"{os.path.basename(s.path)}: {s.discarded}" for s in self.segments if s.discarded]
        if self.horizon:
            out.append(
                f"flushed records were lost whose keys are unknown: every record up to seq {self.horizon} "
                "is withheld (any of them may have been replaced or removed by a lost one)"
            )
        return out


def _horizon(segments: list[SegmentScan], flushed: int) -> int:
    """The highest seq a lost region of flushed records follows (0 if none): every record at or below it may
    be older than a lost record of the same key. A loss is flushed if the seqs it can hold (above the last
    seq read before it) start at or below the flush mark. Besides the losses a walk saw, a walked segment
    whose records do not run on into the next seq read (a segment cut at a group boundary, or emptied) and
    a directory whose newest record is below the mark have lost flushed records too."""
    seqs: list[int] = []  # every record's seq, in file order
    at_loss: list[int] = []  # positions in `seqs` where unknown content was lost
    at_tail: list[int] = []  # positions right after a walked segment's last record
    for s in segments:
        base = len(seqs)
        at_loss += [base + i for i in s.losses]
        seqs += [r.seq for _, r in s.records]
        if not s.sealed:
            at_tail.append(len(seqs))
    before = np.maximum.accumulate(np.array([0] + seqs, np.int64)).tolist()  # before[i]: highest seq before i
    horizon = 0
    for i in at_loss:
        if before[i] < flushed:
            horizon = max(horizon, before[i])
    for i in at_tail + [len(seqs)]:
        nxt = seqs[i] if i < len(seqs) else None
        if before[i] < flushed and nxt != before[i] + 1:
            horizon = max(horizon, before[i])
    return horizon


def _segment_files(directory: str) -> tuple[list[int], list[int]]:
    """(numbers of the segment files, numbers of segment names that are not regular files), sorted."""
    numbers, others, odd = [], [], []
    with os.scandir(directory) as entries:
        for entry in entries:
            n = segment_number(entry.name)
            if n is None:
                if _LOOKS_LIKE_SEGMENT.match(entry.name):
                    odd.append(entry.name)
                continue
            try:
                regular = entry.is_file(follow_symlinks=False)
            except OSError:  # unknown: scan_segment checks what it opens
                regular = True
            (numbers if regular else others).append(n)
    if odd:
        log.warning(
            "umbp: SSD %s: ignoring %s: not a segment name this version reads", directory, sorted(odd)
        )
    return sorted(numbers), sorted(others)


def scan(directory: str) -> DirectoryScan:
    """Every segment of `directory`, oldest first, and the winning record of each present key."""
    # the mark first: a reader beside a running owner must not judge what it saw against a mark newer than
    # the files it read (records still being written would look like flushed ones lost)
    mark = read_flush_mark(directory)
    numbers, others = _segment_files(directory)
    segments = [s for n in numbers if (s := scan_segment(os.path.join(directory, segment_name(n)), n))]
    sealed_max = max((r.seq for s in segments if s.sealed for _, r in s.records), default=0)
    flushed = max(mark, sealed_max)
    horizon = _horizon(segments, flushed)
    damaged = sum(s.shadows for s in segments)
    withheld = 0
    if horizon:
        for s in segments:
            kept = [(k, r) for k, r in s.records if r.seq > horizon]
            withheld += len(s.records) - len(kept)
            s.records = kept
    best: dict[str, RecordInfo] = {}
    for seg in segments:
        for key, r in seg.records:
            old = best.get(key)
            if old is None or r.seq > old.seq:
                best[key] = r
    max_seq = max((r.seq for s in segments for _, r in s.records), default=0)
    return DirectoryScan(
        segments=segments,
        records={k: r for k, r in best.items() if r.flags == DATA},
        next_seq=max(max_seq, flushed, horizon) + 1,
        next_segment=max(numbers[-1:] + others[-1:], default=0) + 1,
        flushed_seq=flushed,
        horizon=horizon,
        withheld=withheld,
        damaged=damaged,
        skipped=[segment_name(n) for n in others],
    )


def scan_directory(directory: str) -> dict[str, RecordInfo]:
    """key -> RecordInfo of every object `directory` holds, as a restarted SsdTier would serve it.

    Pure and read-only (no lock is taken), so another process (the vLLM scheduler) can learn what a
    worker's directory holds. Payloads are read only in unsealed segments (the walk verifies each one);
    the owner verifies every payload's checksum when it serves it."""
    return scan(directory).records
