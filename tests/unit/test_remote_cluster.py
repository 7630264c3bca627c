"""RedisTier against a real 3-master Redis Cluster on 127.0.0.1 (started and stopped here): hash tags keep
every rank's shard of one prefix in one slot, lookups span masters in one call, MOVED and ASK during a slot
migration are followed, and a master killed mid-run costs misses — never an exception or a wrong byte."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import HOST, blob, require_redis, start_cluster  # noqa: E402

require_redis()

from redis.crc import key_slot  # noqa: E402

from umbp.pool.remote.tier import RedisTier, RemoteConfig  # noqa: E402

NS = "0123456789abcdef0123456789abcdef"


def okey(i: int, tp: int = 0, group: int = 0) -> str:
    return f"umbp:v1:{NS}:tp{tp}:pcp0:dcp0:pp0:g{group}:{i:064x}"


def slot_of_tag(tag: str) -> int:
    return key_slot(f"umbp:{{{tag}}}".encode())


def cmd(server, *args):
    c = server.client()
    try:
        return c.execute_command(*args)
    finally:
        c.close()


def node_id(server) -> str:
    out = cmd(server, "CLUSTER", "MYID")
    return out.decode() if isinstance(out, bytes) else out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


@pytest.fixture
def tier(cluster):
    t = RedisTier(RemoteConfig.from_options({"urls": cluster.urls, "cluster": True, "quarantine_s": 0}))
    t.clear()
    yield t
    t.clear()
    t.close()


def test_round_trip_across_masters(tier, cluster):
    keys = [okey(i) for i in range(300)]
    data = [blob(1000 + i, i) for i in range(300)]
    assert all(tier.put(keys, data))
    owners = {cluster.owner_of(slot_of_tag(k[-2:])).port for k in keys}
    assert len(owners) == 3  # the keys really are spread over all masters
    present = keys[:150] + [okey(i) for i in range(1000, 1150)]
    assert tier.exists(present) == [True] * 150 + [False] * 150
    outs = [np.empty(d.size, np.uint8) for d in data]
    assert all(tier.get_into(keys, outs))
    assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))


def test_every_rank_and_group_of_one_prefix_shares_a_slot(tier, cluster):
    keys = [okey(0xC0FFEE, tp=tp, group=g) for tp in range(4) for g in range(3)]
    assert all(tier.put(keys, [b"shard"] * len(keys)))
    c = cluster.servers[0].client()
    try:
        names = [n for s in cluster.servers for n in s.client().keys("umbp:*")]
        slots = {c.execute_command("CLUSTER", "KEYSLOT", n) for n in names}
    finally:
        c.close()
    assert len(names) == 2 * len(keys) and len(slots) == 1  # values and markers, one slot


def test_misses_across_masters_are_repaired(tier, cluster):
    """Values evicted apart from their markers and a damaged value, spread over every master, in one
    get: the stale markers and the damaged value are removed (one pipelined repair, routed per slot)."""
    from umbp.pool.remote.format import HEADER_SIZE

    keys = [okey(i) for i in range(90)]
    assert all(tier.put(keys, [blob(4096, i) for i in range(90)]))

    def on_owner(k: str, *args):
        return cmd(cluster.owner_of(slot_of_tag(k[-2:])), *args)

    for k in keys[:60]:
        on_owner(k, "DEL", f"umbp:{{{k[-2:]}}}d:{k}")
    on_owner(keys[60], "SETRANGE", f"umbp:{{{keys[60][-2:]}}}d:{keys[60]}", HEADER_SIZE + 3, b"\xff\xfe")
    assert len({cluster.owner_of(slot_of_tag(k[-2:])).port for k in keys[:60]}) == 3
    got = tier.get_into(keys, [np.zeros(4096, np.uint8) for _ in keys])
    assert got == [False] * 61 + [True] * 29
    s = tier.stats()
    assert (s["stale_markers_removed"], s["corrupt_removed"], s["misses_absent"]) == (60, 1, 60)
    assert tier.exists(keys[:61]) == [False] * 61
    assert sum(on_owner(k, "EXISTS", f"umbp:{{{k[-2:]}}}m:{k}") for k in keys[:61]) == 0


def test_lookup_of_8192_keys_spans_masters_in_one_call(tier):
    keys = [okey(i * 7919) for i in range(8192)]
    assert all(tier.put(keys[::4], [b"v"] * 2048))
    assert tier.exists(keys) == [i % 4 == 0 for i in range(8192)]


def _migrate(cluster, slot: int, finish: bool):
    """Move every key of `slot` to another master; with finish=False leave the slot MIGRATING/IMPORTING
    (clients then get ASK for moved keys), else hand the slot over (clients get MOVED)."""
    src = cluster.owner_of(slot)
    dst = next(s for s in cluster.servers if s is not src)
    cmd(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", node_id(src))
    cmd(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", node_id(dst))
    names = cmd(src, "CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if names:
        cmd(src, "MIGRATE", HOST, dst.port, "", 0, 5000, "KEYS", *names)
    if finish:
        finish_migration(cluster, slot, dst)
    return src, dst


def finish_migration(cluster, slot, dst):
    for s in cluster.servers:
        cmd(s, "CLUSTER", "SETSLOT", slot, "NODE", node_id(dst))


def test_moved_after_a_slot_moves(tier, cluster):
    keys = [okey(0xAB + 256 * j) for j in range(6)]  # all end in 'ab': one tag, one slot
    data = [blob(70_000, j) for j in range(6)]
    assert all(tier.put(keys[:4], data[:4]))
    _migrate(cluster, slot_of_tag("ab"), finish=True)
    assert tier.exists(keys) == [True] * 4 + [False] * 2
    outs = [np.empty(70_000, np.uint8) for _ in range(4)]
    assert all(tier.get_into(keys[:4], outs))
    assert all(np.array_equal(o, d) for o, d in zip(outs, data[:4], strict=True))
    assert tier.stats()["redirects"] >= 1
    time.sleep(0.6)  # past the refresh rate limit
    tier.exists(keys)  # may meet MOVED once more, which refreshes the slot table
    before = tier.stats()["redirects"]
    assert all(tier.put(keys[4:], data[4:]))
    assert tier.exists(keys) == [True] * 6
    assert tier.stats()["redirects"] == before  # routed straight to the new owner now


def test_ask_during_a_migration(tier, cluster):
    keys = [okey(0xCD + 256 * j) for j in range(4)]
    data = [blob(5000, 10 + j) for j in range(4)]
    assert all(tier.put(keys[:2], data[:2]))
    slot = slot_of_tag("cd")
    _, dst = _migrate(cluster, slot, finish=False)  # keys moved, slot still owned by the source
    try:
        assert tier.exists(keys[:2]) == [True, True]
        outs = [np.empty(5000, np.uint8) for _ in range(2)]
        assert tier.get_into(keys[:2], outs) == [True, True]
        assert all(np.array_equal(o, d) for o, d in zip(outs, data[:2], strict=True))
        assert tier.put(keys[2:], data[2:]) == [True, True]  # new keys go to the importing node via ASK
        assert tier.stats()["redirects"] >= 3
    finally:
        finish_migration(cluster, slot, dst)
    outs = [np.empty(5000, np.uint8) for _ in range(4)]
    assert tier.get_into(keys, outs) == [True] * 4
    assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))


def test_kill_a_master_mid_run(tmp_path):
    cluster = start_cluster(tmp_path)
    tier = RedisTier(
        RemoteConfig.from_options(
            {
                "urls": cluster.urls,
                "cluster": True,
                "quarantine_s": 0,
                "timeout_s": 0.5,
                "retry_interval_s": 0.3,
            }
        )
    )
    try:
        keys = [okey(i) for i in range(256)]
        data = [blob(20_000, i) for i in range(256)]
        assert all(tier.put(keys, data))
        victim = cluster.servers[1]
        on_victim = [cluster.owner_of(slot_of_tag(k[-2:])) is victim for k in keys]
        fresh = [okey(10_000 + i) for i in range(64)]
        fresh_alive = [cluster.owner_of(slot_of_tag(k[-2:])) is not victim for k in fresh]
        assert 0 < sum(on_victim) < 256
        victim.stop()
        for wait in (0.0, 1.5):  # at once, and after the others have marked it failed
            time.sleep(wait)
            assert tier.exists(keys) == [not v for v in on_victim]
            outs = [np.zeros(20_000, np.uint8) for _ in keys]
            got = tier.get_into(keys, outs)
            assert got == [not v for v in on_victim]
            assert all(np.array_equal(o, d) for o, d, ok in zip(outs, data, got, strict=True) if ok)
            assert tier.put(fresh, [b"x"] * 64) == fresh_alive
        s = tier.stats()
        assert s["lookup_errors"] > 0 and s["load_errors"] > 0 and s["puts_dropped"] > 0
        assert s["checksum_failures"] == 0
    finally:
        tier.close()
        cluster.stop()
