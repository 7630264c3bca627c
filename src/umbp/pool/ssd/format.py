"""The SSD tier's on-disk format, and a read-only scanner usable from any process (see docs/ssd.md).

A directory holds `LOCK` (the owner's flock), `FLUSHED` (the flush mark, umbp.pool.ssd.recovery) and
append-only segment files `seg-<12 digits, more once needed>.umbp`. A
segment is a sequence of groups (format 2, what this code writes) or records (format 1, still read). Every
group starts on a 4 KiB boundary and is a whole number of 4 KiB blocks, so the owner can write and read it
with O_DIRECT::

    group   = head blocks + payloads, each payload zero-padded to a multiple of 4 KiB
    head    = group head (magic "UMBP-GRP", version u16, 0 u16, count u32, head bytes u32, crc32 of those 20
              bytes), then `count` (<= MAX_GROUP_ENTRIES) entries back to back, each padded to 8 bytes,
              then zeros to 4 KiB
    entry   = magic "UMBP-REC", version u16 (2), flags u16, key_len u16, 0 u16, seq u64, length u64,
              checksum u64 (psum64 of the payload), header_crc u32, 0 u32, key (utf-8)
              (little-endian; header_crc = crc32 of the other 44 header bytes and the key)
    flags   = 0 data, 1 tombstone (the key was removed; no payload), 2 summary (see below)

The payloads follow the head in entry order (a tombstone has none). Why groups: format 1 gave every record
a 4 KiB header block of its own, 1/17 of the bytes written for a 64 KiB object; a group of a write's
records shares its head blocks (~150 bytes an entry). Format 1 (`record = header block + payload`, the
same entry layout with version 1 alone in its block) is still read, so a directory written before stays
served.

A sealed segment ends with a summary group (one summary entry whose payload lists every record of the
segment) and a trailer block ("UMBP-END", version, summary offset, crc32), so a restart reads two blocks
per segment instead of every head. A segment without a valid trailer (the one being written when the
process died) is walked group by group, verifying every data payload's checksum, stepping over what is
damaged (umbp.pool.ssd.recovery, which also holds the scanner).

`seq` increases with every record a directory receives, so when a key appears more than once the highest
seq wins, and a winning tombstone means the key is absent. Offsets held in memory (RecordInfo.offset,
summary entries of format 2) are payload offsets, whatever the format.
"""

from __future__ import annotations

import functools
import re
import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from umbp.pool import native
from umbp.pool.checksum import as_rows, checksum_u8, combine_padded_rows, finish, row_values
from umbp.pool.checksum.gf64 import gf_mul_int

BLOCK = 4096
MAGIC = b"UMBP-REC"
GROUP_MAGIC = b"UMBP-GRP"
TRAILER_MAGIC = b"UMBP-END"
# What this code writes; it reads 1 and 3. 3 = 2 with psum64 format 2 checksums (umbp.pool.checksum): groups of
# version 2 carry the additive format-1 digest and are skipped by their version (misses); a version-1
# record's format-1 digest fails the format-2 check (a miss; a false pass has probability 2**-64).
VERSION = 3
VERSION_1 = 1
DATA, TOMBSTONE, SUMMARY = 0, 1, 2
MAX_KEY_BYTES = 1024
# The most entries a group head holds: a group is part of one writer batch, at most 512 items
# (umbp.pool.ssd.shard._MAX_BATCH_ITEMS, below IOV_MAX, since the first version); a seal's and a
# copy-forward's hold one. A head claiming more is no head any version wrote, so a scan never reads more
# than head_bytes(MAX_GROUP_ENTRIES * entry_span(MAX_KEY_BYTES)) (540 KiB) for one head.
MAX_GROUP_ENTRIES = 512
LOCK_NAME = "LOCK"

_HEADER = struct.Struct("<8sHHHHQQQI4x")  # 48 bytes; the crc covers the first 44 and the key
_CRC_AT = 40
_ENTRY = struct.Struct("<QQQQHH")  # summary entry: offset, length, checksum, seq, flags, key_len; then key
_TRAILER = struct.Struct("<8sHHIQQI")  # magic, version, 0, 0, summary offset, summary record bytes, crc
_GROUP = struct.Struct("<8sHHIII")  # magic, version, 0, count, head bytes, crc32 of the first 20 bytes
# 12 digits, or more without a leading zero: names grow past 12 digits rather than stop being read, and every
# number has exactly one name
_SEGMENT_RE = re.compile(r"^seg-(\d{12}|[1-9]\d{12,18})\.umbp$")
MAX_SEGMENT_NUMBER = 10**19 - 1  # the largest number a segment name the scanner reads can carry


def padded(n: int) -> int:
    """n rounded up to whole 4 KiB blocks."""
    return -(-n // BLOCK) * BLOCK


def record_bytes(length: int) -> int:
    """Bytes a record with a `length`-byte payload occupies on disk alone in its group (its head
    block and its payload), at most what it takes: the bound capacity checks use."""
    return BLOCK + padded(length)


def entry_span(key_len: int) -> int:
    """Bytes one entry takes in a group head (its key included, padded to 8 bytes)."""
    return (_HEADER.size + key_len + 7) // 8 * 8


def head_bytes(spans: int) -> int:
    """Bytes of a group head whose entries take `spans` bytes: whole 4 KiB blocks."""
    return padded(_GROUP.size + spans)


def entry_bytes(key_bytes: bytes) -> int:
    """Bytes one record adds to its segment's summary payload."""
    return _ENTRY.size + len(key_bytes)


def seal_bytes(summary_entry_bytes: int) -> int:
    """Bytes sealing adds to a segment whose records need `summary_entry_bytes` of summary entries:
    the summary group (one entry, no key) and the trailer."""
    return head_bytes(entry_span(0)) + padded(summary_entry_bytes) + BLOCK


def segment_name(number: int) -> str:
    """The file name of segment `number`: 12 digits, more once numbers need them, and never a name that
    segment_number would not read back (a stray seg-999999999999.umbp used to make the next name 13 digits
    long, which the scanner ignored, losing flushed objects at restart)."""
    if not 0 <= number <= MAX_SEGMENT_NUMBER:
        raise ValueError(f"umbp: segment number {number} is out of range (0..{MAX_SEGMENT_NUMBER})")
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


def pack_header(
    block: np.ndarray, key_bytes: bytes, flags: int, seq: int, length: int, checksum: int
) -> None:
    """A format-1 record header into `block` (a writable, contiguous 4 KiB uint8 view), zeroing the rest of
    the block. This code no longer writes format 1; tests use it to build directories written before."""
    pack_header_at(memoryview(block), 0, key_bytes, flags, seq, length, checksum, BLOCK, VERSION_1)


def pack_header_at(
    view: memoryview,
    at: int,
    key_bytes: bytes,
    flags: int,
    seq: int,
    length: int,
    checksum: int,
    span: int = 0,
    version: int = VERSION,
) -> None:
    """One header at byte `at` of a writable byte view, zero-padded to `span` bytes (0: to its entry_span,
    as packed into a group head). Buffer copies, no numpy slice, zeros sliced from a memoryview."""
    head = _HEAD.pack(MAGIC, version, flags, len(key_bytes), 0, seq, length, checksum)
    tail = _PAD + key_bytes
    raw = head + _CRC.pack(_header_crc(head, tail)) + tail
    n = len(raw)
    end = span or entry_span(len(key_bytes))
    view[at : at + n] = raw
    view[at + n : at + end] = _ZEROS[n:end]


def pack_headers(
    view: memoryview,
    ats: list[int],
    keys: list[bytes],
    flags: list[int],
    seqs: list[int],
    lengths: list[int],
    checksums: list[int],
    span: int = 0,
) -> None:
    """pack_header_at for a write group's entries: one C call when the extension is built, else the loop.
    The loop cost the writer thread ~2.5 µs a record on the H200 hosts, a fifth of its CPU
    (bench/results/archive/2026-12-03-remote-kept-connections-29.txt)."""
    if native.lib is not None:
        native.lib.pack_headers(view, ats, keys, flags, seqs, lengths, checksums, MAGIC, VERSION, span)
        return
    for args in zip(ats, keys, flags, seqs, lengths, checksums, strict=True):
        pack_header_at(view, *args, span)


def pack_group(
    view: memoryview,
    keys: list[bytes],
    flags: list[int],
    seqs: list[int],
    lengths: list[int],
    checksums: list[int],
) -> int:
    """A group head for these entries at the start of `view` (writable, at least head_bytes long, any
    content): the head, the entries back to back, zeros to the block boundary. Returns its bytes."""
    ats, at = [], _GROUP.size
    for kb in keys:
        ats.append(at)
        at += entry_span(len(kb))
    total = head_bytes(at - _GROUP.size)
    pack_headers(view, ats, keys, flags, seqs, lengths, checksums)
    view[at:total] = _ZEROS[: total - at]
    head = _GROUP.pack(GROUP_MAGIC, VERSION, 0, len(keys), total, 0)[: _GROUP.size - 4]
    view[: _GROUP.size] = head + _CRC.pack(zlib.crc32(head))
    return total


def parse_header(block: bytes | memoryview | np.ndarray, version: int = VERSION_1) -> Header | None:
    """The header at the start of `block`, or None if it is not a valid, intact header of `version`
    (1: a record's header block; 2: an entry of a group head)."""
    raw = bytes(block[: _HEADER.size + MAX_KEY_BYTES]) if len(block) >= _HEADER.size else b""
    if len(raw) < _HEADER.size or raw[:8] != MAGIC:
        return None
    magic, got_version, flags, key_len, _, seq, length, csum, crc = _HEADER.unpack_from(raw)
    if got_version != version or key_len > MAX_KEY_BYTES or flags not in (DATA, TOMBSTONE, SUMMARY):
        return None
    key_bytes = raw[_HEADER.size : _HEADER.size + key_len]
    if (
        len(key_bytes) != key_len
        or _header_crc(raw[:_CRC_AT], raw[_CRC_AT + 4 : _HEADER.size + key_len]) != crc
    ):
        return None
    try:
        key = key_bytes.decode()
    except UnicodeDecodeError:
        return None
    return Header(flags, seq, length, csum, key)


def parse_group_head(block: bytes) -> tuple[int, int] | None:
    """(entry count, head bytes) of the group head at the start of `block`, or None if it is not one."""
    if len(block) < _GROUP.size or block[:8] != GROUP_MAGIC:
        return None
    _, version, _, count, nbytes, crc = _GROUP.unpack_from(block)
    if version != VERSION or zlib.crc32(block[: _GROUP.size - 4]) != crc or nbytes % BLOCK:
        return None
    if count > MAX_GROUP_ENTRIES:
        return None
    if not head_bytes(count * entry_span(0)) <= nbytes <= head_bytes(count * entry_span(MAX_KEY_BYTES)):
        return None
    return count, nbytes


def parse_entries(head: bytes, count: int) -> list[Header]:
    """The intact entries of a group head, in order, up to the first one that is not (a torn head)."""
    out, at = [], _GROUP.size
    for _ in range(count):
        h = parse_header(memoryview(head)[at:], VERSION) if at < len(head) else None
        if h is None:
            break
        out.append(h)
        at += entry_span(len(h.key.encode()))
    return out


# ---- checksums over whole blocks ------------------------------------------------------------------------


def block_rows(buf: np.ndarray) -> np.ndarray:
    """psum64's row value of each 4 KiB block of `buf` (a multiple of 4 KiB long): one call for a whole
    run of records."""
    return row_values(as_rows(buf))


def psum_of_rows(rows: np.ndarray, length: int) -> int:
    """psum64 of a `length`-byte payload from the row values of its zero-padded 4 KiB blocks.

    Equal to umbp.pool.checksum.checksum of the payload because psum64 takes the bytes after the last full
    row zero-padded, with the next row's weight, which is exactly a zero-padded block's row value; records
    are zero-padded on disk. (tests/unit/test_ssd_format.py checks the equality.)"""
    return int(combine_padded_rows(rows[None, :], length)[0])


_WEIGHT_POWERS: list[int] = []  # x**(32768 * 2**i) mod P: the weights of rows 2**i, built on first use


@functools.lru_cache(maxsize=4096)
def _row_weight(row: int) -> int:
    """The weight psum64 gives row `row` of an object: x**(32768 * row) mod P (umbp.pool.checksum)."""
    if not _WEIGHT_POWERS:
        w = 2  # x
        for _ in range(15):  # x**32768: one 4 KiB row's bits
            w = gf_mul_int(w, w)
        powers = []
        for _ in range(64):
            powers.append(w)
            w = gf_mul_int(w, w)
        _WEIGHT_POWERS[:] = powers
    out = 1
    for i in range(row.bit_length()):
        if row >> i & 1:
            out = gf_mul_int(out, _WEIGHT_POWERS[i])
    return out


def psum_piece(chunk: np.ndarray, row0: int) -> int:
    """What a piece of an object (a flat uint8 array) adds to the object's psum64 when it starts `row0`
    4 KiB rows in, a partial last row counted zero-padded: the pieces of an object xor up, and
    umbp.pool.checksum.finish(xor, length) is its psum64. Rows weigh x**(32768 * row), so a piece is its
    own rows' sum from row 0 times row0's weight: a payload is checked a chunk at a time, in bounded
    memory, and a chunk of zeros (a hole in a sparse file) adds nothing."""
    if native.lib is not None:
        return native.lib.psum_copy((chunk,), None, (row0,))[0]
    h = checksum_u8(chunk) ^ finish(0, chunk.size)  # the chunk's psum64 less its length term
    return gf_mul_int(h, _row_weight(row0)) if row0 else h


def psums_of_records(rows: np.ndarray, count: int, length: int) -> list[int]:
    """psum64 of `count` side-by-side zero-padded payloads that all hold `length` (> 0) bytes, from the
    block row values of the run: a few array operations instead of one call per record."""
    per = padded(length) // BLOCK
    return combine_padded_rows(rows[: count * per].reshape(count, per), length).tolist()


# ---- summaries and trailers ----------------------------------------------------------------------------


class RecordInfo(NamedTuple):
    """Where one record lives: segment number, offset of its payload, payload length and psum64, seq.
    A NamedTuple: the writer makes one per record written, and a frozen dataclass costs ~3x more."""

    segment: int
    offset: int
    length: int
    checksum: int
    seq: int
    flags: int = DATA

    @property
    def nbytes(self) -> int:
        """Bytes of its payload on disk (padded); its head entry is shared with its group."""
        return padded(self.length)


def pack_summary(entries: list[tuple[str, RecordInfo]]) -> bytes:
    parts = []
    for key, r in entries:
        kb = key.encode()
        parts.append(_ENTRY.pack(r.offset, r.length, r.checksum, r.seq, r.flags, len(kb)) + kb)
    return b"".join(parts)


def unpack_summary(payload: bytes, segment: int) -> list[tuple[str, RecordInfo]] | None:
    out: list[tuple[str, RecordInfo]] = []
    return out if unpack_summary_into(payload, segment, out) == len(payload) else None


def unpack_summary_into(buf: bytes, segment: int, out: list[tuple[str, RecordInfo]]) -> int | None:
    """The whole summary entries at the start of `buf`, appended to `out`; returns the bytes they take (a
    partial entry at the end is left for the caller's next chunk), or None at an entry no writer makes:
    seq 0 (seqs start at 1), flags other than data or tombstone, a key over MAX_KEY_BYTES or not utf-8.
    So a run of zeros (a hole of a sparse file) is never read as thousands of records."""
    pos = 0
    while pos + _ENTRY.size <= len(buf):
        off, length, csum, seq, flags, key_len = _ENTRY.unpack_from(buf, pos)
        if seq == 0 or flags not in (DATA, TOMBSTONE) or key_len > MAX_KEY_BYTES:
            return None
        end = pos + _ENTRY.size + key_len
        if end > len(buf):
            break
        try:
            key = bytes(buf[pos + _ENTRY.size : end]).decode()
        except UnicodeDecodeError:
            return None
        out.append((key, RecordInfo(segment, off, length, csum, seq, flags)))
        pos = end
    return pos


def pack_trailer(summary_offset: int, summary_record_bytes: int, version: int = VERSION) -> bytes:
    head = _TRAILER.pack(TRAILER_MAGIC, version, 0, 0, summary_offset, summary_record_bytes, 0)
    crc = zlib.crc32(head[: _TRAILER.size - 4])
    return head[: _TRAILER.size - 4] + struct.pack("<I", crc) + bytes(BLOCK - _TRAILER.size)


def parse_trailer(block: bytes) -> tuple[int, int, int] | None:
    """(format version, summary offset, summary bytes) of a trailer block, or None."""
    if len(block) < _TRAILER.size or block[:8] != TRAILER_MAGIC:
        return None
    _, version, _, _, off, nbytes, crc = _TRAILER.unpack_from(block)
    if version not in (VERSION_1, VERSION) or zlib.crc32(block[: _TRAILER.size - 4]) != crc:
        return None
    return version, off, nbytes


# ---- scanning: umbp.pool.ssd.recovery --------------------------------------------------------------------


def scan(directory: str):  # noqa: ANN201 - re-exported for callers that import it from here
    """umbp.pool.ssd.recovery.scan (the scanner lives there, beside the resync and the flush mark)."""
    from umbp.pool.ssd.recovery import scan as _scan

    return _scan(directory)


def scan_directory(directory: str) -> dict[str, RecordInfo]:
    """umbp.pool.ssd.recovery.scan_directory: key -> RecordInfo of every object a restart would serve."""
    from umbp.pool.ssd.recovery import scan_directory as _scan_directory

    return _scan_directory(directory)
