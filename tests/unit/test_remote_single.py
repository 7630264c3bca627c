"""RedisTier against one real redis-server on 127.0.0.1 (started and stopped here): round trips, lookups,
the value format, corruption, quarantine, TTL, namespace-scoped clear, put_async, auth, ACL users, TLS."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import blob, make_tls_files, require_redis, start_server  # noqa: E402

require_redis()

from umbp.pool import Pool  # noqa: E402
from umbp.pool.errors import BufferSizeError, BufferTypeError  # noqa: E402
from umbp.pool.remote.format import HEADER_SIZE  # noqa: E402
from umbp.pool.remote.tier import RedisTier, RemoteConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("impl")  # each test on the C extension's paths and on the Python ones

NS = "0123456789abcdef0123456789abcdef"


def okey(i: int, ns: str = NS, tp: int = 0, group: int = 0) -> str:
    """A key in umbp's object-key format (docs/keys.md)."""
    return f"umbp:v1:{ns}:tp{tp}:pcp0:dcp0:pp0:g{group}:{i:064x}"


@pytest.fixture
def tier(server):
    t = RedisTier(RemoteConfig.from_options({"url": server.url, "quarantine_s": 0.3, "timeout_s": 2}))
    t.clear()
    yield t
    t.clear()
    t.close()


class MovedClock:
    """Stands in for the tier's clock (retry interval, quarantine): it stands still until the test moves
    it, so an interval neither ends early on a slow machine nor needs a sleep to end."""

    def __init__(self, monkeypatch) -> None:
        import umbp.pool.remote.tier as remote_mod

        self.now = time.monotonic()
        monkeypatch.setattr(remote_mod, "_now", lambda: self.now)

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def raw(server):
    c = server.client()
    yield c
    c.close()


def test_is_a_pool_and_values_are_headed_binary(tier, raw):
    assert isinstance(tier, Pool)
    assert tier.put(["k"], [b"hello"]) == [True]
    value = raw.get("umbp:d:k")
    assert value[:4] == b"UMBP" and value[HEADER_SIZE:] == b"hello" and len(value) == HEADER_SIZE + 5
    assert raw.get("umbp:m:k") == b"1"


@pytest.mark.parametrize("n", [0, 1, 7, 4095, 4096, 4097, 300_003, (1 << 20) + 3])
def test_round_trip_sizes(tier, n):
    data = blob(n, n)
    assert tier.put(["k"], [data]) == [True]
    out = np.full(n, 7, np.uint8)
    assert tier.get_into(["k"], [out]) == [True]
    assert np.array_equal(out, data)


def test_round_trip_buffer_kinds(tier):
    data = np.arange(3000, dtype=np.float32)
    assert (
        tier.put(["np", "mv", "ba"], [data, memoryview(data.tobytes()), bytearray(data.tobytes())])
        == [True] * 3
    )
    out_np, out_u8, out_mv = (
        np.empty(3000, np.float32),
        np.empty((100, 120), np.uint8),
        memoryview(bytearray(12000)),
    )
    assert tier.get_into(["np", "mv", "ba"], [out_np, out_u8, out_mv]) == [True] * 3
    assert np.array_equal(out_np, data) and out_u8.tobytes() == data.tobytes() == bytes(out_mv)
    torch = pytest.importorskip("torch")
    src = torch.arange(2048, dtype=torch.bfloat16).reshape(32, 64)
    assert tier.put(["t"], [src]) == [True]
    dst = torch.empty_like(src)
    assert tier.get_into(["t"], [dst]) == [True] and torch.equal(src, dst)


def test_bad_input_raises_before_any_io(tier):
    with pytest.raises(BufferSizeError):
        tier.put(["a", "b"], [b"x"])
    with pytest.raises(BufferTypeError):
        tier.get_into(["a"], [b"read-only"])
    with pytest.raises(BufferTypeError):
        tier.put(["a"], [np.arange(10)[::2]])


def test_exists_8192_keys_one_call(tier):
    keys = [okey(i) for i in range(8192)]
    stored = keys[::3]
    assert all(tier.put(stored, [b"v"] * len(stored)))
    want = [i % 3 == 0 for i in range(8192)]
    assert tier.exists(keys) == want
    assert tier.stats()["exists_present"] == len(stored)


def test_exists_mixed_key_shapes(tier):
    keys = ["a", "bbbbb", "é-ключ", okey(1), okey(2, tp=11), "x" * 1000]
    assert all(tier.put(keys[::2], [b"1"] * 3))
    assert tier.exists(keys) == [True, False, True, False, True, False]
    assert tier.exists([]) == []


def test_duplicate_put_is_a_no_op(tier, raw):
    assert tier.put(["k"], [b"first"]) == [True]
    assert tier.put(["k"], [b"other"]) == [True]  # True: already present; the value is not rewritten
    out = bytearray(5)
    assert tier.get_into(["k"], [out]) == [True] and bytes(out) == b"first"
    s = tier.stats()
    assert s["puts"] == 1 and s["put_duplicates"] == 1


def test_absent_load_is_quarantined_then_retried(tier, monkeypatch):
    clock = MovedClock(monkeypatch)  # quarantine_s=0.3 lasts until the test moves the clock
    k = okey(5)
    assert tier.get_into([k], [bytearray(4)]) == [False]
    s = tier.stats()
    assert s["misses_absent"] == 1 and s["quarantined"] == 1 and s["quarantine_size"] == 1
    other = RedisTier(tier.config)  # another instance stores it meanwhile
    assert other.put([k], [b"abcd"]) == [True]
    other.close()
    assert tier.exists([k]) == [False]  # still quarantined here
    assert tier.get_into([k], [bytearray(4)]) == [False]
    assert tier.stats()["quarantine_skips"] >= 2
    clock.advance(0.35)
    out = bytearray(4)
    assert tier.exists([k]) == [True] and tier.get_into([k], [out]) == [True] and out == b"abcd"


def test_quarantine_can_be_set_from_outside_and_put_lifts_it(tier):
    assert tier.put(["k"], [b"v"]) == [True]
    tier.quarantine(["k"])
    assert tier.exists(["k"]) == [False]
    tier.remove(["k"])
    assert tier.put(["k"], [b"v"]) == [True]
    assert tier.exists(["k"]) == [True]


def test_corrupt_value_is_a_counted_miss_and_removed(tier, raw):
    data = blob(10_000, 1)
    assert tier.put(["k"], [data]) == [True]
    raw.setrange("umbp:d:k", HEADER_SIZE + 5000, b"\x00\xff")  # flip bytes in the payload
    out = np.empty(10_000, np.uint8)
    assert tier.get_into(["k"], [out]) == [False]
    s = tier.stats()
    assert s["checksum_failures"] == 1 and s["corrupt_removed"] == 1
    assert raw.exists("umbp:d:k", "umbp:m:k") == 0


def test_foreign_wrong_size_and_moved_values_are_misses(tier, raw):
    raw.set("umbp:d:foreign", b"x" * 40)  # not umbp's format
    raw.set("umbp:m:foreign", b"1")
    assert tier.get_into(["foreign"], [bytearray(8)]) == [False]
    assert tier.put(["a"], [b"12345678"]) == [True]
    assert tier.get_into(["a"], [bytearray(9)]) == [False]  # the caller expects another size: a miss
    raw.copy("umbp:d:a", "umbp:d:b")  # a value under the wrong key
    raw.set("umbp:m:b", b"1")
    assert tier.get_into(["b"], [bytearray(8)]) == [False]
    s = tier.stats()
    assert s["header_failures"] == 1 and s["size_mismatches"] == 1 and s["key_mismatches"] == 1
    assert s["hits"] == 0


def test_one_batch_mixes_hits_with_every_kind_of_miss(tier, raw):
    """Replies that are not the expected value sit between good ones in one pipelined batch: each is
    named by its counter, the values after it still land intact, and the connection stays usable."""
    good = {f"g{i}": blob(n, i) for i, n in enumerate([4096, 10_000, 65_536, 5])}
    assert all(tier.put(list(good), list(good.values())))
    raw.rpush("umbp:d:list", "x")  # GET answers -WRONGTYPE
    raw.set("umbp:d:foreign", b"y" * (HEADER_SIZE + 100))  # the expected length, not umbp's header
    assert tier.put(["short", "bad"], [b"12345678", blob(8192, 9)]) == [True, True]
    raw.setrange("umbp:d:bad", HEADER_SIZE + 100, b"\xff\x00")  # a damaged payload
    raw.copy("umbp:d:g1", "umbp:d:moved")  # a value under another key
    keys = ["g0", "list", "g1", "absent", "foreign", "g2", "short", "bad", "moved", "g3"]
    sizes = {"list": 10, "absent": 10, "foreign": 100, "short": 9, "bad": 8192, "moved": 10_000}
    outs = {k: np.zeros(sizes.get(k) or good[k].size, np.uint8) for k in keys}
    assert tier.get_into(keys, [outs[k] for k in keys]) == [k in good for k in keys]
    assert all(np.array_equal(outs[k], v) for k, v in good.items())
    s = tier.stats()
    assert (s["hits"], s["misses"], s["load_errors"], s["reply_errors"], s["misses_absent"]) == (
        4,
        6,
        1,
        1,
        1,
    )
    assert (s["header_failures"], s["size_mismatches"], s["checksum_failures"], s["key_mismatches"]) == (
        1,
        1,
        1,
        1,
    )
    assert s["connection_errors"] == 0 and not s["servers_down"]
    again = np.zeros(good["g2"].size, np.uint8)
    assert tier.get_into(["g2"], [again]) == [True] and np.array_equal(again, good["g2"])


def test_same_size_batch_mixes_hits_with_every_kind_of_miss(tier, raw):
    """The batched path (one size, whole 4 KiB rows): every kind of miss between good values, each
    named by its counter; a damaged payload fails its checksum and is removed; the values after each
    miss land intact and the connection stays usable."""
    n = 2 * 4096
    good = {f"g{i}": blob(n, i) for i in range(4)}
    assert all(tier.put(list(good), list(good.values())))
    raw.rpush("umbp:d:list", "x")  # GET answers -WRONGTYPE
    raw.set("umbp:d:foreign", b"y" * (HEADER_SIZE + n))  # the expected length, not umbp's header
    assert tier.put(["short", "bad", "old"], [b"12345678", blob(n, 9), blob(n, 10)]) == [True] * 3
    raw.setrange("umbp:d:bad", HEADER_SIZE + 100, b"\xff\x00")  # a damaged payload
    raw.setrange("umbp:d:old", 4, b"\x07")  # another format version
    raw.copy("umbp:d:g1", "umbp:d:moved")  # a value under another key
    keys = ["g0", "list", "g1", "absent", "foreign", "g2", "short", "bad", "moved", "old", "g3"]
    outs = {k: np.zeros(n, np.uint8) for k in keys}
    assert tier.get_into(keys, [outs[k] for k in keys]) == [k in good for k in keys]
    assert all(np.array_equal(outs[k], v) for k, v in good.items())
    s = tier.stats()
    assert (s["hits"], s["misses"], s["load_errors"], s["reply_errors"], s["misses_absent"]) == (
        4,
        7,
        1,
        1,
        1,
    )
    assert (
        s["header_failures"],
        s["size_mismatches"],
        s["checksum_failures"],
        s["key_mismatches"],
        s["version_mismatches"],
    ) == (1, 1, 1, 1, 1)
    assert s["corrupt_removed"] == 1 and raw.exists("umbp:d:bad") == 0
    assert s["connection_errors"] == 0 and not s["servers_down"]
    again = np.zeros(n, np.uint8)
    assert tier.get_into(["g2"], [again]) == [True] and np.array_equal(again, good["g2"])


@pytest.mark.parametrize("n", [4096, 65536, 256 * 1024])
def test_same_size_batch_round_trip_and_every_single_corruption(tier, raw, n):
    """A batch of 20 same-size values (more than one receive buffer), one of them damaged at a time in
    its first, middle or last word: exactly that one misses, every other arrives intact."""
    keys = [f"k{i}" for i in range(20)]
    data = [blob(n, i) for i in range(20)]
    assert all(tier.put(keys, data))
    for victim, at in [(0, 0), (9, n // 2), (19, n - 1)]:
        raw.setrange(f"umbp:d:{keys[victim]}", HEADER_SIZE + at, bytes([data[victim][at] ^ 0x10]))
        outs = [np.zeros(n, np.uint8) for _ in keys]
        assert tier.get_into(keys, outs) == [i != victim for i in range(20)]
        assert all(np.array_equal(o, d) for i, (o, d) in enumerate(zip(outs, data)) if i != victim)
        assert tier.put([keys[victim]], [data[victim]]) == [True]  # removed as corrupt; store it again
    assert tier.stats()["checksum_failures"] == 3


def test_same_size_batch_longer_than_the_get_window_with_misses_throughout(tier, raw):
    """200 values of 64 KiB (12.5 MiB: the get window of 4 MiB is topped up mid-batch, so the batched read
    is resumed at each refill) with absent and damaged values spread through it, one at a window edge."""
    n, count = 65536, 200
    keys = [f"w{i}" for i in range(count)]
    data = [blob(n, 1000 + i) for i in range(count)]
    assert all(tier.put(keys, data))
    absent, damaged = {0, 63, 64, 65, 127, 199}, {1, 62, 128, 198}
    for i in absent:
        raw.delete(f"umbp:d:{keys[i]}")
    for i in damaged:
        raw.setrange(f"umbp:d:{keys[i]}", HEADER_SIZE + 7, bytes([data[i][7] ^ 1]))
    outs = [np.zeros(n, np.uint8) for _ in keys]
    got = tier.get_into(keys, outs)
    assert got == [i not in absent | damaged for i in range(count)]
    assert all(np.array_equal(outs[i], data[i]) for i in range(count) if got[i])
    s = tier.stats()
    assert (s["misses_absent"], s["checksum_failures"], s["connection_errors"]) == (6, 4, 0)


def test_marker_without_value_heals(tier, raw):
    assert tier.put(["k"], [b"v"]) == [True]
    raw.delete("umbp:d:k")  # as if evicted apart from its marker
    assert tier.get_into(["k"], [bytearray(1)]) == [False]
    assert tier.stats()["stale_markers_removed"] == 1 and raw.exists("umbp:m:k") == 0


def test_a_batch_of_misses_is_repaired_in_one_round_trip(tier, raw, monkeypatch):
    """300 values evicted apart from their markers and 2 corrupt ones in one get: every stale marker and
    every corrupt value is removed, through one pipelined round trip (a command per key, each awaited,
    made a batch of 1,024 absent keys ~10x slower than a batch of hits), and a value that is present is
    left alone."""
    from umbp.pool.remote.resp import Wire

    n = 4096
    keys = [f"s{i}" for i in range(303)]
    assert all(tier.put(keys, [blob(n, i) for i in range(303)]))
    for k in keys[:300]:
        raw.delete(f"umbp:d:{k}")
    for k in keys[300:302]:
        raw.setrange(f"umbp:d:{k}", HEADER_SIZE + 5, b"\xff\xfe")
    rounds = []  # per send that carries repair scripts: how many
    real = Wire.send

    def counted(self, parts):
        evals = sum(bytes(p[:14]) == b"*5\r\n$4\r\nEVAL\r\n" for p in parts)
        if evals:
            rounds.append(evals)
        return real(self, parts)

    monkeypatch.setattr(Wire, "send", counted)
    got = tier.get_into(keys, [np.zeros(n, np.uint8) for _ in keys])
    assert got == [False] * 302 + [True]
    s = tier.stats()
    assert (s["misses_absent"], s["checksum_failures"]) == (300, 2)
    assert (s["stale_markers_removed"], s["corrupt_removed"]) == (300, 2)
    assert rounds == [302]
    assert sum(raw.exists(f"umbp:m:{k}", f"umbp:d:{k}") for k in keys[:302]) == 0
    assert raw.exists("umbp:m:s302", "umbp:d:s302") == 2


def test_ttl(server, raw):
    """Value and marker carry the TTL and expire. The TTL (the server's clock) is long enough that a
    stalled test still reads it before expiry; the expiry is then waited for, not slept past."""
    t = RedisTier(RemoteConfig.from_options({"url": server.url, "ttl_s": 1.5}))
    assert t.put(["k"], [b"v"]) == [True]
    assert 0 < raw.pttl("umbp:d:k") <= 1500 and 0 < raw.pttl("umbp:m:k") <= 1500
    _wait_until(lambda: t.exists(["k"]) == [False], "the object expired", timeout=30)
    assert raw.exists("umbp:d:k", "umbp:m:k") == 0
    t.close()


def test_clear_is_scoped(server, raw):
    a = RedisTier(RemoteConfig.from_options({"url": server.url, "key_prefix": "umbp:tenantA:"}))
    b = RedisTier(RemoteConfig.from_options({"url": server.url, "key_prefix": "umbp:tenantB:"}))
    raw.set("user:data", b"keep me")
    ns2 = "f" * 32
    assert all(a.put([okey(1), okey(2), okey(1, ns2)], [b"1", b"2", b"3"]))
    assert b.put([okey(1)], [b"b"]) == [True]
    a.clear(startswith=f"umbp:v1:{ns2}:")  # one model's namespace only
    assert a.exists([okey(1), okey(2), okey(1, ns2)]) == [True, True, False]
    a.clear()
    assert a.exists([okey(1), okey(2)]) == [False, False]
    assert b.exists([okey(1)]) == [True] and raw.get("user:data") == b"keep me"
    b.clear()
    assert raw.get("user:data") == b"keep me"
    raw.delete("user:data")
    a.close()
    b.close()


def test_remove(tier):
    assert all(tier.put(["a", "b"], [b"1", b"2"]))
    assert tier.remove(["a", "b", "c"]) == 2
    assert tier.exists(["a", "b"]) == [False, False]


def test_put_sends_each_object_before_summing_later_ones(tier, monkeypatch):
    """The first object goes out before the second is checksummed, and every object of PUT_SEND_BYTES or
    more goes out before the next is summed: the server stores while the client sums."""
    import umbp.pool.remote.auth as auth_mod  # the value codec sums each payload as it seals it
    import umbp.pool.remote.writer as remote_mod
    from umbp.pool.remote.resp import Wire

    events: list[str] = []
    real_sum, real_send = auth_mod.checksum_u8, Wire.send
    monkeypatch.setattr(auth_mod, "checksum_u8", lambda a: events.append("sum") or real_sum(a))
    monkeypatch.setattr(Wire, "send", lambda self, parts: events.append("send") or real_send(self, parts))
    big, small = remote_mod.PUT_SEND_BYTES, 4096
    assert all(tier.put(["b0", "b1", "b2"], [blob(big, i) for i in range(3)]))
    assert events == ["sum", "send"] * 3
    events.clear()
    n_small = 2 + 2 * big // small  # the first alone, then PUT_SEND_BYTES at a time
    assert all(tier.put([f"s{i}" for i in range(n_small)], [blob(small, i) for i in range(n_small)]))
    per_send = big // small
    assert events == ["sum", "send"] + (["sum"] * per_send + ["send"]) * 2 + ["sum", "send"]
    outs = [np.empty(big, np.uint8) for _ in range(3)]
    assert tier.get_into(["b0", "b1", "b2"], outs) == [True] * 3
    assert all(np.array_equal(o, blob(big, i)) for i, o in enumerate(outs))


def test_get_interrupted_mid_read_drops_the_connection(server, monkeypatch):
    """An exception while replies are being read (Ctrl-C) leaves replies unread on the connection: it
    must be dropped and given back, not kept for the next call and not leaked (with two connections
    allowed, three interrupted gets would otherwise exhaust the pool)."""
    tier = RedisTier(RemoteConfig.from_options({"url": server.url, "max_connections": 2, "quarantine_s": 0}))
    data = [blob(65536, i) for i in range(3)]
    keys = ["g0", "g1", "g2"]
    real_read = RedisTier._read_same_size

    def interrupted(self, *args):
        raise KeyboardInterrupt

    try:
        assert tier.put(keys, data) == [True] * 3
        outs = [np.empty(65536, np.uint8) for _ in keys]
        monkeypatch.setattr(RedisTier, "_read_same_size", interrupted)
        for _ in range(3):
            with pytest.raises(KeyboardInterrupt):
                tier.get_into(keys, outs)
        monkeypatch.setattr(RedisTier, "_read_same_size", real_read)
        for _ in range(3):  # no connection with unread replies was kept
            outs = [np.empty(65536, np.uint8) for _ in keys]
            assert tier.get_into(keys, outs) == [True] * 3
            assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))
        s = tier.stats()
        assert s["pool_exhausted"] == 0 and s["connection_errors"] == 0 and s["reply_errors"] == 0
    finally:
        tier.clear()
        tier.close()


def test_put_interrupted_mid_batch_drops_the_connection(server, monkeypatch):
    """An exception while a batch is being sent (here: in a checksum) leaves half a command on the wire:
    that connection must be dropped and given back to the pool, not reused and not leaked (with two
    connections allowed, three interrupted puts would otherwise exhaust the pool)."""
    import umbp.pool.remote.auth as auth_mod  # the value codec sums each payload as it seals it
    import umbp.pool.remote.writer as remote_mod

    tier = RedisTier(RemoteConfig.from_options({"url": server.url, "max_connections": 2, "quarantine_s": 0}))
    real_sum = auth_mod.checksum_u8
    calls = []

    def failing_sum(a):
        calls.append(1)
        if len(calls) % 2 == 0:
            raise KeyboardInterrupt
        return real_sum(a)

    data = [blob(remote_mod.PUT_SEND_BYTES, i) for i in range(3)]
    try:
        monkeypatch.setattr(auth_mod, "checksum_u8", failing_sum)
        for _ in range(3):
            calls.clear()
            with pytest.raises(KeyboardInterrupt):
                tier.put(["i0", "i1", "i2"], data)
        monkeypatch.setattr(auth_mod, "checksum_u8", real_sum)
        for _ in range(3):  # every pooled connection is clean
            assert tier.put(["j0", "j1"], data[:2]) == [True, True]
            outs = [np.empty(d.size, np.uint8) for d in data[:2]]
            assert tier.get_into(["j0", "j1"], outs) == [True, True]
            assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=False))
        # i0 went out whole before the interrupt; whether the server ran its transaction before the
        # connection was reset is a race (the reset can discard bytes the server had not read yet), so
        # only: the interrupted objects are absent, and i0, when present, loads exactly
        present = tier.exists(["i0", "i1", "i2"])
        assert present[1:] == [False, False]
        out = np.empty(data[0].size, np.uint8)
        assert tier.get_into(["i0"], [out]) == [present[0]] and (
            not present[0] or np.array_equal(out, data[0])
        )
        s = tier.stats()
        assert s["reply_errors"] == 0 and s["pool_exhausted"] == 0
    finally:
        tier.clear()
        tier.close()


def test_put_async_copies_and_writes_in_background(tier):
    data = blob(200_000, 3)
    keys = [f"async{i}" for i in range(8)]
    assert tier.put_async(keys, [data] * 8) == [True] * 8
    data[:] = 0  # the caller may reuse its buffer at once: the tier copied it
    assert tier.flush(10)
    out = np.empty(200_000, np.uint8)
    assert tier.get_into([keys[3]], [out]) == [True] and np.array_equal(out, blob(200_000, 3))
    s = tier.stats()
    assert s["async_accepted"] == 8 and s["puts"] == 8 and s["write_queue_bytes"] == 0


def test_put_async_with_checksums_publishes_only_matching_bytes(tier):
    """The worker passes the digests its GPU save computed: an arena slot whose bytes changed since (a
    later save already reusing it) must be dropped, not published under the old key with a checksum
    computed from the new bytes."""
    from umbp.pool import BufferSizeError
    from umbp.pool.checksum import checksum

    good, changed = blob(100_000, 5), blob(100_000, 6)
    digest = checksum(good)
    assert tier.put_async(["ck-good", "ck-changed"], [good, changed], checksums=[digest, digest]) == [
        True,
        False,
    ]
    assert tier.flush(10)
    out = np.empty(100_000, np.uint8)
    assert tier.get_into(["ck-good"], [out]) == [True] and np.array_equal(out, good)
    assert tier.exists(["ck-changed"]) == [False]
    s = tier.stats()
    assert s["puts_dropped_checksum"] == 1 and s["puts_dropped"] == 1 and s["write_queue_bytes"] == 0
    assert tier.put_async(["ck-changed"], [good], checksums=[digest]) == [
        True
    ]  # its reservation was given back
    with pytest.raises(BufferSizeError, match="checksums"):
        tier.put_async(["a", "b"], [good, good], checksums=[digest])


def test_dram_evictions_demote_to_the_shared_tier_through_its_queue(tier):
    """TieredPool([DRAM, RedisTier]): an eviction runs under DramPool's lock, so the demotion must be a
    queued, checksum-checked copy (put_async), not a network round trip; every object stays readable."""
    from umbp.pool import DramPool, TieredPool

    dram = DramPool(capacity_bytes=64 * 1024, pinned=False, high_watermark=1.0, low_watermark=0.75)
    pool = TieredPool([dram, tier])
    blobs = {f"tier{i}": blob(8 * 1024, 100 + i) for i in range(16)}  # 128 KiB through 64 KiB of DRAM
    for k, v in blobs.items():
        assert pool.put([k], [v]) == [True]
    assert pool.flush(10)
    demoted, s = pool.stats()["demotions"], tier.stats()
    assert demoted > 0 and s["async_accepted"] == demoted and s["puts"] == demoted
    assert s["write_queue_bytes"] == 0  # TieredPool.flush drained the shared tier's queue too
    for k, v in blobs.items():
        out = np.empty(v.size, np.uint8)
        assert pool.get_into([k], [out]) == [True] and np.array_equal(out, v), k


def _wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Poll `condition` until true; a generous bound, since a loaded CI machine may not schedule the
    writer for seconds, and the bound only matters when something is broken."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting until {what}"
        time.sleep(0.005)


def test_put_async_reuses_its_queue_memory_without_mixing_objects(server):
    """put_async copies into one reused arena: pages go back only once their object was sent, so with a
    queue far smaller than the data, objects copied into recycled pages while the writer is still sending
    older ones all arrive intact (or are refused, counted), and the arena ends up whole again. Before each
    batch the writer is let drain down to one object (which it may still be sending): that makes room
    for the batch's first object whatever the machine's load (at most two free runs, one of 91+ pages,
    for objects of at most 74), so more than the arena's size always goes through it, without a sleep."""
    arena = 1 << 20
    t = RedisTier(RemoteConfig.from_options({"url": server.url, "write_queue_bytes": arena, "timeout_s": 5}))
    rng = np.random.default_rng(7)
    sent: dict[str, np.ndarray] = {}
    refused = []
    for r in range(12):
        _wait_until(lambda: len(t._writer._queued) <= 1, "the writer holds at most one object")
        batch = {f"arena{r}-{i}": blob(int(rng.integers(1, 300_000)), 1000 * r + i) for i in range(6)}
        for k, ok in zip(batch, t.put_async(list(batch), list(batch.values())), strict=True):
            (sent.__setitem__(k, batch[k]) if ok else refused.append(k))
    assert t.flush(60)
    assert all(f"arena{r}-0" in sent for r in range(12))  # the room made before each batch took its first
    assert sum(v.size for v in sent.values()) > arena  # so pages were given back and reused
    assert t.stats()["puts_dropped_queue_full"] == len(refused)
    for k, v in sent.items():
        out = np.empty(v.size, np.uint8)
        assert t.get_into([k], [out]) == [True] and np.array_equal(out, v), k
    assert t.exists(refused) == [False] * len(refused)
    pages = t._writer._pages
    assert pages.free_pages == pages.npages == arena // 4096  # every page given back
    t.clear()
    t.close()


def test_put_async_full_queue_drops_and_counts(server):
    t = RedisTier(
        RemoteConfig.from_options({"url": server.url, "write_queue_bytes": 100_000, "timeout_s": 5})
    )
    server.pause(0.5)  # the writer's SETs wait: the queue cannot drain
    first = t.put_async(["q1"], [bytes(64_000)])
    second = t.put_async(["q2"], [bytes(64_000)])
    assert first == [True] and second == [False]
    assert t.flush(10)
    s = t.stats()
    assert s["puts_dropped_queue_full"] == 1 and s["puts_dropped"] == 1 and s["puts"] == 1
    assert t.exists(["q1", "q2"]) == [True, False]
    t.clear()
    t.close()


def test_concurrent_threads_never_see_wrong_bytes(tier):
    import threading

    errors: list[str] = []

    def worker(w: int) -> None:
        for i in range(20):
            k, data = f"w{w}:{i}", blob(5000 + i, w * 100 + i)
            tier.put([k], [data])
            out = np.empty(data.size, np.uint8)
            if tier.get_into([k], [out]) != [True] or not np.array_equal(out, data):
                errors.append(k)
            tier.exists([k, f"w{w}:{i + 1}"])

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


# ---- auth, ACL users, TLS -------------------------------------------------------------------------------


def test_password_auth(tmp_path):
    s = start_server(tmp_path, password="pw-123")
    try:
        good = RedisTier(RemoteConfig.from_options({"url": s.url}))
        assert good.put(["k"], [b"v"]) == [True] and good.exists(["k"]) == [True]
        good.close()
        bad = RedisTier(
            RemoteConfig.from_options({"url": f"redis://127.0.0.1:{s.port}/0", "password": "wrong"})
        )
        assert bad.exists(["k"]) == [False] and bad.put(["x"], [b"v"]) == [False]
        st = bad.stats()
        assert st["connection_errors"] >= 1 and "wrong" not in str(st) and "pw-123" not in str(st)
        bad.close()
    finally:
        s.stop()


def test_acl_user_limited_to_the_prefix(tmp_path, monkeypatch):
    s = start_server(tmp_path)
    try:
        admin = s.client()
        admin.execute_command("ACL", "SETUSER", "umbp-app", "on", ">app-pw", "~umbp:*", "+@all")
        admin.close()
        monkeypatch.setenv("UMBP_TEST_REDIS_PW", "app-pw")
        t = RedisTier(
            RemoteConfig.from_options(
                {"url": s.url, "username": "umbp-app", "password_env": "UMBP_TEST_REDIS_PW"}
            )
        )
        assert t.put(["k"], [b"v"]) == [True]
        out = bytearray(1)
        assert t.exists(["k"]) == [True] and t.get_into(["k"], [out]) == [True] and out == b"v"
        t.clear()
        t.close()
    finally:
        s.stop()


def test_tls(tmp_path):
    tls = make_tls_files(tmp_path)
    s = start_server(tmp_path / "srv", tls=tls)
    try:
        t = RedisTier(RemoteConfig.from_options({"url": s.url, "tls_ca_file": str(tls.ca)}))
        data = blob(300_000, 9)
        assert t.put(["k"], [data]) == [True]
        out = np.empty(data.size, np.uint8)
        assert t.get_into(["k"], [out]) == [True] and np.array_equal(out, data)
        t.close()
        untrusted = RedisTier(RemoteConfig.from_options({"url": s.url}))  # system CAs: the cert is refused
        assert untrusted.exists(["k"]) == [False] and untrusted.stats()["connection_errors"] >= 1
        untrusted.close()
        plain = RedisTier(
            RemoteConfig.from_options({"url": f"redis://127.0.0.1:{s.port}/0", "timeout_s": 0.5})
        )
        assert plain.exists(["k"]) == [False]  # plain text against a TLS port: a miss, not a hang or crash
        plain.close()
    finally:
        s.stop()


def test_matches_a_dict_model(server):
    """Random put/get/exists/remove sequences agree with a dict (hypothesis, a few dozen runs)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    ops = st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "exists", "remove"]), st.integers(0, 5), st.binary(max_size=3000)
        ),
        max_size=25,
    )
    tier = RedisTier(
        RemoteConfig.from_options({"url": server.url, "key_prefix": "umbp:model:", "quarantine_s": 0})
    )

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops)
    def run(seq):
        tier.clear()
        model: dict[str, bytes] = {}
        for op, i, data in seq:
            k = f"key{i}"
            if op == "put":
                assert tier.put([k], [data]) == [True]
                model.setdefault(k, data)  # a duplicate put never overwrites
            elif op == "get":
                n = len(model.get(k, data))
                out = bytearray(n)
                assert tier.get_into([k], [out]) == [k in model]
                if k in model:
                    assert bytes(out) == model[k]
            elif op == "exists":
                assert tier.exists([k, "never"]) == [k in model, False]
            else:
                assert tier.remove([k]) == int(model.pop(k, None) is not None)

    try:
        run()
    finally:
        tier.clear()
        tier.close()


def test_a_put_of_many_objects_is_read_back_in_bounded_runs(server):
    """10,000 saves in one call: their all-OK replies (40 bytes each) are matched a run at a time, so the
    read buffer stays bounded however large the batch. The call's deadline grows with payload bytes, not
    with the object count, and 10,000 objects are ~0.6 s of client work on a busy 2-core machine: the
    fixture's 2 s would turn a slow scheduler into dropped saves, so this tier gets a deadline fit for the
    batch (the deadline itself is tested in test_remote_hostile.py)."""
    tier = RedisTier(RemoteConfig.from_options({"url": server.url, "timeout_s": 60}))
    keys = [f"many{i}" for i in range(10_000)]
    try:
        assert tier.put(keys, [i.to_bytes(8, "little") for i in range(10_000)]) == [True] * 10_000
        outs = [np.empty(8, np.uint8) for _ in keys[::997]]
        assert tier.get_into(keys[::997], outs) == [True] * len(outs)
        assert [int.from_bytes(o.tobytes(), "little") for o in outs] == list(range(0, 10_000, 997))
    finally:
        tier.clear()
        tier.close()
