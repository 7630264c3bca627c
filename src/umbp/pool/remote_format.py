"""The value format of the shared tier: a 32-byte header in front of the object's bytes. Never pickle.

    offset size field
    0      4    magic b"UMBP"
    4      2    format version (1), little-endian
    6      2    header size (32): a later version may grow the header and stay readable
    8      8    payload length in bytes
    16     8    psum64 checksum of the payload (umbp.pool.psum)
    24     4    crc32 of the object key (utf-8): a value copied or renamed under another key is a miss
    28     4    reserved, zero

Why a header in the value: the shared tier is written by other processes and other machines, may be
restarted, filled by another umbp version or hit by a bug. A reader must be able to tell, from the value
alone, that it holds exactly the bytes some writer stored under this key; anything else is a miss.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"UMBP"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHQQI4x")
HEADER_SIZE = HEADER.size  # 32


def key_crc(key: str) -> int:
    return zlib.crc32(key.encode())


def pack_header(key: str, nbytes: int, checksum: int) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, nbytes, checksum, key_crc(key))


def inspect_header(header: bytes | memoryview, key: str, nbytes: int) -> tuple[str | None, int]:
    """(None, stored checksum) when the header fits `key` and an object of `nbytes`; else (why not, for
    the counters, and the checksum field)."""
    magic, version, size, length, checksum, crc = HEADER.unpack(header)
    if magic != MAGIC or size != HEADER_SIZE:
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
