"""The SSD tier's on-disk format, and a read-only scanner usable from any process (see docs/ssd.md).

A directory holds `LOCK` (the owner's flock) and append-only segment files `seg-<12 digits>.umbp`. A
segment is a sequence of records; every record starts on a 4 KiB boundary and is a whole number of 4 KiB
blocks, so the owner can write and read it with O_DIRECT::

    record  = header block (4 KiB) + payload, zero-padded to a multiple of 4 KiB
    header  = magic "UMBP-REC", version u16, flags u16, key_len u16, 0 u16, seq u64, length u64,
              checksum u64 (psum64 of the payload), header_crc u32, 0 u32, key (utf-8), zeros to 4 KiB
              (little-endian; header_crc = crc32 of the other 44 header bytes and the key)
    flags   = 0 data, 1 tombstone (the key was removed; no payload), 2 summary (see below)

A sealed segment ends with a summary record (its payload lists every record of the segment) and a
trailer block ("UMBP-END", version, summary offset, crc32), so a restart reads two blocks per segment
instead of every header. A segment without a valid trailer (the one being written when the process died)
is walked header by header, verifying every data record's payload checksum; the walk stops at the first
header that is torn, corrupt or runs past the end of the file, or at the first payload that fails its
checksum. Everything after the stopping point is discarded, never served.

`seq` increases with every record a directory receives, so when a key appears more than once the highest
seq wins, and a winning tombstone means the key is absent.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from umbp.pool import native
from umbp.pool.psum import as_rows, checksum_u8, combine_padded_rows

BLOCK = 4096
MAGIC = b"UMBP-REC"
TRAILER_MAGIC = b"UMBP-END"
VERSION = 1
DATA, TOMBSTONE, SUMMARY = 0, 1, 2
MAX_KEY_BYTES = 1024
LOCK_NAME = "LOCK"

_HEADER = struct.Struct("<8sHHHHQQQI4x")  # 48 bytes; the crc covers the first 44 and the key
_CRC_AT = 40
_ENTRY = struct.Struct("<QQQQHH")  # summary entry: offset, length, checksum, seq, flags, key_len; then key
_TRAILER = struct.Struct("<8sHHIQQI")  # magic, version, 0, 0, summary offset, summary record bytes, crc
_SEGMENT_RE = re.compile(r"^seg-(\d{12})\.umbp$")


def padded(n: int) -> int:
    """n rounded up to whole 4 KiB blocks."""
    return -(-n // BLOCK) * BLOCK


def record_bytes(length: int) -> int:
    """Bytes a record with a `length`-byte payload occupies on disk."""
    return BLOCK + padded(length)


def entry_bytes(key_bytes: bytes) -> int:
    """Bytes one record adds to its segment's summary payload."""
    return _ENTRY.size + len(key_bytes)


def seal_bytes(summary_entry_bytes: int) -> int:
    """Bytes sealing adds to a segment whose records need `summary_entry_bytes` of summary entries."""
    return record_bytes(summary_entry_bytes) + BLOCK


def segment_name(number: int) -> str:
    return f"seg-{number:012d}.umbp"


def segment_number(name: str) -> int | None:
    m = _SEGMENT_RE.match(name)
    return int(m.group(1)) if m else None


# ---- headers -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Header:
    flags: int
    seq: int
    length: int
    checksum: int
    key: str


_HEAD = struct.Struct("<8sHHHHQQQ")  # the header's first 40 bytes: all but the crc and the pad
_CRC = struct.Struct("<I")
_PAD = b"\0" * (_HEADER.size - _CRC_AT - 4)  # the header's zero pad after the crc, which the crc covers
_ZEROS = memoryview(bytes(BLOCK))  # sliced, not copied: pack_header zeroes up to 4 KiB per record


def _header_crc(head: bytes, tail: bytes) -> int:
    """crc32 of a header less its crc field: its first 40 bytes (`head`), then the pad and the key
    (`tail`, what follows the crc field)."""
    return zlib.crc32(tail, zlib.crc32(head))


def pack_header(block: np.ndarray, key_bytes: bytes, flags: int, seq: int, length: int, checksum: int) -> None:
    """Write a header into `block` (a writable, contiguous 4 KiB uint8 view), zeroing the rest of the block."""
    pack_header_at(memoryview(block), 0, key_bytes, flags, seq, length, checksum)


def pack_header_at(view: memoryview, at: int, key_bytes: bytes, flags: int, seq: int, length: int,
                   checksum: int) -> None:
    """pack_header into the 4 KiB at byte `at` of a writable byte view: the writer's per-record form
    (buffer copies, no numpy slice, zeros sliced from a memoryview: ~2 us a record instead of ~3.3)."""
    head = _HEAD.pack(MAGIC, VERSION, flags, len(key_bytes), 0, seq, length, checksum)
    tail = _PAD + key_bytes
    raw = head + _CRC.pack(_header_crc(head, tail)) + tail
    n = len(raw)
    view[at : at + n] = raw
    view[at + n : at + BLOCK] = _ZEROS[n:]


def pack_headers(view: memoryview, ats: list[int], keys: list[bytes], flags: list[int], seqs: list[int],
                 lengths: list[int], checksums: list[int]) -> None:
    """pack_header_at for a write group's records: one C call when the extension is built, else the loop.
    The loop cost the writer thread ~2.5 µs a record on the H200 hosts, a fifth of its CPU
    (bench/results/history/29-session13.txt)."""
    if native.lib is not None:
        native.lib.pack_headers(view, ats, keys, flags, seqs, lengths, checksums, MAGIC, VERSION)
        return
    for args in zip(ats, keys, flags, seqs, lengths, checksums, strict=True):
        pack_header_at(view, *args)


def parse_header(block: bytes | memoryview | np.ndarray) -> Header | None:
    """The header in `block`, or None if it is not a valid, intact header of this format version."""
    raw = bytes(block[: _HEADER.size + MAX_KEY_BYTES]) if len(block) >= _HEADER.size else b""
    if len(raw) < _HEADER.size or raw[:8] != MAGIC:
        return None
    magic, version, flags, key_len, _, seq, length, csum, crc = _HEADER.unpack_from(raw)
    if version != VERSION or key_len > MAX_KEY_BYTES or flags not in (DATA, TOMBSTONE, SUMMARY):
        return None
    key_bytes = raw[_HEADER.size : _HEADER.size + key_len]
    if len(key_bytes) != key_len or _header_crc(raw[:_CRC_AT], raw[_CRC_AT + 4 : _HEADER.size + key_len]) != crc:
        return None
    try:
        key = key_bytes.decode()
    except UnicodeDecodeError:
        return None
    return Header(flags, seq, length, csum, key)


# ---- checksums over whole blocks ------------------------------------------------------------------------


def block_rows(buf: np.ndarray) -> np.ndarray:
    """Sum mod 2**64 of each 4 KiB block of `buf` (a multiple of 4 KiB long) as little-endian words:
    one numpy call for a whole run of records."""
    return np.add.reduce(as_rows(buf), axis=1)


def psum_of_rows(rows: np.ndarray, length: int) -> int:
    """psum64 of a `length`-byte payload from the block sums of its zero-padded 4 KiB blocks.

    Equal to umbp.pool.psum.checksum of the payload because psum64 sums the bytes after the last full
    row zero-padded, with the next row's weight, which is exactly a zero-padded block's row sum; records
    are zero-padded on disk. (tests/unit/test_ssd_format.py checks the equality.)"""
    return int(combine_padded_rows(rows[None, :], length)[0])


def psums_of_records(rows: np.ndarray, count: int, length: int) -> list[int]:
    """psum64 of the payloads of `count` adjacent records that all hold `length` bytes, from the block
    sums of the run (headers included): one matrix-vector product instead of one call per record."""
    per = record_bytes(length) // BLOCK
    return combine_padded_rows(rows[: count * per].reshape(count, per)[:, 1:], length).tolist()


# ---- summaries and trailers ----------------------------------------------------------------------------


class RecordInfo(NamedTuple):
    """Where one record lives: segment number, offset of its header, payload length and psum64, seq.
    A NamedTuple: the writer makes one per record written, and a frozen dataclass costs ~3x more."""

    segment: int
    offset: int
    length: int
    checksum: int
    seq: int
    flags: int = DATA

    @property
    def nbytes(self) -> int:
        return record_bytes(self.length) if self.flags != TOMBSTONE else BLOCK


def pack_summary(entries: list[tuple[str, RecordInfo]]) -> bytes:
    parts = []
    for key, r in entries:
        kb = key.encode()
        parts.append(_ENTRY.pack(r.offset, r.length, r.checksum, r.seq, r.flags, len(kb)) + kb)
    return b"".join(parts)


def unpack_summary(payload: bytes, segment: int) -> list[tuple[str, RecordInfo]] | None:
    out, pos = [], 0
    while pos < len(payload):
        if pos + _ENTRY.size > len(payload):
            return None
        off, length, csum, seq, flags, key_len = _ENTRY.unpack_from(payload, pos)
        pos += _ENTRY.size
        if pos + key_len > len(payload):
            return None
        try:
            key = payload[pos : pos + key_len].decode()
        except UnicodeDecodeError:
            return None
        pos += key_len
        out.append((key, RecordInfo(segment, off, length, csum, seq, flags)))
    return out


def pack_trailer(summary_offset: int, summary_record_bytes: int) -> bytes:
    head = _TRAILER.pack(TRAILER_MAGIC, VERSION, 0, 0, summary_offset, summary_record_bytes, 0)
    crc = zlib.crc32(head[: _TRAILER.size - 4])
    return head[: _TRAILER.size - 4] + struct.pack("<I", crc) + bytes(BLOCK - _TRAILER.size)


def parse_trailer(block: bytes) -> tuple[int, int] | None:
    if len(block) < _TRAILER.size or block[:8] != TRAILER_MAGIC:
        return None
    _, version, _, _, off, nbytes, crc = _TRAILER.unpack_from(block)
    if version != VERSION or zlib.crc32(block[: _TRAILER.size - 4]) != crc:
        return None
    return off, nbytes


# ---- scanning ------------------------------------------------------------------------------------------


@dataclass
class SegmentScan:
    """What one segment file holds. `records` lists every data and tombstone record in file order;
    `valid_end` is where trustworthy content ends (the file size for a sealed segment)."""

    number: int
    path: str
    size: int
    sealed: bool
    valid_end: int
    records: list[tuple[str, RecordInfo]] = field(default_factory=list)
    discarded: str = ""  # why the walk stopped early ("" if it did not)


@dataclass
class DirectoryScan:
    segments: list[SegmentScan]
    records: dict[str, RecordInfo]  # the winner of each present key (data records only)
    next_seq: int
    next_segment: int

    @property
    def discarded(self) -> list[str]:
        return [f"{os.path.basename(s.path)}: {s.discarded}" for s in self.segments if s.discarded]


def _pread(fd: int, n: int, offset: int) -> bytes:
    return os.pread(fd, n, offset)


def _read_summary(fd: int, size: int, number: int) -> list[tuple[str, RecordInfo]] | None:
    if size < 2 * BLOCK or size % BLOCK:
        return None
    trailer = parse_trailer(_pread(fd, BLOCK, size - BLOCK))
    if trailer is None:
        return None
    off, nbytes = trailer
    if off + nbytes != size - BLOCK or nbytes < BLOCK:
        return None
    raw = _pread(fd, nbytes, off)
    head = parse_header(raw[:BLOCK]) if len(raw) == nbytes else None
    if head is None or head.flags != SUMMARY or record_bytes(head.length) != nbytes:
        return None
    payload = np.frombuffer(raw, np.uint8)[BLOCK : BLOCK + head.length]
    if checksum_u8(payload) != head.checksum:
        return None
    return unpack_summary(payload.tobytes(), number)


def _verify_payload(fd: int, r: RecordInfo) -> bool:
    raw = _pread(fd, r.length, r.offset + BLOCK)
    return len(raw) == r.length and checksum_u8(np.frombuffer(raw, np.uint8)) == r.checksum


def _walk(fd: int, scan: SegmentScan) -> None:
    """Header by header from the start; stops at the first record that is not whole and intact. Every data
    record's payload is verified, not only the last one: with several writes in flight, a crash can leave
    a torn record in the middle (an earlier write cut short, a later one complete behind it)."""
    off, size = 0, scan.size
    while off < size:
        head = parse_header(_pread(fd, BLOCK, off)) if off + BLOCK <= size else None
        if head is None:
            scan.discarded = f"no valid header at offset {off} (torn or corrupt); {size - off} bytes discarded"
            break
        nbytes = BLOCK if head.flags == TOMBSTONE else record_bytes(head.length)
        if off + nbytes > size:
            scan.discarded = f"record at offset {off} runs past the end of the file (torn write); discarded"
            break
        if head.flags != SUMMARY:
            info = RecordInfo(scan.number, off, head.length, head.checksum, head.seq, head.flags)
            if head.flags == DATA and not _verify_payload(fd, info):
                scan.discarded = (f"record at offset {off} fails its checksum (torn write); it and the "
                                  f"{size - off - nbytes} bytes after it discarded")
                break
            scan.records.append((head.key, info))
        off += nbytes
    scan.valid_end = off


def scan_segment(path: str, number: int) -> SegmentScan | None:
    """What a segment holds (None if it vanished). Read-only; safe while its owner appends to it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        scan = SegmentScan(number, path, size, sealed=False, valid_end=0)
        entries = _read_summary(fd, size, number)
        if entries is not None:
            scan.sealed, scan.valid_end, scan.records = True, size, entries
        else:
            _walk(fd, scan)
        return scan
    finally:
        os.close(fd)


def scan(directory: str) -> DirectoryScan:
    """Every segment of `directory`, oldest first, and the winning record of each present key."""
    numbers = sorted(n for n in map(segment_number, os.listdir(directory)) if n is not None)
    segments = [s for n in numbers if (s := scan_segment(os.path.join(directory, segment_name(n)), n))]
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
        next_seq=max_seq + 1,
        next_segment=(numbers[-1] + 1) if numbers else 1,
    )


def scan_directory(directory: str) -> dict[str, RecordInfo]:
    """key -> RecordInfo of every object `directory` holds, as a restarted SsdTier would serve it.

    Pure and read-only (no lock is taken), so another process (the vLLM scheduler) can learn what a
    worker's directory holds. Payloads are read only in unsealed segments (the walk verifies each one);
    the owner verifies every payload's checksum when it serves it."""
    return scan(directory).records
