"""The building blocks of `umbp chaos` without vLLM: the byte damage it does, and the hostile proxy in
front of a real redis-server, against the shared tier's client (every mangled reply is a miss, never an
exception, a wrong byte or a stall past the proxy's own bound)."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from umbp.pool.checksum import checksum_u8
from umbp.tools.chaos_faults import DRIP_S, ManglingProxy, flip_byte, swap_words, zero_block

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import require_redis, start_server  # noqa: E402


def blob(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_flip_and_zero_change_the_bytes_and_their_checksum():
    for damage in (flip_byte, zero_block):
        data = blob(3 * 4096 + 100)
        before = data.copy()
        assert damage(data, random.Random(1)) is not False
        assert not np.array_equal(data, before)
        assert checksum_u8(data) != checksum_u8(before)


def test_zero_block_refuses_when_every_block_is_zero():
    assert zero_block(np.zeros(8192, np.uint8), random.Random(0)) is False


def test_swap_words_is_a_pure_reorder_inside_one_row():
    data = blob(2 * 4096)
    before = data.copy()
    assert swap_words(data, random.Random(0))
    moved = np.flatnonzero(data.view(np.uint64) != before.view(np.uint64))
    assert moved.size == 2 and moved[0] // 512 == moved[1] // 512  # two words of one 4 KiB row
    assert sorted(data.view(np.uint64)) == sorted(before.view(np.uint64))
    assert swap_words(np.zeros(4096, np.uint8), random.Random(0)) is False  # no two different words


@pytest.fixture
def proxied(tmp_path):
    require_redis()
    from umbp.pool.remote.tier import RedisTier, RemoteConfig

    server = start_server(tmp_path / "redis")
    proxy = ManglingProxy(server.port)
    tier = RedisTier(
        RemoteConfig.from_options(
            {
                "url": proxy.url,
                "timeout_s": 0.3,
                "connect_timeout_s": 0.3,
                "retry_interval_s": 0.05,
                "quarantine_s": 0,
            }
        )
    )
    yield tier, proxy
    tier.close()
    proxy.close()
    server.stop()


@pytest.mark.parametrize("mode", ManglingProxy.MODES)
def test_every_mangled_reply_is_a_miss_then_the_tier_recovers(proxied, mode):
    tier, proxy = proxied
    value = blob(64 << 10, seed=3)
    assert tier.put(["k"], [value]) == [True]
    proxy.arm(mode)
    out = np.zeros_like(value)
    t0 = time.monotonic()
    assert tier.get_into(["k"], [out]) == [False]
    assert time.monotonic() - t0 < DRIP_S + 2.0
    assert proxy.fired == 1 and proxy.armed() is None
    deadline = time.monotonic() + 5
    while tier.get_into(["k"], [out]) != [True]:  # the proxy passes replies through again
        assert time.monotonic() < deadline
        time.sleep(0.05)
        tier.put(["k"], [value])  # a value that failed its checksum was deleted by the tier
    assert np.array_equal(out, value)


@pytest.mark.parametrize("mode", ["nested", "garbage", "close"])
@pytest.mark.parametrize("call", ["exists", "get_into", "put"])
def test_a_mangled_connection_handshake_is_a_miss_not_an_exception(proxied, mode, call):
    """A fresh connection's first reply (redis-py's handshake, parsed by redis-py) is mangled: 100,000
    nested arrays made redis-py's parser raise RecursionError out of exists(), i.e. out of vLLM's
    scheduler step (an engine crash), before the tier treated it as a failed server."""
    tier, proxy = proxied
    value = blob(4096, seed=4)
    proxy.arm(mode)
    if call == "exists":
        assert tier.exists(["k"]) == [False]
    elif call == "get_into":
        assert tier.get_into(["k"], [np.zeros_like(value)]) == [False]
    else:
        assert tier.put(["k"], [value]) == [False]
    assert proxy.fired == 1
