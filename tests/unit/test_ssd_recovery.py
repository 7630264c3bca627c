"""Restart after kill -9 and damage: every get is the last flushed version, a newer one, or a miss, never
an older one, and records after a damaged one are still served.

Each round runs a real writer process (puts, removes, re-puts, flushes) and kills it with SIGKILL, damages
its directory (a flipped byte, a zeroed 4 KiB block, a truncation; anywhere, or aimed at one payload),
then reopens it twice (the first restart seals what it walked: its decisions must survive the second)."""

import errno
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib

import numpy as np
import pytest

from umbp.pool.checksum import checksum, finish
from umbp.pool.errors import BufferSizeError
from umbp.pool.ssd import recovery, scanio
from umbp.pool.ssd.format import (
    BLOCK,
    DATA,
    MAX_GROUP_ENTRIES,
    MAX_KEY_BYTES,
    TOMBSTONE,
    VERSION,
    entry_span,
    pack_group,
    pack_trailer,
    parse_group_head,
    psum_piece,
    segment_name,
    segment_number,
)
from umbp.pool.ssd.recovery import (
    FLUSH_MARK_NAME,
    DirectoryScan,
    read_flush_mark,
    scan,
    scan_directory,
    write_flush_mark,
)
from umbp.pool.ssd.shard import _MAX_BATCH_ITEMS
from umbp.pool.ssd.tier import SsdTier

KiB, MiB = 1 << 10, 1 << 20

pytestmark = pytest.mark.usefixtures("impl")  # each test on the C extension's paths and on the Python ones

# The writer's ops, from a seed, so the test knows every version without being told: (op, key, version).
# Small segments, so versions of a key spread over sealed and unsealed segments.
OPS_SETUP = """
import random
import numpy as np
def ops(seed, n=48, keys=6):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        out.append(("flush", "", i) if r < 0.2 else ("remove", f"k{rng.randrange(keys)}", i) if r < 0.45
                   else ("put", f"k{rng.randrange(keys)}", i))
    return out
def value(version):
    size = (version * 7919) % (40 << 10) + 1 + (64 << 10 if version % 5 == 0 else 0)
    return np.random.default_rng(version).integers(0, 256, size, dtype=np.uint8)
"""
_ns: dict = {}
exec(OPS_SETUP, _ns)
ops, value = _ns["ops"], _ns["value"]


def stored(seed: int) -> list[tuple[str, str, int]]:
    """The writer's ops that change what is stored: a put of a key already present is a no-op (True,
    nothing written), so a new version of a key needs a remove first, as a cache's callers do."""
    present: set[str] = set()
    out = []
    for op, key, version in ops(seed):
        if op == "put" and key in present:
            continue
        if op == "put":
            present.add(key)
        elif op == "remove":
            present.discard(key)
        out.append((op, key, version))
    return out


TIER_OPTS = dict(
    capacity_bytes=64 * MiB, queue_bytes=4 * MiB, segment_bytes=256 * KiB, health_interval_s=0.05
)

WRITER = (
    OPS_SETUP
    + f"""
import sys, time
from umbp.pool.ssd.tier import SsdTier
directory, seed = sys.argv[1], int(sys.argv[2])
tier = SsdTier(directory, **{TIER_OPTS!r})
for op, key, version in ops(seed):
    if op == "put":
        while not tier.put([key], [value(version)])[0]:
            time.sleep(0.001)
    elif op == "remove":
        tier.remove([key])
    elif tier.flush():
        print(f"flushed {{version}}", flush=True)
print("end", flush=True)
time.sleep(600)  # the kill lands here or mid-stream
"""
)


def _env(impl: str) -> dict:
    env = dict(os.environ)
    if impl == "python":
        env["UMBP_NATIVE"] = "0"
    return env


def _run_and_kill(directory: str, seed: int, impl: str, rng: random.Random) -> int:
    """Run the writer for `seed`, SIGKILL it after a random number of its flushes (0-5 ms later, so the
    kill often lands mid-write); returns the last op index whose flush returned True (-1 if none)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, directory, str(seed)],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(impl),
    )
    flushed, lines = -1, 0
    goal = rng.randint(1, 8)
    try:
        deadline = time.monotonic() + 30
        while lines < goal and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or line.startswith("end"):
                break
            flushed, lines = int(line.split()[1]), lines + 1
        time.sleep(rng.uniform(0, 0.005))
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    for line in proc.stdout:  # flushed before the kill, read after it: durable too
        if line.startswith("flushed"):
            flushed = max(flushed, int(line.split()[1]))
    proc.stdout.close()
    return flushed


def _allowed(seed: int, flushed: int) -> tuple[dict[str, set[int | None]], dict[str, int | None]]:
    """Per key: the versions a get may return (None: a miss) and the key's state at the last flush."""
    at_flush: dict[str, int | None] = {}
    later: dict[str, set[int | None]] = {}
    for op, key, version in stored(seed):
        if op == "flush":
            continue
        if version <= flushed:
            at_flush[key] = version if op == "put" else None
        elif op == "put":
            later.setdefault(key, set()).add(version)
    keys = {key for op, key, _ in ops(seed) if key}
    return {k: {None, at_flush.get(k)} | later.get(k, set()) for k in keys}, at_flush


def _segments(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.startswith("seg-"))


def _damage(directory: str, kind: str, rng: random.Random) -> str:
    """Damage one segment file; returns what was done. 'payload' aims at one data record's payload (a
    superseded version or the newest one); the others land anywhere in a file, heads and seals included."""
    if kind == "payload":
        recs = [(s.path, k, r) for s in scan(directory).segments for k, r in s.records if r.flags == DATA]
        if not recs:
            return "nothing to damage"
        path, key, r = rng.choice(recs)
        at = r.offset + rng.randrange(r.length)
        _flip(path, at)
        return f"flip payload of {key} (seq {r.seq}) in {os.path.basename(path)} at {at}"
    segs = [p for p in _segments(directory) if os.path.getsize(p) > 0]
    if not segs:
        return "nothing to damage"
    if kind == "head":  # a group head: its entries' keys are lost with it
        heads = [(p, at) for p in segs for at in _group_heads(p)]
        path, at = rng.choice(heads)
        at += rng.randrange(24, 200)
        _flip(path, at)
        return f"head: flip {os.path.basename(path)} at {at}"
    path = segs[-1] if rng.random() < 0.5 else rng.choice(segs)  # the unsealed one often
    size = os.path.getsize(path)
    if kind == "flip":
        at = rng.randrange(size)
        _flip(path, at)
    elif kind == "zero":
        at = rng.randrange(max(size // BLOCK, 1)) * BLOCK
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(bytes(min(BLOCK, size - at)))
    else:
        at = rng.choice([rng.randrange(size), rng.randrange(size // BLOCK + 1) * BLOCK])
        os.truncate(path, at)
    return f"{kind} {os.path.basename(path)} at {at} of {size}"


def _group_heads(path: str) -> list[int]:
    """Offsets of the blocks of `path` that start with a group head's magic."""
    with open(path, "rb") as f:
        raw = f.read()
    return [at for at in range(0, len(raw) - BLOCK + 1, BLOCK) if raw[at : at + 8] == b"UMBP-GRP"]


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ (1 << random.Random(at).randrange(8))]))


def _served(tier: SsdTier, seed: int, keys) -> dict[str, int | None]:
    """key -> the version served (None: a miss); asserts the bytes served are exactly one of its versions.
    The destination must have the stored size (else BufferSizeError), so each version's size is tried."""
    out = {}
    for key in sorted(keys):
        versions = [v for op, k, v in stored(seed) if k == key and op == "put"]
        got = None
        for size in sorted({value(v).size for v in versions}):
            dst = np.empty(size, np.uint8)
            try:
                ok = tier.get_into([key], [dst])[0]
            except BufferSizeError:
                continue
            if ok:
                match = [v for v in versions if value(v).size == size and np.array_equal(dst, value(v))]
                assert match, f"seed {seed}: {key} served bytes that are none of its versions"
                got = match[-1]
            break
        out[key] = got
    return out


def _check_round(directory: str, seed: int, flushed: int, what: str) -> dict[str, int | None]:
    allowed, _ = _allowed(seed, flushed)
    served = []
    for attempt in range(2):  # the first restart seals what it walked; the second must agree it is safe
        with SsdTier(directory, **TIER_OPTS) as tier:
            got = _served(tier, seed, allowed)
        for key, v in got.items():
            assert v in allowed[key], (
                f"seed {seed}, restart {attempt + 1}: {key} served version {v}, allowed "
                f"{sorted(allowed[key], key=str)} (flushed through op {flushed}; {what})"
            )
        served.append(got)
    return served[0]


def _durable_untouched(seed: int, flushed: int) -> dict[str, int]:
    """Keys whose last op of the whole run is a put at or before the last flush: nothing later can hide them."""
    last: dict[str, tuple[str, int]] = {}
    for op, key, version in stored(seed):
        if key:
            last[key] = (op, version)
    return {k: v for k, (op, v) in last.items() if op == "put" and v <= flushed}


def test_randomized_kill_9_and_damage_never_serve_an_older_version(tmp_path, impl):
    """10 rounds a path, ~15 s on the loaded 2-core dev VM: each one a fresh writer, a kill, one damage,
    two restarts. For damage aimed at one payload, every other durable key is still served."""
    rng = random.Random(27)
    tally: dict[str, int] = {}
    for r in range(10):
        seed = rng.randrange(1 << 30)
        directory = str(tmp_path / f"round{r}")
        flushed = _run_and_kill(directory, seed, impl, rng)
        kind = ["payload", "flip", "zero", "truncate", "head"][r % 5]
        what = _damage(directory, kind, rng)
        got = _check_round(directory, seed, flushed, what)
        if kind == "payload" and "nothing" not in what:
            damaged_key = what.split()[3]
            for key, v in _durable_untouched(seed, flushed).items():
                if key != damaged_key:
                    assert got[key] == v, f"seed {seed}: {key} (durable, undamaged) not served after: {what}"
        tally[kind] = tally.get(kind, 0) + 1
    print(f"rounds by damage: {tally}")


CHILD_REPRO = """
import sys, time
import numpy as np
from umbp.pool.ssd.tier import SsdTier
directory = sys.argv[1]
opts = dict(capacity_bytes=64 << 20, queue_bytes=4 << 20)
v1, x, v2 = (np.full(n, c, np.uint8) for n, c in ((48 << 10, 1), (200 << 10, 2), (48 << 10, 3)))
with SsdTier(directory, **opts) as tier:  # K=v1, its segment sealed at close
    assert tier.put(["K"], [v1]) == [True] and tier.flush()
tier = SsdTier(directory, **opts)
assert tier.put(["X"], [x]) == [True] and tier.flush()
assert tier.remove(["K"]) == 1 and tier.flush()
assert tier.put(["K"], [v2]) == [True] and tier.flush()
print("flushed", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("damage", ["flip", "zero"])
def test_damage_before_a_flushed_tombstone_and_reput_never_brings_back_the_old_version(
    tmp_path, impl, damage
):
    """The reported case: K=v1 sealed; X; remove(K); K=v2, each flushed; kill -9; one byte of X's payload
    flipped (or one 4 KiB block of it zeroed) in the unsealed segment. The restart used to stop at X and
    serve v1. Now X is a miss and K is v2."""
    directory = str(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD_REPRO, directory], stdout=subprocess.PIPE, text=True, env=_env(impl)
    )
    try:
        assert proc.stdout.readline().strip() == "flushed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    x = scan_directory(directory)["X"]
    path = os.path.join(directory, segment_name(x.segment))
    if damage == "flip":
        _flip(path, x.offset + 12345)
    else:
        with open(path, "r+b") as f:
            f.seek(x.offset + BLOCK)
            f.write(bytes(BLOCK))
    for restart in range(2):
        with SsdTier(directory, capacity_bytes=64 * MiB) as tier:
            assert tier.stats()["restart_damaged_records"] == (1 if restart == 0 else 0)  # then a tombstone
            out = np.empty(48 * KiB, np.uint8)
            assert tier.get_into(["K"], [out]) == [True]
            assert (out == 3).all(), f"K served {out[0]}: the removed, replaced v1 came back"
            assert tier.get_into(["X"], [np.empty(200 * KiB, np.uint8)]) == [False]


def _tier(path, **kw) -> SsdTier:
    return SsdTier(str(path), **{**TIER_OPTS, **kw})


def _fill(tier: SsdTier, keys: list[str], version: int) -> None:
    for k in keys:
        assert tier.put([k], [value(version)]) == [True]
        assert tier.flush()


def _unseal_last(directory: str) -> str:
    """Strip the last segment's summary and trailer, as if the process had died (kill -9) before sealing
    it: its records stay, flushed, and a restart walks it."""
    last = scan(directory).segments[-1]
    os.truncate(last.path, max(r.offset + r.nbytes for _, r in last.records))
    return last.path


def _hits(tier: SsdTier, versions: dict[str, int]) -> dict[str, bool]:
    out = {}
    for k, v in versions.items():
        dst = np.empty(value(v).size, np.uint8)
        out[k] = tier.get_into([k], [dst])[0]
        assert not out[k] or np.array_equal(dst, value(v)), k
    return out


def test_a_corrupt_group_head_withholds_what_is_older_and_serves_what_is_newer(tmp_path):
    """A group head whose entries cannot be read loses keys nobody can name. If it held flushed records,
    every older record may have been replaced or removed by a lost one: those are withheld (misses); the
    records after it are served. The decision survives the restart that seals the walked segment."""
    with _tier(tmp_path) as tier:
        _fill(tier, ["a", "b"], 1)  # seqs 1, 2 in a segment sealed at close
    with _tier(tmp_path) as tier:
        _fill(tier, ["c"], 2)  # seq 3
        assert tier.remove(["a"]) == 1 and tier.flush()  # seq 4 (a put of a present key is a no-op)
        _fill(tier, ["a", "d"], 3)  # seqs 5, 6: the group of "a" is damaged below, its key lost
        _fill(tier, ["e"], 4)  # seq 7
    seg = _unseal_last(str(tmp_path))
    a = scan_directory(str(tmp_path))["a"]
    with open(seg, "r+b") as f:
        f.seek(a.offset - BLOCK)  # the one head block of a's group
        f.write(bytes(BLOCK))
    result = scan(str(tmp_path))
    assert (
        result.flushed_seq == 7 and result.horizon == 4
    )  # 4: a's tombstone, the last record before the loss
    assert sorted(result.records) == ["d", "e"]
    for restart in range(2):
        with _tier(tmp_path) as tier:
            got = _hits(tier, {"a": 3, "b": 1, "c": 2, "d": 3, "e": 4})
            counted = tier.stats()["restart_withheld_records"]
        assert got == {"a": False, "b": False, "c": False, "d": True, "e": True}
        assert counted == (4 if restart == 0 else 0)  # a, b, c and a's tombstone; gone from the disk after


def test_an_unflushed_torn_group_withholds_nothing(tmp_path):
    """Bytes lost past the flush mark are writes a crash cut short, never acknowledged: the older, flushed
    records stay served (such a loss, after every crash with writes in flight, must not empty the cache)."""
    with _tier(tmp_path) as tier:
        _fill(tier, ["a", "b"], 1)
        assert tier.put(["c"], [value(2)]) == [True]  # written at close, never flushed
    assert read_flush_mark(str(tmp_path)) == 2
    seg = _unseal_last(str(tmp_path))
    c = scan_directory(str(tmp_path))["c"]
    with open(seg, "r+b") as f:
        f.seek(c.offset - BLOCK)
        f.write(bytes(BLOCK))
    result = scan(str(tmp_path))
    assert result.horizon == 0 and sorted(result.records) == ["a", "b"]


def test_a_flushed_tail_truncated_away_withholds_everything_older(tmp_path):
    """A truncation that removes flushed records (here a tombstone) leaves no trace but the flush mark: the
    newest record left is below it, so everything is withheld rather than risk serving a removed or
    replaced version."""
    with _tier(tmp_path) as tier:
        _fill(tier, ["a"], 1)
        tier.remove(["a"])
        assert tier.flush()
    seg = _unseal_last(str(tmp_path))
    tomb = next(r for s in scan(str(tmp_path)).segments for _, r in s.records if r.flags == TOMBSTONE)
    os.truncate(seg, tomb.offset - BLOCK)  # the tombstone's group is gone
    result = scan(str(tmp_path))
    assert result.flushed_seq == 2 and result.horizon == 1 and result.records == {}
    assert result.next_seq == 3  # no seq at or below the mark is handed out again
    with _tier(tmp_path) as tier:
        assert _hits(tier, {"a": 1}) == {"a": False}


def test_the_flush_mark_is_never_lowered_and_survives_a_torn_slot(tmp_path):
    d = str(tmp_path)
    assert read_flush_mark(d) == 0
    assert write_flush_mark(d, 5) and write_flush_mark(d, 9)
    assert write_flush_mark(d, 7)  # lower: nothing written
    assert read_flush_mark(d) == 9
    with open(tmp_path / FLUSH_MARK_NAME, "r+b") as f:  # the slot holding 9 torn: the other still holds 5
        raw = f.read()
        f.seek(0 if raw.find(struct.pack("<Q", 9), 0, 512) > 0 else 512)
        f.write(bytes(64))
    assert read_flush_mark(d) == 5


def test_a_stray_last_segment_number_never_makes_names_the_scanner_skips(tmp_path):
    """A stray seg-999999999999.umbp used to make the next name 13 digits long, which the scanner ignored:
    objects flushed there were lost at restart. Now such names are read back."""
    with _tier(tmp_path) as tier:
        _fill(tier, ["old"], 1)
    os.rename(tmp_path / "seg-000000000001.umbp", tmp_path / "seg-999999999999.umbp")  # the stray: a real one
    with _tier(tmp_path) as tier:
        assert tier.put(["k"], [value(2)]) == [True]
        assert tier.flush()
    assert "seg-1000000000000.umbp" in os.listdir(tmp_path)
    with _tier(tmp_path) as tier:
        assert _hits(tier, {"k": 2, "old": 1}) == {"k": True, "old": True}
    assert segment_number("seg-0000000000001.umbp") is None  # one name per number: no leading zero past 12
    with pytest.raises(ValueError, match="out of range"):
        segment_name(10**19)


def test_a_flushed_remove_of_an_evicted_object_is_not_undone_by_a_restart(tmp_path):
    """An object the LRU evicted stays on disk until its segment is reclaimed (evictions are not
    persisted). A remove() of it used to write no tombstone (the key was not indexed), so a restart served
    it again: a flushed remove undone. The eviction is driven directly, as the LRU would, for a
    deterministic test."""
    with _tier(tmp_path) as tier:
        _fill(tier, ["k", "other"], 1)
        with tier._lock:
            tier._evict(tier._shards[0], "k")
        assert tier.exists(["k"]) == [False]
        assert tier.remove(["k"]) == 0  # absent already: nothing counted as removed, but a tombstone written
        assert tier.flush()
    with _tier(tmp_path) as tier:
        assert _hits(tier, {"k": 1, "other": 1}) == {"k": False, "other": True}


def test_a_sealed_segment_cut_at_a_group_boundary_is_caught_by_the_seq_gap(tmp_path):
    """A cut that removes whole groups (and the seal) leaves a walk that ends cleanly; only the seqs tell:
    the next segment starts past the next seq, below the flush mark, so records were lost there (here the
    tombstone of "a") and every older record is withheld."""
    with _tier(tmp_path) as tier:
        _fill(tier, ["a", "b"], 1)  # seqs 1, 2
        assert tier.remove(["a"]) == 1 and tier.flush()  # seq 3, cut away below
    with _tier(tmp_path) as tier:
        _fill(tier, ["d"], 2)  # seq 4, in the next segment
    first = _segments(str(tmp_path))[0]
    tomb = next(r for s in scan(str(tmp_path)).segments for _, r in s.records if r.flags == TOMBSTONE)
    os.truncate(first, tomb.offset - BLOCK)
    result = scan(str(tmp_path))
    assert result.horizon == 2 and sorted(result.records) == ["d"]
    with _tier(tmp_path) as tier:
        assert _hits(tier, {"a": 1, "b": 1, "d": 2}) == {"a": False, "b": False, "d": True}


def test_segment_numbers_at_the_end_of_their_range_fail_the_directory_clearly(tmp_path):
    """A stray garbage file with the largest number is deleted at start-up and takes no number with it; a
    real segment there leaves no number for the next one: the directory is failed with a message that
    says so, and what it holds is still served."""
    (tmp_path / "seg-9999999999999999999.umbp").write_bytes(os.urandom(BLOCK))
    with _tier(tmp_path) as tier:
        _fill(tier, ["k"], 1)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("seg-")) == ["seg-000000000001.umbp"]
    os.rename(tmp_path / "seg-000000000001.umbp", tmp_path / "seg-9999999999999999999.umbp")
    with _tier(tmp_path) as tier:
        assert _hits(tier, {"k": 1}) == {"k": True}
        assert tier.put(["new"], [value(2)]) == [True]
        tier.flush()
        assert "segment numbers are exhausted" in tier.stats()["failed_dirs"][str(tmp_path)]
        assert _hits(tier, {"k": 1}) == {"k": True}


# ---- hostile, unreadable or odd files at start-up: never a crash, a hang, or a cost set by a claimed size


def _two_segments(path) -> tuple[str, str]:
    """'a' (v1) in a sealed segment 1; 'b' (v2) and 'c' (v3) in segment 2, each put flushed (mark 3)."""
    with _tier(path) as tier:
        _fill(tier, ["a"], 1)
    with _tier(path) as tier:
        _fill(tier, ["b", "c"], 2)
        assert tier.remove(["c"]) == 1 and tier.put(["c"], [value(3)]) == [True] and tier.flush()
    first, second = _segments(str(path))
    return first, second


def _fail_reads(monkeypatch, path: str, at: int) -> None:
    """os.pread of `path` fails with EIO for any read that covers byte `at`: a bad sector."""
    real, target = os.pread, os.path.realpath(path)

    def pread(fd, n, off):
        if off <= at < off + n:
            try:
                hit = os.readlink(f"/proc/self/fd/{fd}") == target
            except OSError:
                hit = False
            if hit:
                raise OSError(errno.EIO, "Input/output error (injected)")
        return real(fd, n, off)

    monkeypatch.setattr(os, "pread", pread)


@pytest.mark.parametrize("where", ["payload", "head", "resync", "trailer", "open"])
def test_an_io_error_at_startup_costs_only_what_it_hides(tmp_path, monkeypatch, where):
    """EIO under one payload of a walked segment, its group head, a block a resync reads, a sealed
    segment's trailer, or opening a segment: start-up used to raise out of SsdTier() and scan_directory.
    Now an unreadable payload is a shadow (a miss), an unreadable head a loss stepped over (flushed, so
    what is older is withheld), a trailer the reason to walk the segment, a segment that cannot be
    opened a loss; the decision holds at the next restart, without the error."""
    first, second = _two_segments(tmp_path)
    found = scan_directory(str(tmp_path))
    b = found["b"]
    if where in ("payload", "head", "resync"):
        _unseal_last(str(tmp_path))
    if where == "payload":
        _fail_reads(monkeypatch, second, b.offset + 100)
    elif where == "head":
        _fail_reads(monkeypatch, second, b.offset - BLOCK)  # b's group has one entry: one head block
    elif where == "resync":  # b's head zeroed: the walk resyncs, and its first read covers a bad block
        with open(second, "r+b") as f:
            f.seek(b.offset - BLOCK)
            f.write(bytes(BLOCK))
        _fail_reads(monkeypatch, second, b.offset + BLOCK)
    elif where == "trailer":
        _fail_reads(monkeypatch, second, os.path.getsize(second) - 1)
    else:
        real_open, target = os.open, first

        def failing_open(path, flags, *args, **kwargs):
            if path == target:
                raise OSError(errno.EIO, "Input/output error (injected)")
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", failing_open)
    expect = {
        "payload": {"a": True, "b": False, "c": True},
        "head": {"a": False, "b": False, "c": True},  # a flushed loss: 'a' (older) withheld
        "resync": {"a": False, "b": False, "c": True},
        "trailer": {"a": True, "b": True, "c": True},
        "open": {"a": False, "b": True, "c": True},  # segment 1 lost, nothing older than it
    }[where]
    assert sorted(scan_directory(str(tmp_path))) == sorted(k for k, hit in expect.items() if hit)
    with _tier(tmp_path) as tier:
        assert _hits(tier, {"a": 1, "b": 2, "c": 3}) == expect
        assert tier.stats()["restart_damaged_records"] == (1 if where == "payload" else 0)
    monkeypatch.undo()
    with _tier(tmp_path) as tier:
        assert _hits(tier, {"a": 1, "b": 2, "c": 3}) == expect


def _unblock_fifo(path: str) -> None:
    """Wake a reader stuck opening the FIFO at `path` (a test that failed must still end)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _returns(fn, fifo: str | None = None, timeout: float = 10.0):
    """fn()'s result, asserting it returns within `timeout` (a blocked open of `fifo` is woken first)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    blocked = thread.is_alive()
    if blocked and fifo:
        _unblock_fifo(fifo)
        thread.join(timeout)
    assert not blocked, f"blocked for {timeout} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize(
    "kind", ["directory", "symlink loop", "symlink to a directory", "symlink to a segment", "fifo"]
)
def test_entries_named_like_segments_that_are_not_regular_files_are_skipped(tmp_path, kind):
    """A directory, a symlink or a FIFO named like a segment used to raise out of SsdTier() and
    scan_directory (IsADirectoryError, ELOOP) or block them for ever (opening a FIFO). Now it is skipped
    (listed in `skipped`, logged), left where it is, and never opened: the owner would write through a
    symlink, so even one to a real segment elsewhere is not read."""
    d = tmp_path / "d"
    with _tier(d) as tier:
        _fill(tier, ["a"], 1)
    odd = str(d / segment_name(7))
    if kind == "directory":
        os.mkdir(odd)
    elif kind == "symlink loop":
        os.symlink(odd, odd)
    elif kind == "symlink to a directory":
        os.symlink(str(tmp_path), odd)
    elif kind == "symlink to a segment":
        with _tier(tmp_path / "other") as tier:
            _fill(tier, ["x"], 2)
        target = _segments(str(tmp_path / "other"))[0]
        before = open(target, "rb").read()
        os.symlink(target, odd)
    else:
        os.mkfifo(odd)
    fifo = odd if kind == "fifo" else None
    result = _returns(lambda: scan(str(d)), fifo)
    assert sorted(result.records) == ["a"] and result.skipped == [segment_name(7)]
    assert result.next_segment == 8
    with _returns(lambda: _tier(d), fifo) as tier:
        assert _hits(tier, {"a": 1}) == {"a": True}
        assert tier.put(["n"], [value(3)]) == [True] and tier.flush()
    assert os.path.lexists(odd)
    if kind == "symlink to a segment":
        assert open(target, "rb").read() == before  # not cut, not sealed, not deleted through the link


def test_a_flush_mark_that_is_not_a_regular_file_never_blocks(tmp_path):
    """FLUSHED replaced by a FIFO used to block read_flush_mark's open(), so every SsdTier() and
    scan_directory() of the directory hung. Now it reads as no mark (0), and writing the mark fails,
    logged, without blocking either."""
    with _tier(tmp_path) as tier:
        _fill(tier, ["a"], 1)
    mark = str(tmp_path / FLUSH_MARK_NAME)
    os.unlink(mark)
    os.mkfifo(mark)
    assert _returns(lambda: read_flush_mark(str(tmp_path)), mark) == 0
    assert sorted(_returns(lambda: scan_directory(str(tmp_path)), mark)) == ["a"]
    with _returns(lambda: _tier(tmp_path), mark) as tier:
        assert _hits(tier, {"a": 1}) == {"a": True}
        assert tier.put(["b"], [value(2)]) == [True]
        assert _returns(lambda: write_flush_mark(str(tmp_path), 99), mark) is False


def _sparse_segment(path, size: int, head: bytes = b"", tail: bytes = b"") -> None:
    """A segment file of `size` apparent bytes: `head` at 0, `tail` at the end, a hole between."""
    with open(path, "wb") as f:
        f.truncate(size)
        f.write(head)
        if tail:
            f.seek(size - len(tail))
            f.write(tail)


def _bounded_scan(monkeypatch, directory: str) -> tuple[DirectoryScan, int, int]:
    """scan(directory), the bytes it asked os.pread for, and its peak of Python memory (tracemalloc)."""
    real, asked = os.pread, [0]

    def pread(fd, n, off):
        asked[0] += n
        return real(fd, n, off)

    monkeypatch.setattr(os, "pread", pread)
    tracemalloc.start()
    try:
        result = scan(directory)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        monkeypatch.setattr(os, "pread", real)
    return result, asked[0], peak


@pytest.mark.parametrize("claim", ["summary", "group head", "payload"])
def test_a_sparse_file_costs_what_it_holds_not_what_it_claims(tmp_path, monkeypatch, impl, claim):
    """A sparse segment (one 4 KiB block of data) whose trailer claims a summary as long as the file (1
    GiB), whose group head claims a head as long as the file (64 MiB), or whose one entry claims a payload
    as long as the file (1 GiB): the scan used to read the whole claim into memory (MemoryError under a
    ulimit; the head then stepped through 8 bytes at a time in Python, seconds). Now it reads a few
    blocks, whatever the apparent size."""
    with _tier(tmp_path) as tier:
        _fill(tier, ["a"], 1)
    size = 64 * MiB if claim == "group head" else 1 << 30  # the old head walk: 8 bytes a Python step
    path = tmp_path / segment_name(9)
    if claim == "summary":
        _sparse_segment(path, size, tail=pack_trailer(0, size - BLOCK))
    elif claim == "group head":
        nbytes = size - BLOCK
        count = nbytes // entry_span(MAX_KEY_BYTES) + 1  # within the old bound for nbytes
        raw = struct.pack("<8sHHIII", b"UMBP-GRP", VERSION, 0, count, nbytes, 0)[:20]
        _sparse_segment(path, size, head=raw + struct.pack("<I", zlib.crc32(raw)))
    else:
        head = np.zeros(BLOCK, np.uint8)
        pack_group(memoryview(head), [b"forged"], [DATA], [10**6], [size - BLOCK], [12345])
        _sparse_segment(path, size, head=head.tobytes())
    result, asked, peak = _bounded_scan(monkeypatch, str(tmp_path))
    assert sorted(result.records) == ["a"]
    assert asked < 4 * MiB, f"read {asked} bytes of a file holding 4 KiB"
    assert peak < 32 * MiB, f"peak {peak >> 20} MiB"
    with _tier(tmp_path) as tier:
        assert _hits(tier, {"a": 1}) == {"a": True}
        # the forged entry's key and seq are intact: a shadow (kept, it hides older versions); else the
        # segment holds nothing and is deleted
        assert tier.stats()["restart_damaged_records"] == (claim == "payload")
    assert path.exists() == (claim == "payload")


def test_a_group_head_claiming_more_entries_than_any_writer_puts_in_one_is_no_head():
    """The writer's groups hold at most its batch (512 items): a head claiming more is rejected before
    its bytes are read, so no head read is larger than 512 entries with the longest keys (540 KiB)."""
    assert _MAX_BATCH_ITEMS <= MAX_GROUP_ENTRIES
    raw = struct.pack("<8sHHIII", b"UMBP-GRP", VERSION, 0, MAX_GROUP_ENTRIES + 1, 135 * BLOCK, 0)[:20]
    assert parse_group_head(raw + struct.pack("<I", zlib.crc32(raw))) is None
    raw = struct.pack("<8sHHIII", b"UMBP-GRP", VERSION, 0, MAX_GROUP_ENTRIES, 135 * BLOCK, 0)[:20]
    assert parse_group_head(raw + struct.pack("<I", zlib.crc32(raw))) == (MAX_GROUP_ENTRIES, 135 * BLOCK)


def test_psum_pieces_combine_to_the_psum64_of_the_whole(impl):
    """Payloads and summaries are checksummed a chunk at a time: the pieces, at any row offset and with a
    partial last row, must give psum64 exactly."""
    rng = np.random.default_rng(5)
    for n in (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, MiB + 123, 3 * MiB):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        for chunk in (BLOCK, 3 * BLOCK, MiB):
            h = 0
            for at in range(0, n, chunk):
                h ^= psum_piece(data[at : at + chunk], at // BLOCK)
            assert finish(h, n) == checksum(data), (n, chunk)


def _sparse_copy(path: str) -> None:
    """Rewrite `path` with a hole wherever a 4 KiB block is zeros (as `cp --sparse=always` would)."""
    raw = open(path, "rb").read()
    tmp = path + ".sparse"
    with open(tmp, "wb") as f:
        for at in range(0, len(raw), BLOCK):
            block = raw[at : at + BLOCK]
            if block.strip(b"\0"):
                f.seek(at)
                f.write(block)
        f.truncate(len(raw))
    os.replace(tmp, path)


def test_chunked_and_hole_skipping_reads_find_what_whole_reads_find(tmp_path, monkeypatch, impl):
    """The scan reads summaries and payloads a chunk at a time and skips holes in long payloads: with
    chunks of one block, and with the directory's zero blocks made holes, it must find exactly what it
    finds otherwise (every record, intact payloads verified, summaries parsed across chunk boundaries)."""
    big = np.zeros(3 * MiB + 777, np.uint8)  # mostly zeros: holes once made sparse
    big[:5000] = 7
    big[2 * MiB : 2 * MiB + 100] = 9
    big[-10:] = 3
    keys = [f"key-{i:03d}-" + "k" * 200 for i in range(40)]  # a summary of several blocks
    with _tier(tmp_path) as tier:
        for i, k in enumerate(keys):
            assert tier.put([k], [value(i)]) == [True]
        assert tier.flush() and tier.put(["big"], [big]) == [True] and tier.flush()
    with _tier(tmp_path) as tier:
        assert tier.put(["big2"], [big]) == [True] and tier.flush()
    _unseal_last(str(tmp_path))  # big2 walked: its payload checked chunk by chunk
    whole = scan(str(tmp_path))
    assert len(whole.records) == 42 and whole.damaged == 0 and whole.segments[0].sealed
    for seg in _segments(str(tmp_path)):
        _sparse_copy(seg)
    holes = os.path.getsize(seg) - os.stat(seg).st_blocks * 512
    assert holes > 2 * MiB, "the filesystem kept no holes: the hole-skipping path would go untested"
    monkeypatch.setattr(recovery, "READ_CHUNK", BLOCK)
    monkeypatch.setattr(scanio, "READ_CHUNK", BLOCK)
    chunked = scan(str(tmp_path))
    assert chunked.records == whole.records and chunked.damaged == 0
    assert [s.sealed for s in chunked.segments] == [s.sealed for s in whole.segments]
    monkeypatch.undo()
    with _tier(tmp_path) as tier:
        for k in ("big", "big2"):
            out = np.empty(big.size, np.uint8)
            assert tier.get_into([k], [out]) == [True] and np.array_equal(out, big), k


@pytest.mark.parametrize("where", ["open", "truncate"])
def test_a_segment_the_disk_will_not_let_the_tier_adopt_costs_its_records_only(tmp_path, monkeypatch, where):
    """A segment that cannot be opened for writing (a read-only file) or truncated (an I/O error) is left
    alone and its records are not served, counted: the start-up goes on, and a key whose newest version
    it holds is a miss, never the older version another segment still holds."""
    from umbp.pool.ssd import directory as directory_module
    from umbp.pool.ssd.format import segment_name

    d = tmp_path / "ssd"
    with _tier(d) as tier:
        _fill(tier, ["K"], 1)
        for i in range(6):  # 65-105 KiB each: a few 256 KiB segments
            _fill(tier, [f"a{i}"], 5 * (i + 1))
        assert tier.remove(["K"]) == 1
        _fill(tier, ["K", "b"], 2)
    held = scan_directory(str(d))
    newest = held["K"].segment
    assert held["a0"].segment != newest and newest == max(r.segment for r in held.values())
    if where == "truncate":  # the newest segment left open by a crash, so that it must be truncated
        _unseal_last(str(d))
    path = str(d / segment_name(newest))
    real_open_fd, real_truncate = (
        directory_module.DirectoryMixin._open_fd,
        directory_module.DirectoryMixin._truncate,
    )

    def refuse_open(self, shard, p, create):
        if p == path and where == "open":
            raise OSError(errno.EACCES, "Permission denied", p)
        return real_open_fd(self, shard, p, create)

    def refuse_truncate(seg, valid_end):
        if seg.path == path:
            raise OSError(errno.EIO, "Input/output error", seg.path)
        return real_truncate(seg, valid_end)

    monkeypatch.setattr(directory_module.DirectoryMixin, "_open_fd", refuse_open)
    monkeypatch.setattr(directory_module.DirectoryMixin, "_truncate", staticmethod(refuse_truncate))
    with _tier(d) as tier:
        assert tier.exists(["K", "b", "a0"]) == [False, False, True]
        assert tier.get_into(["K"], [np.empty(value(1).size, np.uint8)]) == [False]
        assert tier.stats()["restart_damaged_records"] >= 2
        assert tier.put(["c"], [value(3)]) == [True] and tier.flush()  # a new segment number, not its
    assert os.path.exists(path)


def test_a_second_owner_is_kept_out_even_when_the_lock_file_was_replaced(tmp_path):
    """The owner locks the directory itself: a LOCK file deleted and made again while it runs does not
    let a second SsdTier in beside it."""
    from umbp.pool.ssd.shard import SsdLockedError

    d = tmp_path / "ssd"
    with _tier(d):
        os.unlink(d / "LOCK")
        (d / "LOCK").write_text("")
        with pytest.raises(SsdLockedError, match="in use by another SsdTier"):
            _tier(d)
    with _tier(d):  # released at close
        pass


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_lock_that_is_not_a_regular_file_is_one_clear_error(tmp_path, kind):
    from umbp.pool.ssd.shard import SsdDirectoryError

    d = tmp_path / "ssd"
    d.mkdir()
    lock = d / "LOCK"
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "directory":
        lock.mkdir()
    else:
        lock.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SsdDirectoryError, match="LOCK is not a regular file"):
        _tier(d)
