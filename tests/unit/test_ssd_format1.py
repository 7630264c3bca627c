"""Directories written in format 1 (a 4 KiB header block per record, before format 2's group heads) are
still served after an upgrade: sealed segments through their format-1 summary, unsealed ones walked record
by record, torn ones cut where they tear; new writes go into format-2 segments beside them."""

import os

import numpy as np
import pytest

from umbp.pool.psum import checksum_u8
from umbp.pool.ssd import SsdTier
from umbp.pool.ssd_format import (
    BLOCK,
    DATA,
    SUMMARY,
    TOMBSTONE,
    VERSION_1,
    RecordInfo,
    pack_header,
    pack_summary,
    pack_trailer,
    padded,
    scan,
    scan_directory,
    segment_name,
)

KiB, MiB = 1024, 1 << 20

pytestmark = pytest.mark.usefixtures("impl")


def _blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _record(key: str, flags: int, seq: int, payload: np.ndarray) -> bytes:
    """One format-1 record: its header block, then the payload zero-padded to whole blocks."""
    rec = np.zeros(BLOCK + (0 if flags == TOMBSTONE else padded(payload.size)), np.uint8)
    pack_header(rec[:BLOCK], key.encode(), flags, seq, payload.size, checksum_u8(payload))
    rec[BLOCK : BLOCK + payload.size] = payload
    return rec.tobytes()


def _segment1(path, number: int, records: list[tuple[str, int, int, np.ndarray]], sealed: bool) -> None:
    """A format-1 segment file as the code before format 2 wrote it (summary entries list header offsets)."""
    out, entries = b"", []
    for key, flags, seq, payload in records:
        entries.append((key, RecordInfo(number, len(out), payload.size, checksum_u8(payload), seq, flags)))
        out += _record(key, flags, seq, payload)
    if sealed:
        summary = np.frombuffer(pack_summary(entries), np.uint8)
        at = len(out)
        out += _record("", SUMMARY, 0, summary)
        out += pack_trailer(at, len(out) - at, VERSION_1)
    (path / segment_name(number)).write_bytes(out)


def _check(tier: SsdTier, blobs: dict[str, np.ndarray]) -> list[str]:
    served = []
    for k, v in blobs.items():
        out = np.empty(v.size, np.uint8)
        if tier.get_into([k], [out])[0]:
            assert np.array_equal(out, v), k
            served.append(k)
    return served


def test_a_format1_directory_is_served_and_grows_in_format2(tmp_path):
    blobs = {f"a{i}": _blob(10 * KiB + 3 * i, i) for i in range(4)} | {f"b{i}": _blob(64 * KiB, 10 + i) for i in range(3)}
    empty = np.zeros(0, np.uint8)
    _segment1(tmp_path, 1, [(f"a{i}", DATA, 1 + i, blobs[f"a{i}"]) for i in range(4)]
              + [("gone", DATA, 5, _blob(5000, 99)), ("gone", TOMBSTONE, 6, empty)], sealed=True)
    _segment1(tmp_path, 2, [(f"b{i}", DATA, 7 + i, blobs[f"b{i}"]) for i in range(3)], sealed=False)
    found = scan_directory(str(tmp_path))
    assert sorted(found) == sorted(blobs)
    assert found["a1"].offset == BLOCK + padded(10 * KiB) + BLOCK  # payload offsets, whatever the format
    new = {f"n{i}": _blob(64 * KiB, 20 + i) for i in range(5)}
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB) as tier:
        assert _check(tier, blobs) == list(blobs) and tier.exists(["gone"]) == [False]
        assert tier.get_into(list(blobs), [np.empty(v.size, np.uint8) for v in blobs.values()]) == [True] * 7
        assert tier.put(list(new), list(new.values())) == [True] * 5
    segs = scan(str(tmp_path)).segments
    assert [s.sealed for s in segs] == [True, True, True]  # the walked format-1 segment was sealed at start-up
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB) as tier:  # format-1 records, sealed by format 2
        assert _check(tier, blobs | new) == list(blobs | new)
        assert tier.stats()["checksum_failures"] == 0


def test_a_torn_format1_segment_is_cut_where_it_tears(tmp_path):
    blobs = {f"k{i}": _blob(20 * KiB, i) for i in range(4)}
    _segment1(tmp_path, 1, [(k, DATA, 1 + i, v) for i, (k, v) in enumerate(blobs.items())], sealed=False)
    seg = tmp_path / segment_name(1)
    with open(seg, "r+b") as f:  # k2's last payload block never reached the disk
        f.seek(3 * (BLOCK + padded(20 * KiB)) - BLOCK)
        f.write(bytes(BLOCK))
    assert sorted(scan_directory(str(tmp_path))) == ["k0", "k1"]
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB) as tier:
        assert _check(tier, blobs) == ["k0", "k1"]
        assert tier.put(["k2"], [blobs["k2"]]) == [True]
    assert os.path.getsize(seg) > 2 * (BLOCK + padded(20 * KiB))  # cut after k1, then sealed
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB) as tier:
        assert _check(tier, blobs) == ["k0", "k1", "k2"]
