"""The shared tier (Redis) behind the connector: one instance computes, another (fresh DRAM) restores;
a dead or lying server is a miss and a recompute, never a crash or a wrong token."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sched_harness import GroupDef, build  # noqa: E402
from test_connector_scheduler import PROMPT, compute_then_drop, restore  # noqa: E402

from redis_servers import require_redis, start_server  # noqa: E402

GROUPS = [GroupDef("fa", 400), GroupDef("mamba", 400)]


@pytest.fixture
def server(tmp_path):
    require_redis()
    srv = start_server(tmp_path / "redis")
    yield srv
    srv.stop()


def shut(h) -> None:
    for w in h.workers:
        w.shutdown()


def extra(url: str) -> dict:
    return {"dram_bytes": 64 << 20, "remote": {"url": url, "timeout_s": 0.5, "retry_interval_s": 0.2}}


@pytest.mark.parametrize("tp", [1, 2])
def test_second_instance_restores_from_the_shared_tier(tmp_path, server, tp):
    h1 = build(tmp_path, GROUPS, unit=16, tp=tp, extra=extra(server.url))
    assert compute_then_drop(h1, "A", PROMPT) == 832
    shut(h1)  # flushes the asynchronous writes
    h2 = build(tmp_path, GROUPS, unit=16, tp=tp, extra=extra(server.url))
    assert h2.umbp.index.stats()["objects"] == 0
    assert restore(h2, "B", PROMPT) == (832, [])
    assert h2.workers[0]._worker.totals["remote_loaded_bytes"] > 0
    shut(h2)


def test_dead_server_is_a_miss_not_a_crash(tmp_path, server):
    h1 = build(tmp_path, GROUPS, unit=16, extra=extra(server.url))
    compute_then_drop(h1, "A", PROMPT)
    shut(h1)
    server.stop()
    h2 = build(tmp_path, GROUPS, unit=16, extra=extra(server.url))
    assert restore(h2, "B", PROMPT) == (0, [])  # recomputed; and its saves to the dead server are dropped
    assert h2.leaks() == {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}
    shut(h2)


def test_corrupt_remote_value_is_a_recompute(tmp_path, server):
    import redis

    h1 = build(tmp_path, GROUPS, unit=16, extra=extra(server.url))
    compute_then_drop(h1, "A", PROMPT)
    shut(h1)
    client = redis.Redis.from_url(server.url)
    for key in client.scan_iter(count=1000):
        if b":d:" not in key:
            continue  # only the value keys (the tier keeps a marker key beside each)
        value = bytearray(client.get(key))
        value[-1] ^= 0xFF  # flip a payload byte; the header still looks fine
        client.set(key, bytes(value))
    h2 = build(tmp_path, GROUPS, unit=16, extra=extra(server.url))
    hit, mism = restore(h2, "B", PROMPT)
    assert (hit, mism) == (0, [])
    assert h2.umbp.totals["load_failures"] == 1
    # the recompute rewrote the objects; the quarantine keeps the failed copies from being retried meanwhile
    assert json.dumps(h2.leaks()) == json.dumps(
        {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}
    )
    shut(h2)


def test_a_waiting_request_does_not_ask_the_shared_tier_every_step(tmp_path, server):
    """vLLM repeats the lookup every step a request waits; within REMOTE_REUSE_S the answers are reused,
    after it they are asked again (and a restore still happens, byte-exact)."""
    import time

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from umbp.vllm.scheduler import REMOTE_REUSE_S

    h1 = build(tmp_path, GROUPS, unit=16, tp=2, extra=extra(server.url))
    assert compute_then_drop(h1, "A", PROMPT) == 832
    shut(h1)
    h2 = build(tmp_path, GROUPS, unit=16, tp=2, extra=extra(server.url))
    req = Request(
        request_id="probe",
        prompt_token_ids=list(PROMPT),
        pooling_params=None,
        block_hasher=h2.hasher,
        sampling_params=SamplingParams(max_tokens=1),
    )
    asked = lambda: h2.umbp.remote.stats()["exists_keys"]  # noqa: E731
    assert h2.umbp.lookup(req, 0) == (832, True)
    first = asked()
    assert first > 0
    assert h2.umbp.lookup(req, 0) == (832, True) and asked() == first  # reused
    time.sleep(REMOTE_REUSE_S + 0.05)
    assert h2.umbp.lookup(req, 0) == (832, True) and asked() == 2 * first  # asked again
    assert restore(h2, "B", PROMPT) == (832, [])
    shut(h2)


def test_a_value_forged_with_a_valid_checksum_is_a_recompute_with_a_tenant_secret(
    tmp_path, server, monkeypatch
):
    """With `auth_key_env`, someone who can write to the server (a co-tenant, the server itself) replaces
    every stored value with altered bytes whose header and psum64 are fixed up to match: the checksum
    passes, the tag does not, and the second instance recomputes instead of loading forged KV."""
    import struct

    import numpy as np
    import redis

    from umbp.pool.checksum import checksum_u8
    from umbp.pool.remote.auth import SEALED_HEADER_SIZE

    monkeypatch.setenv("UMBP_TEST_TENANT_KEY", "tenant-secret-for-the-forgery-test")
    sealed = {**extra(server.url)}
    sealed["remote"] = {**sealed["remote"], "auth_key_env": "UMBP_TEST_TENANT_KEY"}
    h1 = build(tmp_path, GROUPS, unit=16, extra=sealed)
    compute_then_drop(h1, "A", PROMPT)
    shut(h1)
    client = redis.Redis.from_url(server.url)
    forged = 0
    for key in client.scan_iter(count=1000):
        if b":d:" not in key:
            continue
        value = bytearray(client.get(key))
        value[-1] ^= 0xFF
        payload = np.frombuffer(bytes(value[SEALED_HEADER_SIZE:]), np.uint8)
        struct.pack_into("<Q", value, 24, checksum_u8(payload))  # the checksum matches the forged bytes
        client.set(key, bytes(value))
        forged += 1
    assert forged > 0
    h2 = build(tmp_path, GROUPS, unit=16, extra=sealed)
    assert restore(h2, "B", PROMPT) == (0, [])  # recomputed, no token differs from the reference
    assert h2.umbp.totals["load_failures"] == 1
    loads = h2.workers[0]._worker.remote.stats()
    assert loads["auth_failures"] >= 1 and loads["checksum_failures"] == 0 and loads["hits"] == 0
    assert h2.leaks() == {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}
    shut(h2)
