"""The fault kinds of `umbp chaos` and the rig that injects them into a live in-process vLLM engine.

The rig wraps the scheduler side's `_place_loads`: when a fault is pending, the next restore the scheduler
places is the victim. Before placement the rig can make the objects miss in the upper tiers (a DRAM
eviction, an SSD tier that lost them: the restore then reads the tier under test); after placement it
knows exactly which objects the workers are about to read, and from where, and damages them on their
medium. So every counted fault lands on bytes a restore really reads, between the lookup that said
"present" and the read: the hardest moment for the tiers.
"""

from __future__ import annotations

import errno
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from umbp.tools.chaos_faults import (
    DAMAGE,
    KEY_CRC_AT,
    VALUE_HEADER,
    FileBytes,
    ManglingProxy,
    RedisServer,
    Target,
    ssd_record,
)

# Kinds no check can catch: without a tenant secret the shared tier has no keyed MAC, so a value forged by
# anyone who can write to the server (header and checksum recomputed) verifies. psum64's format 2 catches
# every swap of two words (DRAM, SSD and the shared tier alike), so the reordered kinds are defended.
UNDEFENDED = frozenset({"redis_forged"})
# With a tenant secret (auth_key_env) every shared-tier value carries a MAC over its key and bytes.
DEFENDED_BY_SECRET = frozenset({"redis_forged"})


def undefended(secret: bool) -> frozenset[str]:
    """The kinds expected to give wrong tokens today, with or without a tenant secret on the shared tier."""
    return UNDEFENDED - DEFENDED_BY_SECRET if secret else UNDEFENDED


@dataclass
class Rig:
    """The live engine's umbp objects and the fault machinery around them."""

    sched: object  # umbp.vllm.scheduler.SchedulerSide
    worker: object  # umbp.vllm.worker.WorkerSide
    server: RedisServer
    proxy: ManglingProxy
    rng: random.Random
    pending: Kind | None = None
    injected: bool = False
    read_keys: list[str] = field(default_factory=list)  # logical keys of the victim restore
    targets: list[Target] = field(default_factory=list)
    enospc_hits: int = 0  # SSD writes failed by Enospc
    recording: bool = False  # while True, the keys of every save the scheduler confirms go to `written`
    written: set[str] = field(default_factory=set)
    last_sources: list[str] = field(default_factory=list)  # tiers the last unfaulted restore read

    def redis(self):
        import redis

        return redis.Redis(port=self.server.port, socket_timeout=5)

    @property
    def value_prefix(self) -> str:
        """The shared tier's key prefix (with a tenant secret it ends in the tenant's namespace)."""
        prefix = self.worker.remote._prefixes(["k"])[0]
        assert prefix is not None, "the chaos server is a standalone Redis: every key has a prefix"
        return prefix

    def value_key(self, rank_key: str) -> str:
        return f"{self.value_prefix}d:{rank_key}"

    def marker_key(self, rank_key: str) -> str:
        return f"{self.value_prefix}m:{rank_key}"

    # ------------------------------------------------------------ the hook
    def install(self) -> None:
        original = self.sched._place_loads

        def place(load, moves):
            kind, self.pending = self.pending, None
            if kind is None:
                ok = original(load, moves)
                self.last_sources = sorted({m.source if m.offset < 0 else "dram" for _g, m, _k in moves})
                return ok
            keys = [key for _g, _m, key in moves]
            self.read_keys = keys
            self.last_sources = [kind.reads]
            self._force(kind.reads, keys)
            ok = original(load, moves)
            self.targets = [self._target(g, m, k) for g, m, k in moves]
            if ok:
                self.injected = bool(kind.inject(self, [t for t in self.targets if t.source == kind.reads]))
            return ok

        self.sched._place_loads = place
        original_lookup = self.sched.lookup

        def lookup(request, num_computed_tokens):
            kind = self.pending
            if kind is None or not kind.at_lookup:
                return original_lookup(request, num_computed_tokens)
            self.pending = None
            keys = [k for per_group in self.sched.boundary_keys(request) for k in per_group]
            self.read_keys = keys
            self._force(kind.reads, keys)  # the lookup must ask the shared tier
            fired = self.proxy.fired
            kind.inject(self, [])
            try:
                return original_lookup(request, num_computed_tokens)
            finally:
                self.injected = self.proxy.fired > fired

        self.sched.lookup = lookup
        original_finish = self.sched._finish_save

        def finish_save(save):
            if self.recording:
                self.written.update(save.keys)
            return original_finish(save)

        self.sched._finish_save = finish_save

    def _force(self, tier: str, keys: list[str]) -> None:
        """Make the restore read `tier`: as if DRAM (and for "remote", the SSD tier too) had lost them."""
        if tier in ("ssd", "remote"):
            self.sched.index.remove(keys)
        if tier == "remote":
            self.sched.ssd_keys.difference_update(keys)

    def _target(self, group: int, move, logical: str) -> Target:
        rank_key = self.worker.rank_key(group, move.prefix_hash)
        source = move.source if move.offset < 0 else "dram"
        nbytes = self.worker.groups[group].object_bytes  # the slot may be larger than the object it holds
        return Target(logical, group, rank_key, source, move.offset, nbytes)

    # ------------------------------------------------------------ after a fault
    def stop_faults(self) -> None:
        """What outlives a fault's turn: the proxy is disarmed, a dead server started again (empty), the
        injected ENOSPC is over."""
        self.proxy.arm(None)
        if not self.server.alive():
            self.server.start()
        self.enospc_hits = 0

    def heal(self) -> None:
        """After `stop_faults` and the victim's saves are confirmed: every object the victim restore read,
        and every object the victim turn stored (computed on top of what it restored: after an undetected
        fault those are wrong too), is dropped from every tier, so each fault's damage stays in its turn."""
        self.recording = False
        self.purge(sorted(set(self.read_keys) | self.written))
        self.read_keys, self.targets, self.injected, self.written = [], [], False, set()

    def purge(self, logical_keys: list[str]) -> None:
        if not logical_keys:
            return
        from umbp.vllm.tiers import logical_key

        self.sched.index.remove(logical_keys)
        self.sched.ssd_keys.difference_update(logical_keys)
        for k in logical_keys:
            self.sched.quarantine.pop(k, None)
        rank_keys = []
        for k in logical_keys:
            parts = k.split(":")
            group, hexed = int(parts[-2][1:]), parts[-1]
            assert logical_key(self.sched.layout.namespace, group, bytes.fromhex(hexed)) == k
            rank_keys.append(self.worker.rank_key(group, bytes.fromhex(hexed)))
        if self.worker.ssd is not None:
            self.worker.ssd.remove(rank_keys)
            self.worker.ssd.flush(30)
        r = self.redis()
        r.delete(*[self.value_key(k) for k in rank_keys], *[self.marker_key(k) for k in rank_keys])
        for tier in (self.sched.remote, self.worker.remote):
            if tier is not None:
                tier._quarantine.discard(rank_keys)


Inject = Callable[[Rig, list[Target]], bool]


@dataclass(frozen=True)
class Kind:
    name: str
    reads: str  # the tier the victim restore is made to read: "dram", "ssd" or "remote"
    inject: Inject  # at placement: damage the targets (those read from `reads`); True when it did
    what: str  # one line for the docs and the table
    fresh_prompt: bool = False  # the prompt must be computed anew under the fault (disk full)
    at_lookup: bool = (
        False  # injected before the scheduler's lookup (inject gets no targets), not at placement
    )
    beside: int = 0  # other prompts computed in the same batch as the victim (their saves make DRAM evict)


def _pick(rig: Rig, targets: list[Target]) -> Target | None:
    return rig.rng.choice(targets) if targets else None


# ------------------------------------------------------------ DRAM
def _dram_damage(how: str) -> Inject:
    def inject(rig: Rig, targets: list[Target]) -> bool:
        t = _pick(rig, targets)
        if t is None:
            return False
        return DAMAGE[how](rig.worker.arena.view(t.offset, t.nbytes), rig.rng) is not False

    return inject


def _dram_stale(rig: Rig, targets: list[Target]) -> bool:
    """Another object's bytes in the slot: what a slot reused too early (a lost race) would hold."""
    for t in rig.rng.sample(targets, len(targets)):
        group = f":g{t.group}:"
        peers = [off for off, (key, _digest) in rig.worker.slots.items() if group in key and off != t.offset]
        dst = rig.worker.arena.view(t.offset, t.nbytes)
        for off in rig.rng.sample(peers, len(peers)):
            src = rig.worker.arena.view(off, t.nbytes)
            if not np.array_equal(src, dst):
                dst[:] = src
                return True
    return False


# ------------------------------------------------------------ SSD
def _ssd_damage(how: str) -> Inject:
    def inject(rig: Rig, targets: list[Target]) -> bool:
        t = _pick(rig, targets)
        rec = ssd_record(rig.worker.ssd, t.rank_key) if t is not None else None
        if rec is None:
            return False
        return rec.edit(lambda buf: DAMAGE[how](buf, rig.rng)) is not False

    return inject


def _ssd_truncated(rig: Rig, targets: list[Target]) -> bool:
    t = _pick(rig, targets)
    rec = ssd_record(rig.worker.ssd, t.rank_key) if t is not None else None
    if rec is None:
        return False
    rec.truncate_inside()  # the file now ends inside this record (and later records in it are gone)
    return True


def _ssd_stale(rig: Rig, targets: list[Target]) -> bool:
    """Another record's payload written over this one: a misdirected or stale write."""
    for t in rig.rng.sample(targets, len(targets)):
        rec = ssd_record(rig.worker.ssd, t.rank_key)
        src = _ssd_peer(rig, t, rec)
        if rec is not None and src is not None:
            data = np.frombuffer(src.read(), np.uint8)

            def put(buf, data=data):
                changed = not np.array_equal(buf, data)
                buf[:] = data
                return changed

            if rec.edit(put):
                return True
    return False


def _ssd_peer(rig: Rig, t: Target, rec: FileBytes | None) -> FileBytes | None:
    """Another record of the same group and length on the SSD tier."""
    if rec is None:
        return None
    tier = rig.worker.ssd
    with tier._lock:
        keys = [k for shard in tier._shards for k in shard.index if k != t.rank_key and f":g{t.group}:" in k]
    for key in rig.rng.sample(keys, len(keys)):
        other = ssd_record(tier, key)
        if other is not None and other.length == rec.length:
            return other
    return None


def _disk_full(rig: Rig, targets: list[Target]) -> bool:
    """The victim was computed while every SSD write failed with ENOSPC; the restore now reads the SSD
    tier, which never got the records (the scheduler was told they were queued)."""
    return rig.enospc_hits > 0 and bool(targets)


# ------------------------------------------------------------ Redis values
def _value(rig: Rig, t: Target) -> bytearray | None:
    v = rig.redis().get(rig.value_key(t.rank_key))
    return bytearray(v) if v is not None else None


def _set_value(rig: Rig, t: Target, value: bytes) -> None:
    rig.redis().set(rig.value_key(t.rank_key), value, keepttl=True)


def _header_size(v: bytearray) -> int:
    """Both value formats keep their header size at bytes 6..8 (32 plain, 64 sealed)."""
    return int.from_bytes(v[6:8], "little") if len(v) >= 8 else VALUE_HEADER


def _redis_damage(how: str) -> Inject:
    def inject(rig: Rig, targets: list[Target]) -> bool:
        t = _pick(rig, targets)
        v = _value(rig, t) if t is not None else None
        if v is None or len(v) <= _header_size(v):
            return False
        payload = np.frombuffer(v, np.uint8, offset=_header_size(v))
        if DAMAGE[how](payload, rig.rng) is False:
            return False
        _set_value(rig, t, bytes(v))
        return True

    return inject


def _redis_truncated(rig: Rig, targets: list[Target]) -> bool:
    t = _pick(rig, targets)
    v = _value(rig, t) if t is not None else None
    if v is None:
        return False
    _set_value(rig, t, bytes(v[: len(v) // 2]))
    return True


def _redis_peer_value(rig: Rig, targets: list[Target]) -> tuple[Target, bytearray] | None:
    """A target and another key's value of the same group and length (one some other prompt stored)."""
    r = rig.redis()
    for t in rig.rng.sample(targets, len(targets)):
        mine = _value(rig, t)
        if mine is None:
            continue
        pattern = f"{rig.value_prefix}d:*:g{t.group}:*"
        names = sorted(
            n for n in r.scan_iter(match=pattern, count=1000) if n != rig.value_key(t.rank_key).encode()
        )
        for name in rig.rng.sample(names, len(names)):
            v = r.get(name)
            if v is not None and len(v) == len(mine) and v != mine:
                return t, bytearray(v)
    return None


def _redis_stale(rig: Rig, targets: list[Target]) -> bool:
    """Another key's value, verbatim, under this key."""
    got = _redis_peer_value(rig, targets)
    if got is None:
        return False
    _set_value(rig, got[0], bytes(got[1]))
    return True


def _redis_forged(rig: Rig, targets: list[Target]) -> bool:
    """Another key's value relabelled for this key by someone who holds no secret: the header's key CRC
    is recomputed (public arithmetic), payload and checksum stay a valid pair. A sealed value's tag covers
    the key: the relabelled value no longer verifies."""
    got = _redis_peer_value(rig, targets)
    if got is None:
        return False
    t, v = got
    at = (
        KEY_CRC_AT if _header_size(v) == VALUE_HEADER else _header_size(v) - 4
    )  # sealed: the header's last field
    v[at : at + 4] = zlib.crc32(t.rank_key.encode()).to_bytes(4, "little")
    _set_value(rig, t, bytes(v))
    return True


def _redis_deleted(rig: Rig, targets: list[Target]) -> bool:
    """The value evicted or expired apart from its marker: exists() said yes, the get finds nothing."""
    t = _pick(rig, targets)
    return t is not None and rig.redis().delete(rig.value_key(t.rank_key)) == 1


def _redis_flushall(rig: Rig, targets: list[Target]) -> bool:
    if not targets:
        return False
    rig.redis().flushall()
    return True


def _redis_kill(rig: Rig, targets: list[Target]) -> bool:
    """kill -9 between the lookup and the read; `heal` starts it again (empty) after the turn."""
    if not targets:
        return False
    rig.server.kill()
    return True


def _hostile(mode: str) -> Inject:
    def inject(rig: Rig, targets: list[Target]) -> bool:
        if not targets:
            return False
        rig.proxy.arm(mode)
        return True

    return inject


def _hostile_lookup(mode: str) -> Inject:
    def inject(rig: Rig, targets: list[Target]) -> bool:
        rig.proxy.arm(mode)  # the next reply is the lookup's EXISTS answer
        return True

    return inject


# ------------------------------------------------------------ evictions racing loads
def _evicted_from_dram(rig: Rig, targets: list[Target]) -> bool:
    """DRAM lost the objects between lookup and placement: the restore must fall back to the SSD tier."""
    return bool(targets)


def _evicted_everywhere(rig: Rig, targets: list[Target]) -> bool:
    """DRAM, then the SSD tier and the shared tier lost them, after the scheduler chose the SSD tier."""
    if not targets:
        return False
    rank_keys = [t.rank_key for t in targets]
    rig.worker.ssd.remove(rank_keys)
    rig.worker.ssd.flush(30)
    r = rig.redis()
    r.delete(*[rig.value_key(k) for k in rank_keys])
    return True


def _under_pressure(rig: Rig, targets: list[Target]) -> bool:
    """Nothing damaged: the victim restores from DRAM while other prompts in its batch are computed and
    saved, so the tiny arena evicts (and demotes) during the restore (the campaign counts the fault only
    when DRAM did evict during the turn)."""
    return bool(targets)


KINDS: dict[str, Kind] = {
    k.name: k
    for k in [
        Kind("dram_bitflip", "dram", _dram_damage("bitflip"), "one byte of an arena slot flipped"),
        Kind("dram_zeroed", "dram", _dram_damage("zeroed"), "one 4 KiB block of an arena slot zeroed"),
        Kind(
            "dram_stale", "dram", _dram_stale, "another object's bytes in the slot (a slot reused too early)"
        ),
        Kind(
            "dram_reordered", "dram", _dram_damage("reordered"), "two 8-byte words of one 4 KiB row swapped"
        ),
        Kind(
            "ssd_bitflip", "ssd", _ssd_damage("bitflip"), "one byte of the record's payload flipped on disk"
        ),
        Kind("ssd_zeroed", "ssd", _ssd_damage("zeroed"), "one 4 KiB block of the payload zeroed on disk"),
        Kind(
            "ssd_stale", "ssd", _ssd_stale, "another record's payload written over it (a misdirected write)"
        ),
        Kind("ssd_truncated", "ssd", _ssd_truncated, "the segment file cut inside the record"),
        Kind("ssd_reordered", "ssd", _ssd_damage("reordered"), "two words of one 4 KiB row swapped on disk"),
        Kind(
            "ssd_disk_full",
            "ssd",
            _disk_full,
            "computed while every SSD write failed with ENOSPC",
            fresh_prompt=True,
        ),
        Kind("redis_bitflip", "remote", _redis_damage("bitflip"), "one payload byte of the value flipped"),
        Kind("redis_zeroed", "remote", _redis_damage("zeroed"), "one 4 KiB block of the value zeroed"),
        Kind("redis_truncated", "remote", _redis_truncated, "the value cut to half its length"),
        Kind("redis_stale", "remote", _redis_stale, "another key's value stored under this key"),
        Kind(
            "redis_forged", "remote", _redis_forged, "another key's value relabelled for this key (no secret)"
        ),
        Kind("redis_reordered", "remote", _redis_damage("reordered"), "two words of one 4 KiB row swapped"),
        Kind("redis_value_gone", "remote", _redis_deleted, "the value deleted, its marker left"),
        Kind("redis_flushall", "remote", _redis_flushall, "FLUSHALL between lookup and read"),
        Kind(
            "redis_killed", "remote", _redis_kill, "server killed -9 between lookup and read, restarted empty"
        ),
        Kind("hostile_flip", "remote", _hostile("flip"), "proxy flips a byte of the value on the wire"),
        Kind("hostile_huge_len", "remote", _hostile("huge_len"), "proxy rewrites the value's length to 2^62"),
        Kind("hostile_garbage", "remote", _hostile("garbage"), "proxy answers with bytes that are not RESP"),
        Kind("hostile_nested", "remote", _hostile("nested"), "proxy answers with 100,000 nested arrays"),
        Kind("hostile_close", "remote", _hostile("close"), "proxy closes the connection as the reply comes"),
        Kind("hostile_drip", "remote", _hostile("drip"), "proxy drips the reply a byte per 50 ms"),
        Kind(
            "lookup_garbage",
            "remote",
            _hostile_lookup("garbage"),
            "proxy answers the lookup with non-RESP bytes",
            at_lookup=True,
        ),
        Kind(
            "lookup_nested",
            "remote",
            _hostile_lookup("nested"),
            "proxy answers the lookup with 100,000 nested arrays",
            at_lookup=True,
        ),
        Kind("evict_race_dram", "ssd", _evicted_from_dram, "evicted from DRAM between lookup and load"),
        Kind(
            "evict_race_batch",
            "dram",
            _under_pressure,
            "restored while 3 other prompts in its batch fill DRAM",
            beside=3,
        ),
        Kind(
            "evict_race_all", "ssd", _evicted_everywhere, "evicted from DRAM, SSD and Redis after the lookup"
        ),
    ]
}


class Enospc:
    """Every SSD write fails with ENOSPC while installed (the tier's own pwritev hook point)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig

    def __enter__(self) -> Enospc:
        from umbp.pool.ssd import io_hooks

        self._saved = io_hooks.pwritev
        rig = self.rig

        def full(fd, iov, offset):
            rig.enospc_hits += 1
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        io_hooks.pwritev = full
        return self

    def __exit__(self, *exc) -> None:
        from umbp.pool.ssd import io_hooks

        io_hooks.pwritev = self._saved
