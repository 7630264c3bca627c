"""SSD faults become clear errors or counted misses: never a crash, a hang, or wrong bytes.

Backpressure, disk full (injected and, where this host lets root mount a tmpfs, real), a missing or
read-only directory, a truncated file, bit flips, a torn tail or a torn group head, a segment or the whole
directory deleted under the running process; and directories written in format 1 (before group heads),
served after the upgrade."""

import errno
import os
import shutil
import subprocess
import threading
import time
import uuid

import numpy as np
import pytest

import umbp.pool.ssd.io_hooks as ssd_io
from umbp.pool.checksum import checksum_u8
from umbp.pool.ssd.format import (
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
from umbp.pool.ssd.tier import SsdDirectoryError, SsdTier

KiB, MiB = 1024, 1 << 20

pytestmark = pytest.mark.usefixtures("impl")  # each test on the C extension's paths and on the Python ones


def _blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _tier(path, **kw) -> SsdTier:
    kw.setdefault("capacity_bytes", 16 * MiB)
    kw.setdefault("queue_bytes", 4 * MiB)
    kw.setdefault("health_interval_s", 0.05)
    return SsdTier(str(path), **kw)


def _check(tier: SsdTier, blobs: dict[str, np.ndarray]) -> list[str]:
    """Keys served; asserts every one served is byte-exact."""
    served = []
    for k, v in blobs.items():
        out = np.empty(v.size, np.uint8)
        if tier.get_into([k], [out])[0]:
            assert np.array_equal(out, v), k
            served.append(k)
    return served


def _payload_offset(path, key: str) -> int:
    """Where `key`'s payload starts in its segment, as the restart scan reads it."""
    return scan(str(path)).records[key].offset


def _segments(path) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.startswith("seg-"))


def _wait(cond, timeout=5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_backpressure_skips_saves_without_blocking_and_lookups_stay_right(tmp_path, blocked_writer):
    blobs = {f"k{i}": _blob(100 * KiB, i) for i in range(30)}
    with _tier(tmp_path, queue_bytes=1 * MiB) as tier:
        start = time.monotonic()
        ok = [tier.put([k], [v])[0] for k, v in blobs.items()]
        assert time.monotonic() - start < 2.0  # the writer is wedged, yet no put waited for it
        accepted = [k for k, o in zip(blobs, ok) if o]
        dropped = [k for k, o in zip(blobs, ok) if not o]
        assert 5 <= len(accepted) <= 10 and tier.stats()["dropped_backpressure"] == len(dropped)
        assert tier.exists(list(blobs)) == ok  # a skipped save is absent, not "maybe"
        assert _check(tier, blobs) == accepted  # served from staging, exact
        blocked_writer.set()
        assert tier.flush(timeout=30)
        assert tier.put([dropped[0]], [blobs[dropped[0]]]) == [True]  # room again
    with _tier(tmp_path) as tier:
        assert sorted(_check(tier, blobs)) == sorted(accepted + dropped[:1])


def test_close_with_a_wedged_disk_returns_instead_of_hanging(tmp_path, blocked_writer):
    tier = _tier(tmp_path)
    tier.put(["a", "b"], [b"1", b"2"])
    time.sleep(0.05)  # the writer is now stuck inside its first write
    tier.put(["c"], [b"3"])
    start = time.monotonic()
    assert tier.close(timeout=0.2) is False and time.monotonic() - start < 2.0
    assert tier.stats()["dropped_write_error"] >= 1


def test_disk_full_injected(tmp_path, monkeypatch):
    real = ssd_io.pwritev
    fail = {"on": True}

    def pwritev(fd, iov, off):
        if fail["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, iov, off)

    blobs = {f"k{i}": _blob(50 * KiB, i) for i in range(6)}
    with _tier(tmp_path) as tier:
        tier.put(["early"], [b"written before the disk filled"])
        tier.flush()
        monkeypatch.setattr(ssd_io, "pwritev", pwritev)
        assert tier.put(list(blobs)[:3], list(blobs.values())[:3]) == [True] * 3  # staged
        assert tier.flush(timeout=30)
        s = tier.stats()
        assert (
            s["enospc"] >= 1 and s["dropped_write_error"] == 3 and tier.exists(list(blobs)[:3]) == [False] * 3
        )
        fail["on"] = False
        assert tier.put(list(blobs)[3:], list(blobs.values())[3:]) == [True] * 3
        assert tier.flush(timeout=30)
        assert _check(tier, blobs) == list(blobs)[3:]
        out = bytearray(30)
        assert tier.get_into(["early"], [out]) in ([True], [False])  # reclaimed to make room, or kept
        assert out == b"written before the disk filled" or not tier.exists(["early"])[0]


def _try_mount_tmpfs(path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    os.makedirs(path, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


@pytest.fixture
def small_fs(tmp_path):
    """A real 2 MiB filesystem (tmpfs; needs root and mount rights, else the test is skipped)."""
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:8]}"
    if not _try_mount_tmpfs(mnt, "2m"):
        pytest.skip("cannot mount a small tmpfs here (needs root with mount rights)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_real_filesystem(small_fs):
    """capacity_bytes says 64 MiB but the filesystem holds 2 MiB: the tier lowers its limit to what the
    filesystem has, reclaims, and every object it serves is exact."""
    blobs = {f"k{i}": _blob(200 * KiB, i) for i in range(30)}  # 6 MiB through a 2 MiB disk
    with _tier(small_fs, capacity_bytes=64 * MiB, segment_bytes=256 * KiB) as tier:
        for k, v in blobs.items():
            tier.put([k], [v])
            tier.flush(timeout=30)
        s = tier.stats()
        assert s["limit_bytes"] <= 2 * MiB and s["used_bytes"] <= 2 * MiB
        served = _check(tier, blobs)
        assert served and "k29" in served
        filler = small_fs / "filler"  # another user fills the disk behind our back: real ENOSPC
        try:
            with open(filler, "wb") as f:
                f.write(bytes(4 * MiB))
        except OSError:
            pass
        tier.put(["late"], [_blob(200 * KiB, 99)])
        tier.flush(timeout=30)
        assert tier.stats()["enospc"] >= 1 or tier.exists(["late"]) == [True]
        _check(tier, blobs)


def test_missing_or_unusable_directory(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SsdDirectoryError, match=r"cannot use SSD directory .*afile/sub"):
        SsdTier(str(afile / "sub"), capacity_bytes=1 * MiB)
    with pytest.raises(SsdDirectoryError, match="afile"):
        SsdTier(str(afile), capacity_bytes=1 * MiB)
    with _tier(tmp_path / "new" / "deep") as tier:  # a missing directory with a writable parent: created
        assert tier.put(["k"], [b"v"]) == [True]


def test_read_only_directory(tmp_path, monkeypatch):
    """Root ignores permission bits, so read-only is what a read-only mount says: EROFS."""
    real_open = os.open

    def ro_open(path, flags, *a, **kw):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", ro_open)
    with pytest.raises(SsdDirectoryError, match="is not writable .Read-only file system.*writable directory"):
        SsdTier(str(tmp_path), capacity_bytes=1 * MiB)


def test_read_only_mount(tmp_path):
    mnt = tmp_path / "ro"
    if not _try_mount_tmpfs(mnt, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root with mount rights)")
    try:
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode == 0
        with pytest.raises(SsdDirectoryError, match="Read-only file system"):
            SsdTier(str(mnt), capacity_bytes=1 * MiB)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_truncated_segment_while_running_and_at_restart(tmp_path):
    blobs = {f"k{i}": _blob(30 * KiB + i, i) for i in range(8)}
    with _tier(tmp_path) as tier:
        tier.put(list(blobs), list(blobs.values()))
        tier.flush()
        (seg,) = _segments(tmp_path)
        # records 0-3 and one block of record 4: cut where record 4's payload starts, plus a block (the
        # writer may have made more than one group of the 8 records, whatever the copies' speed)
        os.truncate(seg, _payload_offset(tmp_path, "k4") + BLOCK)
        served = _check(tier, blobs)
        assert served == [f"k{i}" for i in range(4)] and tier.stats()["read_errors"] == 4
    with _tier(tmp_path) as tier:  # the sealed summary is gone with the tail: walked, torn record dropped
        assert _check(tier, blobs) == [f"k{i}" for i in range(4)]


def test_bit_flips_are_misses_never_wrong_bytes(tmp_path):
    blobs = {f"k{i}": _blob(20 * KiB, i) for i in range(6)}
    with _tier(tmp_path) as tier:
        tier.put(list(blobs), list(blobs.values()))
        tier.flush()
        (seg,) = _segments(tmp_path)
        loc = scan_directory(str(tmp_path))["k2"]
        with open(seg, "r+b") as f:  # one bit in k2's payload
            f.seek(loc.offset + 12_345)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x20]))
        assert _check(tier, blobs) == ["k0", "k1", "k3", "k4", "k5"]
        assert tier.stats()["checksum_failures"] == 1 and tier.exists(["k2"]) == [False]
    with _tier(tmp_path) as tier:  # after a restart the corrupt record is listed again, and caught again
        assert _check(tier, blobs) == ["k0", "k1", "k3", "k4", "k5"]


def _unseal(seg: str) -> None:
    """Strip the summary and trailer, as if the process had died before sealing."""
    records = [r for s in scan(os.path.dirname(seg)).segments if s.path == seg for _, r in s.records]
    os.truncate(seg, max(r.offset + r.nbytes for r in records))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))


def test_torn_tail_and_corrupt_headers_at_restart(tmp_path):
    blobs = {f"k{i}": _blob(10 * KiB, i) for i in range(6)}
    with _tier(tmp_path) as tier:
        tier.put(list(blobs)[:5], list(blobs.values())[:5])
    (seg1,) = _segments(tmp_path)
    _unseal(seg1)
    with open(seg1, "r+b") as f:  # a torn last record: its last block never reached the disk
        f.seek(os.path.getsize(seg1) - BLOCK)
        f.write(os.urandom(BLOCK))
    with _tier(tmp_path) as tier:  # the walk verifies every payload: the torn last record is discarded
        assert _check(tier, blobs) == ["k0", "k1", "k2", "k3"]
        tier.put(["k4", "k5"], [blobs["k4"], blobs["k5"]])
    seg1, seg2 = _segments(tmp_path)
    with open(seg1, "ab") as f:  # garbage after a sealed segment's trailer: walked instead, same records
        f.write(os.urandom(3 * BLOCK))
    _flip(seg2, 20)  # a header bit of k4 in a sealed segment: the summary lists it, its payload is intact
    with _tier(tmp_path) as tier:
        assert _check(tier, blobs) == list(blobs)  # served: psum64 proves the bytes
    _unseal(seg2)  # now the newer segment must be walked: its corrupt first header ends the walk
    with _tier(tmp_path) as tier:
        assert _check(tier, blobs) == ["k0", "k1", "k2", "k3"]


def test_a_torn_record_in_the_middle_of_a_walked_segment_is_a_miss_and_the_walk_goes_on(tmp_path):
    """A crash with several writes in flight can cut an earlier write short while a later one completed:
    a torn record with intact records after it. The torn record is a miss (never indexed, so nothing fails
    its checksum when read); the records after it are still served (the walk used to stop there)."""
    blobs = {f"k{i}": _blob(10 * KiB, i) for i in range(5)}
    with _tier(tmp_path) as tier:
        tier.put(list(blobs), list(blobs.values()))
    (seg,) = _segments(tmp_path)
    _unseal(seg)
    loc = scan_directory(str(tmp_path))["k2"]
    with open(seg, "r+b") as f:  # k2's last payload block never reached the disk (a hole reads as zeros)
        f.seek(loc.offset + padded(loc.length) - BLOCK)
        f.write(bytes(BLOCK))
    assert sorted(scan_directory(str(tmp_path))) == ["k0", "k1", "k3", "k4"]
    with _tier(tmp_path) as tier:
        assert _check(tier, blobs) == ["k0", "k1", "k3", "k4"]
        assert tier.stats()["checksum_failures"] == 0
        tier.put(["k2"], [blobs["k2"]])
    with _tier(tmp_path) as tier:  # the walked segment was sealed with k2 as a miss; k2 is in the next one
        assert _check(tier, blobs) == ["k0", "k1", "k2", "k3", "k4"]


def test_segment_deleted_under_the_running_process(tmp_path):
    blobs = {f"k{i}": _blob(40 * KiB, i) for i in range(12)}
    with _tier(tmp_path, segment_bytes=256 * KiB) as tier:
        tier.put(list(blobs), list(blobs.values()))
        tier.flush()
        segs = _segments(tmp_path)
        assert len(segs) >= 2
        os.unlink(segs[0])
        assert _wait(lambda: tier.stats()["segments_lost"] == 1)
        served = _check(tier, blobs)
        assert 0 < len(served) < len(blobs)
        assert tier.put(["after"], [b"still works"]) == [True] and tier.flush()
    with _tier(tmp_path) as tier:
        assert sorted(_check(tier, blobs)) == sorted(served) and tier.exists(["after"]) == [True]


def test_directory_deleted_under_the_running_process(tmp_path):
    d = tmp_path / "ssd"
    blobs = {f"k{i}": _blob(10 * KiB, i) for i in range(4)}
    with _tier(d) as tier:
        tier.put(list(blobs), list(blobs.values()))
        tier.flush()
        shutil.rmtree(d)
        assert _wait(lambda: bool(tier.stats()["failed_dirs"]))
        assert "vanished" in tier.stats()["failed_dirs"][str(d)]
        assert tier.exists(list(blobs)) == [False] * 4 and _check(tier, blobs) == []
        assert tier.put(["new"], [b"x"]) == [False] and tier.stats()["dropped_failed"] == 1


def test_a_tombstone_that_cannot_be_written_is_counted(tmp_path, monkeypatch):
    """remove() of a key on disk queues a tombstone; if its write fails, the key stays removed in this
    process and the drop is counted. After a restart the older record is served again (documented:
    checksum-verified, the last bytes stored under that key) — the counter is how an operator sees it."""
    data = _blob(20 * KiB, 1)
    real = ssd_io.pwritev
    with _tier(tmp_path, direct_io=False) as tier:
        assert tier.put(["k"], [data]) == [True] and tier.flush(timeout=30)

        def pwritev(fd, iov, off):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(ssd_io, "pwritev", pwritev)
        assert tier.remove(["k"]) == 1
        assert tier.flush(timeout=30)
        s = tier.stats()
        assert s["tombstones_dropped"] == 1 and s["tombstones"] == 0 and s["write_errors"] >= 1
        assert tier.exists(["k"]) == [False]
        monkeypatch.setattr(ssd_io, "pwritev", real)
    with _tier(tmp_path) as tier:
        assert _check(tier, {"k": data}) == ["k"]
        assert tier.stats()["tombstones_dropped"] == 0


def test_direct_writes_refused_mid_run_fall_back_to_buffered(tmp_path, monkeypatch):
    """direct_io='auto' on a filesystem that opens files with O_DIRECT but refuses direct writes (EINVAL),
    with two writes in flight: the first one's EINVAL switches the directory to buffered I/O; the second
    one was issued as a direct write too and fails only after that switch — it must be retried, not
    dropped. Then rollovers and a restart: nothing is lost."""
    import fcntl

    probe = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    os.close(probe)  # (raises here if this filesystem refuses O_DIRECT at open: the test needs it)
    real, both_in_flight, calls, holder = ssd_io.pwritev, threading.Barrier(2, timeout=10), [], {}

    def pwritev(fd, iov, off):
        calls.append(fd)
        n = len(calls)
        if n <= 2:  # the first two writes: both in flight as direct writes
            both_in_flight.wait()
            if n == 2:  # the second fails after the first has switched the directory
                assert _wait(lambda: not holder["tier"]._shards[0].direct, timeout=10)
            raise OSError(errno.EINVAL, "Invalid argument")
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, iov, off)

    monkeypatch.setattr(ssd_io, "pwritev", pwritev)
    blobs = {f"k{i}": _blob(60 * KiB, i) for i in range(20)}
    # A health check settles the writes in flight; one due while the first write waits at the barrier
    # (a put slower than the default test interval on a loaded host) would keep the second from starting.
    with _tier(
        tmp_path / "d",
        direct_io="auto",
        max_io_bytes=64 * KiB,
        segment_bytes=256 * KiB,
        health_interval_s=600,
    ) as tier:
        holder["tier"] = tier
        # Two writes are in flight only if the writer finds a second group queued behind its first; a put
        # slower than the writer (the numpy checksum path, a loaded host) would hand it one record at a
        # time. So the writer's first batch waits until the whole put is queued.
        staged, real_write_batch, first = threading.Event(), tier._write_batch, []

        def write_batch(shard, batch):
            if not first:
                first.append(True)
                staged.wait(30)
            return real_write_batch(shard, batch)

        monkeypatch.setattr(tier, "_write_batch", write_batch)
        assert all(tier.put(list(blobs), list(blobs.values())))
        staged.set()
        assert tier.flush(timeout=30)
        s = tier.stats()
        assert s["direct_io"] == [False] and s["write_errors"] == 0 and s["dropped_write_error"] == 0
        assert sorted(_check(tier, blobs)) == sorted(blobs)
    with _tier(tmp_path / "d", direct_io=False) as tier:
        assert sorted(_check(tier, blobs)) == sorted(blobs)


def test_a_torn_block_of_a_long_group_head_keeps_the_entries_before_it(tmp_path):
    """A group of many records with long keys has a head of several blocks. If one of its later blocks
    never reached the disk, the entries packed before it are still whole and so are their payloads
    (they sit after the whole head): those are kept, the rest of the group and everything after it is
    discarded, and nothing is served wrong."""
    keys = [f"ns/tp0/g1/{i:04d}/" + "h" * 200 for i in range(60)]  # ~256 bytes an entry: 4 head blocks
    blobs = {k: _blob(8 * KiB, i) for i, k in enumerate(keys)}
    with _tier(tmp_path) as tier:
        assert tier.put(keys, list(blobs.values())) == [True] * 60
    (seg,) = _segments(tmp_path)
    _unseal(seg)
    assert scan_directory(str(tmp_path))[keys[0]].offset == 4 * BLOCK  # one group, its head 4 blocks
    with open(seg, "r+b") as f:
        f.seek(2 * BLOCK)  # the head's third block
        f.write(bytes(BLOCK))
    kept = sorted(scan_directory(str(tmp_path)), key=keys.index)
    assert 16 <= len(kept) < 32 and kept == keys[: len(kept)]
    with _tier(tmp_path) as tier:
        assert _check(tier, blobs) == kept and tier.stats()["checksum_failures"] == 0
    with _tier(tmp_path) as tier:  # cut after the last kept payload and sealed: the same again
        assert _check(tier, blobs) == kept


def test_a_group_head_cut_short_is_discarded(tmp_path):
    """A crash that left only the first block of a several-block head: the head claims bytes the file
    does not have, so the group is discarded without reading past the end; the groups before it stay."""
    first = {f"a{i}": _blob(8 * KiB, i) for i in range(3)}
    keys = [f"ns/tp0/g1/{i:04d}/" + "h" * 200 for i in range(60)]
    with _tier(tmp_path) as tier:
        assert tier.put(list(first), list(first.values())) == [True] * 3
        assert tier.flush()
        assert tier.put(keys, [_blob(8 * KiB, 100 + i) for i in range(60)]) == [True] * 60
    (seg,) = _segments(tmp_path)
    _unseal(seg)
    second = scan_directory(str(tmp_path))[keys[0]].offset - 4 * BLOCK  # where the second group starts
    os.truncate(seg, second + BLOCK)
    result = scan(str(tmp_path))
    assert sorted(result.records) == sorted(first) and "runs past the end" in result.discarded[0]
    with _tier(tmp_path) as tier:
        assert _check(tier, first) == list(first)


# ---- directories written in format 1 (a 4 KiB header block per record, before format 2's group heads) ----
# are still served after an upgrade: sealed segments through their format-1 summary, unsealed ones walked
# record by record, torn ones cut where they tear; new writes go into format-2 segments beside them.


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


def test_a_format1_directory_is_served_and_grows_in_format2(tmp_path):
    blobs = {f"a{i}": _blob(10 * KiB + 3 * i, i) for i in range(4)} | {
        f"b{i}": _blob(64 * KiB, 10 + i) for i in range(3)
    }
    empty = np.zeros(0, np.uint8)
    _segment1(
        tmp_path,
        1,
        [(f"a{i}", DATA, 1 + i, blobs[f"a{i}"]) for i in range(4)]
        + [("gone", DATA, 5, _blob(5000, 99)), ("gone", TOMBSTONE, 6, empty)],
        sealed=True,
    )
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
    assert [s.sealed for s in segs] == [
        True,
        True,
        True,
    ]  # the walked format-1 segment was sealed at start-up
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
    assert sorted(scan_directory(str(tmp_path))) == ["k0", "k1", "k3"]  # k2 a miss, the walk goes on
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB) as tier:
        assert _check(tier, blobs) == ["k0", "k1", "k3"]
        assert tier.put(["k2"], [blobs["k2"]]) == [True]
    assert os.path.getsize(seg) > 4 * (BLOCK + padded(20 * KiB))  # sealed after k3
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB) as tier:
        assert _check(tier, blobs) == ["k0", "k1", "k2", "k3"]


def test_a_corrupt_format1_header_is_stepped_over_and_a_sealed_newer_record_withholds_the_older(tmp_path):
    """Format 1 is walked with the same resync: a zeroed header block loses its record (key unknown), the
    records after it are served. Here a later sealed segment proves the lost record was synced (its seq is
    below the newest sealed one), so the records older than the loss are withheld: the lost one may have
    been a newer version of any of them."""
    blobs = {f"k{i}": _blob(20 * KiB, i) for i in range(4)}
    _segment1(tmp_path, 1, [(k, DATA, 1 + i, v) for i, (k, v) in enumerate(blobs.items())], sealed=False)
    with open(tmp_path / segment_name(1), "r+b") as f:  # k1's header block
        f.seek(BLOCK + padded(20 * KiB))
        f.write(bytes(BLOCK))
    assert sorted(scan_directory(str(tmp_path))) == [
        "k0",
        "k2",
        "k3",
    ]  # nothing synced is known: a torn write
    late = _blob(8 * KiB, 50)
    _segment1(tmp_path, 2, [("late", DATA, 5, late)], sealed=True)  # the next seq: no records missing between
    assert sorted(scan_directory(str(tmp_path))) == ["k2", "k3", "late"]
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB) as tier:
        assert _check(tier, blobs | {"late": late}) == ["k2", "k3", "late"]
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB) as tier:  # decided once, kept
        assert _check(tier, blobs | {"late": late}) == ["k2", "k3", "late"]
