"""The value format of the shared tier: a 32-byte header in front of the object's bytes. Never pickle.

    offset size field
    0      4    magic b"UMBP"
    4      2    format version (3), little-endian
    6      2    header size (32): a later version may grow the header and stay readable
    8      8    payload length in bytes
    16     8    psum64 checksum of the payload (umbp.pool.checksum, its format 2)
    24     4    crc32 of the object key (utf-8): a value copied or renamed under another key is a miss
    28     4    reserved, zero (a value with anything else there is a miss)

Why a header in the value: the shared tier is written by other processes and other machines, may be
restarted, filled by another umbp version or hit by a bug. A reader must be able to tell, from the value
alone, that it holds exactly the bytes some writer stored under this key; anything else is a miss.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"UMBP"
# 3: the checksum is psum64 format 2 (umbp.pool.checksum). A value of version 1 carries the additive format-1
# digest, which this code cannot check: it is a miss (counted in version_mismatches), never verified.
# (2 is the sealed layout's version, umbp.pool.remote.auth: skipped here so the two never collide.)
FORMAT_VERSION = 3
HEADER = struct.Struct("<4sHHQQI4x")
HEADER_SIZE = HEADER.size  # 32
CHECKSUM_AT, CHECKSUM_SIZE = 16, 8  # the one field a reader cannot know in advance
_BEFORE_CHECKSUM = struct.Struct("<4sHHQ")
_AFTER_CHECKSUM = struct.Struct("<I4x")
_RESERVED = b"\0" * 4


def key_crc(key: str) -> int:
    return zlib.crc32(key.encode())


def pack_header(key: str, nbytes: int, checksum: int) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, nbytes, checksum, key_crc(key))


def header_before_checksum(nbytes: int) -> bytes:
    """The header's bytes before the checksum field, as written for an object of `nbytes`."""
    return _BEFORE_CHECKSUM.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, nbytes)


def header_after_checksum(key: str) -> bytes:
    """The header's bytes after the checksum field, as written for `key`. With header_before_checksum,
    a reader compares a header with what it expects in two byte comparisons, and only a header that
    differs goes through inspect_header (to name the problem)."""
    return _AFTER_CHECKSUM.pack(key_crc(key))


def inspect_header(header: bytes | memoryview, key: str, nbytes: int) -> tuple[str | None, int]:
    """(None, stored checksum) when the header fits `key` and an object of `nbytes`; else (why not, for
    the counters, and the checksum field)."""
    magic, version, size, length, checksum, crc = HEADER.unpack(header)
    if magic != MAGIC or size != HEADER_SIZE or bytes(header[28:32]) != _RESERVED:
        return "header_failures", checksum
    if version != FORMAT_VERSION:
        return "version_mismatches", checksum
    if length != nbytes:
        return "size_mismatches", checksum
    if crc != key_crc(key):
        return "key_mismatches", checksum
    return None, checksum


def header_problem(header: bytes | memoryview, key: str, nbytes: int) -> str | None:
    """None when the header fits `key` and an object of `nbytes`; else why not (for counters)."""
    return inspect_header(header, key, nbytes)[0]


def stored_checksum(header: bytes | memoryview) -> int:
    return HEADER.unpack(header)[4]
