"""SsdTier behaviour: round trips (staged, on disk, after restart), duplicates, remove/clear that survive
a restart, LRU reclamation within capacity, copy-forward, striping, the directory lock, input errors."""

import os
import threading

import numpy as np
import pytest

import umbp.pool.ssd.io_hooks as ssd_io
from umbp.pool import BufferSizeError, ObjectTooLargeError, OptionValueError, Pool, UmbpError
from umbp.pool.buffers import aligned_buffer
from umbp.pool.errors import InvalidKeyError
from umbp.pool.ssd.format import scan_directory
from umbp.pool.ssd.tier import SsdLockedError, SsdTier

KiB, MiB = 1024, 1 << 20


pytestmark = pytest.mark.usefixtures("impl")  # each test on the C extension's paths and on the Python ones


def _blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _tier(path, **kw) -> SsdTier:
    kw.setdefault("capacity_bytes", 16 * MiB)
    kw.setdefault("queue_bytes", 4 * MiB)
    return SsdTier(str(path), **kw)


def _read(tier: SsdTier, key: str, n: int) -> bytes | None:
    out = np.empty(n, np.uint8)
    return out.tobytes() if tier.get_into([key], [out])[0] else None


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct(request):
    return request.param


SIZES = [0, 1, 4095, 4096, 4097, 100_003, 3 * MiB + 5]


def test_round_trip_staged_on_disk_and_after_restart(tmp_path, direct):
    blobs = {f"k{n}": _blob(n, n) for n in SIZES}
    with _tier(tmp_path, direct_io=direct) as tier:
        assert isinstance(tier, Pool)
        assert tier.put(list(blobs), list(blobs.values())) == [True] * len(blobs)
        assert all(_read(tier, k, v.size) == v.tobytes() for k, v in blobs.items())  # staged or written
        assert tier.flush(timeout=30)
        assert all(_read(tier, k, v.size) == v.tobytes() for k, v in blobs.items())  # from disk
        stats = tier.stats()
        assert (
            stats["direct_io"] == [direct]
            and stats["objects"] == len(blobs)
            and stats["checksum_failures"] == 0
        )
    with _tier(tmp_path, direct_io=direct) as tier:
        assert all(_read(tier, k, v.size) == v.tobytes() for k, v in blobs.items())
        assert tier.stats()["hits_staged"] == 0


@pytest.mark.parametrize("max_io", [64 * KiB, 8 * MiB])
def test_read_paths_aligned_unaligned_large_and_batched(tmp_path, max_io):
    """Aligned destinations of records larger than a run are read straight into (zero copy); others through a bounce
    buffer; records larger than a run in chunks; many keys per call pipelined."""
    blobs = [_blob(n, i) for i, n in enumerate([2 * MiB + 3, 1 * MiB, 300 * KiB, 64 * KiB] * 3)]
    keys = [f"r{i}" for i in range(len(blobs))]
    with _tier(tmp_path, max_io_bytes=max_io, io_threads=2, queue_bytes=16 * MiB) as tier:
        assert tier.put(keys, blobs) == [True] * len(keys)
        tier.flush()
        aligned = [aligned_buffer(b.size) for b in blobs]
        unaligned = [np.empty(b.size + 1, np.uint8)[1:] for b in blobs]
        for outs in (aligned, unaligned):
            assert tier.get_into(keys, outs) == [True] * len(keys)
            assert all(np.array_equal(o, b) for o, b in zip(outs, blobs))


def test_a_key_named_twice_in_a_get_is_read_once_and_fills_both(tmp_path, monkeypatch):
    """A batch that names records more than once reads each once (a repeat used to break the run of
    adjacent records into single-record reads: twice the time) and fills every destination; a damaged
    record named twice is two misses, and a staged object named twice is served twice."""
    import umbp.pool.ssd.io_hooks as ssd_io

    blobs = [_blob(16 * KiB, i) for i in range(64)]
    keys = [f"d{i}" for i in range(64)]
    with _tier(tmp_path, io_threads=2) as tier:
        assert tier.put(keys, blobs) == [True] * 64
        tier.flush()
        reads = []
        real = ssd_io.preadv

        def counted(fd, bufs, offset):
            reads.append(sum(len(b) for b in bufs))
            return real(fd, bufs, offset)

        monkeypatch.setattr(ssd_io, "preadv", counted)
        order = keys + keys[::-1] + keys[5:9]
        outs = [np.zeros(16 * KiB, np.uint8) for _ in order]
        assert tier.get_into(order, outs) == [True] * len(order)
        assert all(np.array_equal(o, blobs[int(k[1:])]) for o, k in zip(outs, order))
        assert sum(reads) == 64 * 16 * KiB  # each payload read once (group heads are not read)
        path = tier._route("d3").index["d3"].seg.path
        at = tier._route("d3").index["d3"].offset + 7
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(bytes([blobs[3][7] ^ 1]))
        outs = [np.zeros(16 * KiB, np.uint8) for _ in range(3)]
        assert tier.get_into(["d3", "d4", "d3"], outs) == [False, True, False]
        assert tier.stats()["checksum_failures"] >= 1
        assert tier.put(["late"], [blobs[0]]) == [True]  # still queued or just written: served either way
        outs = [np.zeros(16 * KiB, np.uint8) for _ in range(2)]
        assert tier.get_into(["late", "late"], outs) == [True, True]
        assert all(np.array_equal(o, blobs[0]) for o in outs)


@pytest.mark.parametrize("size", [64 * KiB, 10_000])
def test_batched_puts_of_one_size(tmp_path, size):
    """A put of many objects of one size stages them side by side and sums them together (_copy_in): the
    digests equal psum64 of each object (a wrong expected one is refused), a key given twice in one call
    is stored once, every byte reads back from staging, from disk and after a restart."""
    from umbp.pool.checksum import checksum

    blobs = [_blob(size, 100 + i) for i in range(40)]
    keys = [f"b{i}" for i in range(40)]
    sums = [checksum(b) for b in blobs]
    sums[7] ^= 1  # this object's bytes do not match what the caller expects
    keys[30], blobs[30], sums[30] = keys[3], blobs[3], sums[3]  # the same key twice in one call
    with _tier(tmp_path) as tier:
        assert tier.put(["old"], [blobs[0]]) == [True]
        ok = tier.put(keys + ["old"], blobs + [blobs[0]], checksums=sums + [sums[0]])
        assert ok == [i != 7 for i in range(40)] + [True]
        assert tier.stats()["put_checksum_mismatch"] == 1 and tier.stats()["put_duplicates"] == 2
        assert _read(tier, "b7", size) is None
        live = {k: b for i, (k, b) in enumerate(zip(keys, blobs)) if i != 7}
        assert all(_read(tier, k, size) == b.tobytes() for k, b in live.items())  # staged
        assert tier.flush(timeout=30)
        assert all(_read(tier, k, size) == b.tobytes() for k, b in live.items())  # on disk
    with _tier(tmp_path) as tier:  # the headers carry the digests the batch took
        assert all(_read(tier, k, size) == b.tobytes() for k, b in live.items())
        assert tier.stats()["checksum_failures"] == 0


def test_buffer_kinds_and_torch(tmp_path):
    data = np.arange(3000, dtype=np.float32)
    with _tier(tmp_path) as tier:
        assert tier.put(["np", "ba"], [data, bytearray(data.tobytes())]) == [True, True]
        tier.flush()
        out_np, out_mv = np.empty(3000, np.float32), memoryview(bytearray(12000))
        assert tier.get_into(["np", "ba"], [out_np, out_mv]) == [True, True]
        assert np.array_equal(out_np, data) and bytes(out_mv) == data.tobytes()
        torch = pytest.importorskip("torch")
        src = torch.arange(2048, dtype=torch.bfloat16)
        assert tier.put(["t"], [src]) == [True]
        dst = torch.empty_like(src)
        assert tier.get_into(["t"], [dst]) == [True] and torch.equal(src, dst)


def test_duplicate_put_exists_remove_clear(tmp_path):
    with _tier(tmp_path) as tier:
        assert tier.put(["k"], [b"first"]) == [True]
        assert tier.put(["k", "k"], [b"other", b"again"]) == [True, True]
        assert _read(tier, "k", 5) == b"first"
        tier.put(["a", "b"], [b"1", b"22"])
        assert tier.exists(["a", "x", "k"]) == [True, False, True]
        assert tier.remove(["a", "x", "a"]) == 1
        assert tier.exists(["a"]) == [False] and _read(tier, "a", 1) is None
        s = tier.stats()
        assert s["puts"] == 3 and s["put_duplicates"] == 2
        tier.clear()
        assert tier.exists(["k", "b"]) == [False, False] and tier.stats()["segments"] == 0
        assert tier.put(["k"], [b"again"]) == [True] and _read(tier, "k", 5) == b"again"


def test_remove_and_clear_survive_a_restart(tmp_path):
    with _tier(tmp_path) as tier:
        tier.put(["gone", "kept", "reput"], [b"g", b"k", b"old"])
        tier.flush()
        tier.remove(["gone", "reput"])
        tier.put(["reput"], [b"new"])
    with _tier(tmp_path) as tier:
        assert tier.exists(["gone", "kept", "reput"]) == [False, True, True]
        assert _read(tier, "reput", 3) == b"new"
        tier.clear()
    with _tier(tmp_path) as tier:
        assert tier.exists(["kept", "reput"]) == [False, False]
    assert scan_directory(str(tmp_path)) == {}


def test_visible_while_queued_and_flush(tmp_path, monkeypatch):
    gate = threading.Event()
    real = ssd_io.pwritev
    monkeypatch.setattr(ssd_io, "pwritev", lambda *a: (gate.wait(), real(*a))[1])
    with _tier(tmp_path) as tier:
        tier.put(["q"], [b"queued bytes"])
        assert tier.exists(["q"]) == [True] and _read(tier, "q", 12) == b"queued bytes"
        assert tier.stats()["hits_staged"] == 1 and tier.flush(timeout=0.2) is False
        gate.set()
        assert tier.flush(timeout=30) and tier.stats()["queued_bytes"] == 0
        assert _read(tier, "q", 12) == b"queued bytes" and tier.stats()["hits_staged"] == 1


def _disk_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith("seg-"))


def test_capacity_is_respected_with_lru_reclamation(tmp_path):
    cap = 1 * MiB
    with _tier(tmp_path, capacity_bytes=cap, segment_bytes=128 * KiB, track_evicted=True) as tier:
        hot = _blob(20 * KiB, 999)
        tier.put(["hot"], [hot])
        for i in range(120):  # ~2.4 MiB through a 1 MiB tier
            tier.put([f"k{i}"], [_blob(20 * KiB, i)])
            assert _read(tier, "hot", hot.size) == hot.tobytes()  # keep it recently used
            if i % 10 == 9:
                tier.flush()
                s = tier.stats()
                assert s["used_bytes"] <= cap and _disk_bytes(tmp_path) <= cap
        tier.flush()
        s = tier.stats()
        assert s["evictions"] > 0 and s["segments_reclaimed"] > 0 and s["copied_forward"] > 0
        evicted = tier.drain_evicted()
        assert "hot" not in evicted and len(evicted) == s["evictions"]
        present = [i for i in range(120) if tier.exists([f"k{i}"])[0]]
        assert present and present[-1] == 119 and present == list(range(present[0], 120))  # LRU: oldest left
        assert all(_read(tier, f"k{i}", 20 * KiB) == _blob(20 * KiB, i).tobytes() for i in present)
    with _tier(tmp_path, capacity_bytes=cap, segment_bytes=128 * KiB) as tier:
        assert _read(tier, "hot", hot.size) == hot.tobytes()
        assert all(tier.exists([f"k{i}"])[0] for i in present)


def test_scan_directory_sees_what_the_tier_serves(tmp_path):
    with _tier(tmp_path) as tier:
        blobs = [_blob(5000 + i, i) for i in range(10)]
        tier.put([f"s{i}" for i in range(10)], blobs)
        tier.remove(["s3"])
        tier.flush()
        seen = scan_directory(str(tmp_path))  # another process's read-only view, tier still open
        assert set(seen) == {f"s{i}" for i in range(10)} - {"s3"}
        assert all(seen[f"s{i}"].length == 5000 + i for i in range(10) if i != 3)


def test_striping_over_two_directories(tmp_path):
    dirs = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    keys = [f"obj/{i}" for i in range(40)]
    with SsdTier(dirs, capacity_bytes=8 * MiB, queue_bytes=2 * MiB) as tier:
        tier.put(keys, [_blob(3000, i) for i in range(40)])
        tier.flush()
        assert tier.stats()["dirs"] == dirs
    per_dir = [set(scan_directory(d)) for d in dirs]
    assert per_dir[0] and per_dir[1] and not per_dir[0] & per_dir[1] and per_dir[0] | per_dir[1] == set(keys)
    with SsdTier(dirs, capacity_bytes=8 * MiB, queue_bytes=2 * MiB) as tier:
        assert all(_read(tier, k, 3000) == _blob(3000, i).tobytes() for i, k in enumerate(keys))


def test_a_second_owner_gets_a_clear_error(tmp_path):
    with _tier(tmp_path):
        with pytest.raises(
            SsdLockedError, match=rf"in use by another SsdTier \(pid {os.getpid()}\).*own subdirectory"
        ):
            _tier(tmp_path)
    with _tier(tmp_path):  # released at close
        pass


def test_input_errors(tmp_path):
    with _tier(tmp_path, capacity_bytes=1 * MiB, queue_bytes=256 * KiB) as tier:
        tier.put(["k"], [b"12345"])
        with pytest.raises(InvalidKeyError, match="1024 bytes"):
            tier.put(["x" * 1025], [b"1"])
        with pytest.raises(ObjectTooLargeError, match="staging queue holds 256 KiB; raise queue_bytes"):
            tier.put(["big"], [bytes(300 * KiB)])
        with pytest.raises(BufferSizeError, match="is 4 bytes but the stored object is 5 bytes"):
            tier.get_into(["k"], [bytearray(4)])
        with pytest.raises(BufferSizeError, match="2 keys but 1 buffers"):
            tier.put(["a", "b"], [b"1"])
        assert tier.max_object_bytes <= 256 * KiB and _read(tier, "k", 5) == b"12345"
    with pytest.raises(UmbpError, match="closed"):
        tier.put(["k2"], [b"1"])
    with pytest.raises(OptionValueError, match="segment_bytes"):
        _tier(tmp_path / "x", capacity_bytes=1 * MiB, segment_bytes=512 * KiB)
    with pytest.raises(OptionValueError, match="direct_io"):
        _tier(tmp_path / "y", direct_io="sometimes")
