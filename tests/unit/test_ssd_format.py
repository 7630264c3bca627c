"""The SSD on-disk format: headers, block checksums (equal to psum64), summaries, trailers, the scanner."""

import os

import numpy as np
import pytest

from umbp.pool.buffers import aligned_buffer
from umbp.pool.checksum import checksum
from umbp.pool.ssd.format import (
    BLOCK,
    DATA,
    MAX_KEY_BYTES,
    SUMMARY,
    TOMBSTONE,
    VERSION,
    VERSION_1,
    RecordInfo,
    block_rows,
    entry_span,
    head_bytes,
    pack_group,
    pack_header,
    pack_header_at,
    pack_headers,
    pack_summary,
    pack_trailer,
    padded,
    parse_entries,
    parse_group_head,
    parse_header,
    parse_trailer,
    psum_of_rows,
    psums_of_records,
    scan,
    scan_directory,
    segment_name,
    segment_number,
    unpack_summary,
)


def _blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_header_round_trip_and_every_corrupted_byte_is_rejected():
    block = np.zeros(BLOCK, np.uint8)
    key = "ns/tp0/g1/" + "ab" * 90
    pack_header(block, key.encode(), DATA, seq=77, length=123_456, checksum=2**63 + 5)
    h = parse_header(block)
    assert (h.flags, h.seq, h.length, h.checksum, h.key) == (DATA, 77, 123_456, 2**63 + 5, key)
    for pos in range(48 + len(key)):  # every meaningful byte: magic, fields, crc, key
        bad = block.copy()
        bad[pos] ^= 0x04
        assert parse_header(bad) is None, pos
    assert parse_header(np.zeros(BLOCK, np.uint8)) is None and parse_header(b"") is None


def test_group_head_round_trip_and_every_corrupted_byte_is_rejected():
    """A group head: every entry comes back in order; a flipped bit in the head's own fields rejects the
    group, one in an entry ends the intact entries just before it."""
    keys = [b"a", "n\u00e9/tp1/g0/".encode() + b"f" * 40, b"", b"x" * MAX_KEY_BYTES] + [
        b"k%d" % i for i in range(60)
    ]
    n = len(keys)
    flags = [DATA, TOMBSTONE, SUMMARY] + [DATA] * (n - 3)
    seqs, lengths, sums = (
        list(range(5, 5 + n)),
        [i * 1000 for i in range(n)],
        [2**64 - 1 - i for i in range(n)],
    )
    nbytes = head_bytes(sum(entry_span(len(k)) for k in keys))
    assert nbytes == 2 * BLOCK  # 64 entries and a 1 KiB key spill into a second block
    buf = np.frombuffer(
        bytearray(np.random.default_rng(1).integers(0, 256, 3 * BLOCK, dtype=np.uint8).tobytes()), np.uint8
    )
    assert pack_group(memoryview(buf), keys, flags, seqs, lengths, sums) == nbytes
    raw = buf[:nbytes].tobytes()
    assert parse_group_head(raw) == (n, nbytes)
    got = parse_entries(raw, n)
    assert [(h.key.encode(), h.flags, h.seq, h.length, h.checksum) for h in got] == list(
        zip(keys, flags, seqs, lengths, sums, strict=True)
    )
    end = 24 + sum(entry_span(len(k)) for k in keys)
    assert not raw[end:].strip(b"\0")  # zeros to the block boundary
    for pos in range(20):  # the head's fields and its crc
        bad = bytearray(raw)
        bad[pos] ^= 0x10
        assert parse_group_head(bytes(bad)) is None, pos
    at = 24 + entry_span(len(keys[0]))  # the second entry's first byte
    bad = bytearray(raw)
    bad[at + 17] ^= 1
    assert [h.key.encode() for h in parse_entries(bytes(bad), n)] == keys[:1]
    assert parse_header(raw[24:], VERSION_1) is None  # an entry is not a format-1 header block, and back
    block = np.zeros(BLOCK, np.uint8)
    pack_header(block, b"k", DATA, 1, 2, 3)
    assert parse_header(block, VERSION) is None and parse_header(block, VERSION_1) is not None


@pytest.mark.parametrize("span", [BLOCK, 0])
def test_pack_headers_writes_what_pack_header_at_writes(impl, span):
    """The writer's batched form (one C call with the extension) gives the same bytes, whatever was in
    the buffer before (each header is zero-padded to its span: a block, or its own size as a group's
    entry), and parse_header reads them back."""
    rng = np.random.default_rng(5)
    keys = [b"", b"k", "n\u00e9/tp1/g0/".encode() + b"f" * 40, b"x" * MAX_KEY_BYTES]
    keys += [bytes(rng.integers(33, 127, int(rng.integers(1, 300)), dtype=np.uint8)) for _ in range(20)]
    n = len(keys)
    ats = [int(a) * BLOCK for a in rng.permutation(2 * n)[:n]]
    flags = [int(f) for f in rng.integers(0, 2, n)]
    seqs = [int(v) for v in rng.integers(0, 2**63, n, dtype=np.int64)]
    seqs[0] = 2**64 - 1
    lengths = [int(v) for v in rng.integers(0, 2**40, n)]
    checksums = [int(v) for v in rng.integers(0, 2**63, n, dtype=np.int64)]
    checksums[1] = 2**64 - 1
    got = np.frombuffer(bytearray(rng.integers(0, 256, 2 * n * BLOCK, dtype=np.uint8).tobytes()), np.uint8)
    want = np.zeros_like(got)
    pack_headers(memoryview(got), ats, keys, flags, seqs, lengths, checksums, span)
    for args in zip(ats, keys, flags, seqs, lengths, checksums, strict=True):
        pack_header_at(memoryview(want), *args, span)
    for i, at in enumerate(ats):
        end = at + (span or entry_span(len(keys[i])))
        assert np.array_equal(got[at:end], want[at:end]), i
        h = parse_header(got[at:end], VERSION)
        assert (h.flags, h.seq, h.length, h.checksum, h.key.encode()) == (
            flags[i],
            seqs[i],
            lengths[i],
            checksums[i],
            keys[i],
        )


def test_native_pack_headers_rejects_bad_input():
    from umbp.pool import native

    if native.lib is None:
        pytest.skip(f"the C extension is {native.why_not}")
    from umbp.pool.ssd.format import MAGIC, VERSION

    buf = bytearray(2 * BLOCK)
    ok = ([0], [b"k"], [0], [1], [2], [3])
    native.lib.pack_headers(buf, *ok, MAGIC, VERSION)
    with pytest.raises(ValueError, match="does not fit"):
        native.lib.pack_headers(buf, [BLOCK + 1], *ok[1:], MAGIC, VERSION)  # runs past the buffer
    with pytest.raises(ValueError, match="does not fit"):
        native.lib.pack_headers(buf, [0], [b"k" * (BLOCK - 47)], *ok[2:], MAGIC, VERSION)
    with pytest.raises(ValueError, match="differ in length"):
        native.lib.pack_headers(buf, [0, BLOCK], *ok[1:], MAGIC, VERSION)
    with pytest.raises(TypeError):
        native.lib.pack_headers(buf, [0], ["k"], *ok[2:], MAGIC, VERSION)
    with pytest.raises(OverflowError):
        native.lib.pack_headers(buf, [-1], *ok[1:], MAGIC, VERSION)
    with pytest.raises(BufferError):
        native.lib.pack_headers(bytes(BLOCK), *ok, MAGIC, VERSION)  # read-only
    with pytest.raises(ValueError, match="does not fit"):
        native.lib.pack_headers(
            buf, [0], [b"k" * 17], *ok[2:], MAGIC, VERSION, 64
        )  # 48 + 17 > a 64-byte span
    with pytest.raises(ValueError, match="does not fit"):
        native.lib.pack_headers(
            buf, [2 * BLOCK - 48], [b"k"], *ok[2:], MAGIC, VERSION, 0
        )  # its 56 bytes run past
    with pytest.raises(ValueError, match="span"):
        native.lib.pack_headers(buf, *ok, MAGIC, VERSION, BLOCK + 8)


@pytest.mark.parametrize("n", [0, 1, 7, 4095, 4096, 4097, 100_003, 3 * 4096])
def test_block_checksums_equal_psum64(n):
    """The read path computes psum64 from zero-padded block sums; it must equal umbp.pool.checksum.checksum."""
    data = _blob(n, n)
    rec = aligned_buffer(padded(n))
    rec[:] = 0
    rec[:n] = data
    rows = block_rows(rec)
    assert psum_of_rows(rows, n) == checksum(data)
    if n:
        three = np.concatenate([rec, rec, rec])
        assert psums_of_records(block_rows(three), 3, n) == [checksum(data)] * 3


def test_summary_and_trailer_round_trip():
    entries = [("a", RecordInfo(3, 0, 10, 99, 1)), ("ключ", RecordInfo(3, 8192, 0, 0, 2, TOMBSTONE))]
    assert unpack_summary(pack_summary(entries), 3) == entries
    assert unpack_summary(pack_summary(entries)[:-1], 3) is None
    trailer = pack_trailer(1 << 20, 8192)
    assert len(trailer) == BLOCK and parse_trailer(trailer) == (VERSION, 1 << 20, 8192)
    assert parse_trailer(trailer[:20] + bytes([trailer[20] ^ 1]) + trailer[21:]) is None


def test_segment_names():
    assert segment_name(42) == "seg-000000000042.umbp" and segment_number(segment_name(42)) == 42
    assert segment_number("LOCK") is None and segment_number("seg-1.umbp") is None


def test_scan_of_empty_and_foreign_directories(tmp_path):
    assert scan_directory(str(tmp_path)) == {}
    (tmp_path / "notes.txt").write_text("not a segment")
    (tmp_path / segment_name(1)).write_bytes(os.urandom(3 * BLOCK))  # garbage: no valid header
    result = scan(str(tmp_path))
    assert result.records == {} and result.next_segment == 2 and result.next_seq == 1
    assert "no valid header at offset 0" in result.discarded[0]
