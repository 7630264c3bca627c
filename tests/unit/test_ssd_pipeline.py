"""The SSD writer keeps writes in flight while it prepares the next group (puts copy in parallel and queue
run by run, seals run on an I/O thread): the disk is never idle while Python runs, yet the log keeps its
invariants — records land in order, a short write takes the writes queued behind it with it and leaves
no record after a hole, and a full segment is sealed once its last write has landed."""

import os
import threading
import time

import numpy as np
import pytest
from test_ssd_faults import _check, _wait  # byte-exact read-back of every key served; polling

import umbp.pool.ssd.io_hooks as ssd_io
from umbp.pool.errors import OptionValueError
from umbp.pool.ssd.format import record_bytes, scan
from umbp.pool.ssd.tier import SsdTier

KiB, MiB = 1024, 1 << 20
OBJ = 60 * KiB  # a 64 KiB record: with max_io_bytes=64 KiB every write carries one record


def _blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_writes_overlap_write_depth_at_a_time(tmp_path, monkeypatch):
    """While one write is in the kernel, the next ones are already queued behind it."""
    real, lock = ssd_io.pwritev, threading.Lock()
    now, peak = [0], [0]

    def pwritev(fd, iov, off):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.01)  # a slow disk: the writer prepares the next group meanwhile
        try:
            return real(fd, iov, off)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(ssd_io, "pwritev", pwritev)
    blobs = {f"k{i}": _blob(OBJ, i) for i in range(12)}
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB, queue_bytes=2 * MiB, max_io_bytes=64 * KiB) as tier:
        assert all(tier.put(list(blobs), list(blobs.values())))
        assert tier.flush(timeout=30)
        assert peak[0] == ssd_io.WRITE_DEPTH == 3
        assert sorted(_check(tier, blobs)) == sorted(blobs)
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB) as tier:  # a restart finds them all
        assert sorted(_check(tier, blobs)) == sorted(blobs)


def test_a_short_write_drops_the_write_behind_it_and_leaves_no_record_after_the_hole(tmp_path, monkeypatch):
    """Write A stalls and then falls short; write B, queued behind it, completes first. B must not be
    indexed, and its bytes must not survive past the hole where a restart would find them."""
    real = ssd_io.pwritev
    gate, calls = threading.Event(), []

    def pwritev(fd, iov, off):
        calls.append(off)
        if len(calls) == 1:  # A: wait until B has been written, then write only half
            gate.wait(10)
            return real(fd, [memoryview(iov[0])[: OBJ // 2]], off)
        return real(fd, iov, off)

    monkeypatch.setattr(ssd_io, "pwritev", pwritev)
    blobs = {k: _blob(OBJ, i) for i, k in enumerate(("a", "b", "c"))}
    tier = SsdTier(
        str(tmp_path), capacity_bytes=16 * MiB, queue_bytes=2 * MiB, max_io_bytes=64 * KiB, direct_io=False
    )
    try:
        assert tier.put(["a", "b"], [blobs["a"], blobs["b"]]) == [True] * 2
        assert _wait(lambda: len(calls) >= 2, timeout=10)  # B was written while A still hung
        time.sleep(0.05)
        gate.set()
        assert tier.flush(timeout=30)
        s = tier.stats()
        assert s["dropped_write_error"] == 2 and tier.exists(["a", "b"]) == [False, False]
        assert tier.put(["c"], [blobs["c"]]) == [True] and tier.flush(timeout=30)
        assert _check(tier, blobs) == ["c"]
        assert calls == [0, record_bytes(OBJ), 0]  # c went where a's record should have been
        seg = scan(str(tmp_path)).segments[-1]
        assert seg.size == record_bytes(OBJ)  # cut back: nothing of b is left behind c
    finally:
        tier.close()
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB) as tier:
        assert _check(tier, blobs) == ["c"]  # b is not resurrected by a restart


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_segment_is_sealed_once_its_last_write_lands(tmp_path, monkeypatch, in_flight):
    """Rolling over to a new segment while the old one's last write is in flight (a slow disk), or with
    nothing in flight (a flush after every put): the old one is sealed once its writes have landed (its
    summary lists them), not before and not never."""
    real = ssd_io.pwritev
    if in_flight:
        monkeypatch.setattr(ssd_io, "pwritev", lambda *a: (time.sleep(0.005), real(*a))[1])
    blobs = {f"k{i}": _blob(OBJ, i) for i in range(14)}
    with SsdTier(
        str(tmp_path),
        capacity_bytes=8 * MiB,
        queue_bytes=2 * MiB,
        max_io_bytes=64 * KiB,
        segment_bytes=256 * KiB,
    ) as tier:
        for k, v in blobs.items():
            assert tier.put([k], [v]) == [True]
            if not in_flight:
                assert tier.flush(timeout=30)
        assert tier.flush(timeout=30)
        segs = scan(str(tmp_path)).segments
        assert len(segs) == 4 and [s.sealed for s in segs] == [True, True, True, False]
        listed = [k for s in segs[:3] for k, _ in s.records]
        assert listed == [f"k{i}" for i in range(12)]  # each summary lists its 4 records, in order
        assert sorted(_check(tier, blobs)) == sorted(blobs)
    with SsdTier(str(tmp_path), capacity_bytes=8 * MiB) as tier:
        assert sorted(_check(tier, blobs)) == sorted(blobs)


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_parallel_put_copies_store_exact_bytes(tmp_path, copy_threads):
    """A put big enough to be split across copy threads (mixed sizes, so several kinds of runs) stores
    every object exactly, checksums included: a restart verifies each one on read."""
    sizes = [64 * KiB] * 40 + [300 * KiB, 5000, 64 * KiB + 1] * 4
    blobs = {f"k{i}": _blob(n, i) for i, n in enumerate(sizes)}
    with SsdTier(
        str(tmp_path), capacity_bytes=64 * MiB, queue_bytes=16 * MiB, copy_threads=copy_threads
    ) as tier:
        assert all(tier.put(list(blobs), list(blobs.values())))
        assert sorted(_check(tier, blobs)) == sorted(blobs)  # from staging or disk
        assert tier.flush(timeout=30)
    with SsdTier(str(tmp_path), capacity_bytes=64 * MiB) as tier:
        assert sorted(_check(tier, blobs)) == sorted(blobs)
        assert tier.stats()["checksum_failures"] == 0


def test_copy_threads_must_be_positive(tmp_path):
    with pytest.raises(OptionValueError, match="copy_threads"):
        SsdTier(str(tmp_path), capacity_bytes=16 * MiB, copy_threads=0)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("seg-")]


def test_a_writer_error_with_a_write_in_flight_drops_it_everywhere(tmp_path, monkeypatch):
    """An unexpected error while the writer prepares a group, with the previous group still in flight:
    the directory is failed (reads go on), and the in-flight write is dropped in memory and cut off the
    file, so a restart does not serve what this process reported as dropped."""
    early = _blob(OBJ, 99)
    blobs = {k: _blob(OBJ, i) for i, k in enumerate(("a", "b", "c"))}
    tier = SsdTier(
        str(tmp_path), capacity_bytes=16 * MiB, queue_bytes=2 * MiB, max_io_bytes=64 * KiB, direct_io=False
    )
    try:
        assert tier.put(["early"], [early]) == [True] and tier.flush(timeout=30)
        real_images, real_pwritev, calls = tier._images, ssd_io.pwritev, []

        def images(group, seqs):
            calls.append(group[0].key)
            if len(calls) == 2:  # "a" is in flight now
                raise RuntimeError("injected")
            return real_images(group, seqs)

        monkeypatch.setattr(tier, "_images", images)
        monkeypatch.setattr(ssd_io, "pwritev", lambda *a: (time.sleep(0.05), real_pwritev(*a))[1])
        assert tier.put(list(blobs), list(blobs.values())) == [True] * 3
        assert tier.flush(timeout=30)
        s = tier.stats()
        assert s["failed_dirs"] and s["dropped_write_error"] + s["dropped_failed"] == 3
        assert _check(tier, {"early": early, **blobs}) == ["early"]
    finally:
        tier.close()
    with SsdTier(str(tmp_path), capacity_bytes=16 * MiB) as tier:
        assert _check(tier, {"early": early, **blobs}) == ["early"]


@pytest.mark.parametrize("copy_threads", [1, 2])
def test_a_big_put_is_written_while_it_is_still_copied(tmp_path, monkeypatch, copy_threads):
    """A put queues its objects run by run (~1 MiB), so the disk starts on the first run while the last
    one is still being copied: the last run's copy waits here until a write has begun."""
    real, started = ssd_io.pwritev, threading.Event()

    def pwritev(fd, iov, off):
        started.set()
        return real(fd, iov, off)

    monkeypatch.setattr(ssd_io, "pwritev", pwritev)
    blobs = {f"k{i}": _blob(64 * KiB, i) for i in range(64)}  # 4 runs of 16 records
    waited = []
    with SsdTier(
        str(tmp_path), capacity_bytes=64 * MiB, queue_bytes=16 * MiB, copy_threads=copy_threads
    ) as tier:
        real_copy = tier._copy_run

        def copy_run(staged, srcs, i, j):
            if j == len(staged):  # the last run: hold it until the writer has started on an earlier one
                waited.append(started.wait(10))
            real_copy(staged, srcs, i, j)

        monkeypatch.setattr(tier, "_copy_run", copy_run)
        assert all(tier.put(list(blobs), list(blobs.values())))
        assert waited == [True]
        assert tier.flush(timeout=30)
    with SsdTier(str(tmp_path), capacity_bytes=64 * MiB) as tier:
        assert sorted(_check(tier, blobs)) == sorted(blobs)


@pytest.mark.parametrize("copy_threads", [1, 2])
def test_a_copy_error_keeps_the_runs_already_queued_and_gives_back_the_rest(
    tmp_path, monkeypatch, copy_threads
):
    """A copy that raises mid-put: the runs queued before it are stored (exact bytes), the others are
    not stored and their staging comes back; the error reaches the caller."""
    blobs = {f"k{i:02}": _blob(64 * KiB, i) for i in range(64)}  # runs of 15 records (~1 MiB)
    keys = list(blobs)
    with SsdTier(
        str(tmp_path), capacity_bytes=64 * MiB, queue_bytes=16 * MiB, copy_threads=copy_threads
    ) as tier:
        real_copy, copied, failed = tier._copy_run, [], []

        def copy_run(staged, srcs, i, j):
            if i <= 32 < j:
                failed.append((i, j))
                raise RuntimeError("injected copy failure")
            real_copy(staged, srcs, i, j)
            copied.extend(keys[i:j])

        monkeypatch.setattr(tier, "_copy_run", copy_run)
        with pytest.raises(RuntimeError, match="injected"):
            tier.put(keys, list(blobs.values()))
        assert tier.flush(timeout=30)
        assert len(failed) == 1 and keys[0] in copied and "k32" not in copied
        assert sorted(_check(tier, blobs)) == sorted(copied)  # stored exactly what was queued, bytes intact
        s = tier.stats()
        assert s["queued_bytes"] == 0 and s["staged"] == 0
        monkeypatch.setattr(tier, "_copy_run", real_copy)  # the given-back keys can be put again
        assert all(tier.put(list(blobs), list(blobs.values())))
        assert sorted(_check(tier, blobs)) == sorted(blobs)


def test_wait_for_room_blocks_until_staging_is_given_back(tmp_path, monkeypatch):
    real, gate = ssd_io.pwritev, threading.Event()
    monkeypatch.setattr(ssd_io, "pwritev", lambda *a: (gate.wait(10), real(*a))[1])
    tier = SsdTier(str(tmp_path), capacity_bytes=16 * MiB, queue_bytes=1 * MiB, max_io_bytes=64 * KiB)
    try:
        obj = 64 * KiB
        blobs = [_blob(obj, i) for i in range(16)]  # 16 payloads of 64 KiB fill the 1 MiB of staging
        assert all(tier.put([f"k{i}" for i in range(16)], blobs))
        assert tier.put(["late"], [blobs[0]]) == [False]
        t0 = time.monotonic()
        assert tier.wait_for_room([obj], timeout=0.1) is False and time.monotonic() - t0 >= 0.1
        threading.Timer(0.05, gate.set).start()
        t0 = time.monotonic()
        assert tier.wait_for_room([obj] * 4, timeout=20) is True
        assert time.monotonic() - t0 < 5  # woken as written records give staging back, not by the timeout
        assert tier.put(["late"], [blobs[0]]) == [True]
        assert (
            tier.wait_for_room([64 * MiB], timeout=10) is True
        )  # more than the buffer: waits for it to be empty
        assert tier.stats()["queued_bytes"] == 0
    finally:
        gate.set()
        tier.close()
    assert tier.wait_for_room([obj], timeout=1) is False  # closed: no room will come


def test_a_seal_runs_while_the_next_segment_is_written(tmp_path, monkeypatch):
    """A full segment's seal (summary write + fdatasync) runs on an I/O thread: while it runs, the writer
    goes on writing the next segment. Here the first seal waits until the writer has submitted two more
    writes since it queued the seal; a seal the writer waited for would never see them (10 s, then False).

    Counted from the seal's submission, on the writer thread, not from when the seal's sync starts: under
    CPU load the I/O thread could reach the sync after the writer had already issued every remaining write,
    and the test used to wait for writes that never came (about one run in four of `-k ssd` on a loaded
    2-core VM)."""
    cond, state = threading.Condition(), {"submitted": 0, "at_seal": None, "seen": None}
    real_submit, real_seal_later, real_seal_io = SsdTier._submit, SsdTier._seal_later, SsdTier._seal_io

    def submit(self, shard, w):
        with cond:
            state["submitted"] += 1
            cond.notify_all()
        return real_submit(self, shard, w)

    def seal_later(self, shard, seg):
        with cond:
            if state["at_seal"] is None:
                state["at_seal"] = state["submitted"]
        return real_seal_later(self, shard, seg)

    def seal_io(shard, seg, image, offset):
        with cond:
            if state["seen"] is None:  # the first seal
                at = state["at_seal"]
                state["seen"] = at is not None and cond.wait_for(lambda: state["submitted"] >= at + 2, 10)
        return real_seal_io(shard, seg, image, offset)

    monkeypatch.setattr(SsdTier, "_submit", submit)
    monkeypatch.setattr(SsdTier, "_seal_later", seal_later)
    monkeypatch.setattr(SsdTier, "_seal_io", staticmethod(seal_io))
    blobs = {f"k{i}": _blob(OBJ, i) for i in range(12)}
    with SsdTier(
        str(tmp_path),
        capacity_bytes=8 * MiB,
        queue_bytes=2 * MiB,
        max_io_bytes=64 * KiB,
        segment_bytes=256 * KiB,
    ) as tier:
        assert all(tier.put(list(blobs), list(blobs.values())))
        assert tier.flush(timeout=30)
        assert state["seen"] is True
        assert tier.stats()["seal_errors"] == 0
        assert [s.sealed for s in scan(str(tmp_path)).segments] == [True, True, False]
    with SsdTier(str(tmp_path), capacity_bytes=8 * MiB) as tier:
        assert sorted(_check(tier, blobs)) == sorted(blobs)


def test_a_failed_background_seal_is_counted_and_its_records_survive(tmp_path, monkeypatch):
    """A seal whose sync fails is counted (seal_errors); the segment takes no more records, and a restart
    walks it record by record instead of reading its summary: nothing is lost."""
    real_sync, calls = os.fdatasync, []

    def fdatasync(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        return real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    blobs = {f"k{i}": _blob(OBJ, i) for i in range(6)}
    with SsdTier(
        str(tmp_path),
        capacity_bytes=8 * MiB,
        queue_bytes=2 * MiB,
        max_io_bytes=64 * KiB,
        segment_bytes=256 * KiB,
        direct_io=False,
    ) as tier:
        assert all(tier.put(list(blobs), list(blobs.values())))
        assert tier.flush(timeout=30)
        assert tier.stats()["seal_errors"] == 1
        assert sorted(_check(tier, blobs)) == sorted(blobs)
    monkeypatch.setattr(os, "fdatasync", real_sync)
    with SsdTier(str(tmp_path), capacity_bytes=8 * MiB) as tier:
        assert sorted(_check(tier, blobs)) == sorted(blobs)
