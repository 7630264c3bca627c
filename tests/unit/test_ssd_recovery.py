"""Restart after kill -9 and damage: every get is the last flushed version, a newer one, or a miss, never
an older one, and records after a damaged one are still served.

Each round runs a real writer process (puts, removes, re-puts, flushes) and kills it with SIGKILL, damages
its directory (a flipped byte, a zeroed 4 KiB block, a truncation; anywhere, or aimed at one payload),
then reopens it twice (the first restart seals what it walked: its decisions must survive the second)."""

import os
import random
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from umbp.pool.errors import BufferSizeError
from umbp.pool.ssd.format import BLOCK, DATA, TOMBSTONE, segment_name, segment_number
from umbp.pool.ssd.recovery import FLUSH_MARK_NAME, read_flush_mark, scan, scan_directory, write_flush_mark
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
