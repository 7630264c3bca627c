"""RedisTier's write-behind queue is part of what the tier holds: an object accepted by put_async is found
by exists and loaded by get_into while its copy still waits for (or is in) the background writer, so an
object demoted from DRAM is never in neither place. The writer is held on a gate here, which makes the
window that a loaded machine opens by chance (the writer not yet scheduled) a certainty."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import blob, require_redis  # noqa: E402

require_redis()

from umbp.pool import DramPool, TieredPool  # noqa: E402
from umbp.pool.remote.tier import RedisTier, RemoteConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("impl")  # each test on the C extension's paths and on the Python ones

CODECS = {
    "plain": {},
    "hmac": {"auth_key_env": "UMBP_TEST_QUEUE_KEY"},
    "aes-gcm": {"auth_key_env": "UMBP_TEST_QUEUE_KEY", "encrypt": True},
}


@pytest.fixture(params=list(CODECS))
def tier(request, server, monkeypatch):
    """A tier whose background writer waits on `tier.gate` before each batch (opened at teardown)."""
    monkeypatch.setenv("UMBP_TEST_QUEUE_KEY", "queue-test-secret-0123456789abcdef")
    options = {"url": server.url, "quarantine_s": 0, **CODECS[request.param]}
    t = RedisTier(RemoteConfig.from_options(options))
    t.clear()
    gate = threading.Event()
    real_write = t._write

    def gated(items):
        if threading.current_thread().name == "umbp-remote-writer":
            assert gate.wait(60), "the test never opened the writer's gate"
        return real_write(items)

    monkeypatch.setattr(t, "_write", gated)
    t.gate = gate
    yield t
    gate.set()
    t.clear()
    t.close()


def test_a_queued_object_is_found_and_loaded_before_the_writer_sends_it(tier):
    data = {f"q{i}": blob(n, i) for i, n in enumerate([8192, 8192, 100_003])}
    assert tier.put_async(list(data), list(data.values())) == [True] * 3
    assert tier.stats()["puts"] == 0  # the writer is held: nothing reached the server
    assert tier.exists([*data, "never"]) == [True, True, True, False]
    outs = [np.zeros(v.size, np.uint8) for v in data.values()]
    assert tier.get_into(list(data), outs) == [True] * 3
    assert all(np.array_equal(o, v) for o, v in zip(outs, data.values(), strict=True))
    assert tier.get_into(["q0"], [np.zeros(100, np.uint8)]) == [False]  # another size: the server decides
    s = tier.stats()
    assert (s["write_queue_hits"], s["hits"], s["puts"]) == (3, 3, 0)
    tier.gate.set()
    assert tier.flush(60)
    outs = [np.zeros(v.size, np.uint8) for v in data.values()]
    assert tier.get_into(list(data), outs) == [True] * 3  # now from the server
    assert all(np.array_equal(o, v) for o, v in zip(outs, data.values(), strict=True))
    s = tier.stats()
    assert (s["write_queue_hits"], s["puts"], s["write_queue_bytes"]) == (3, 3, 0)


def test_dram_evictions_stay_readable_while_their_demotion_is_queued(tier):
    """TieredPool([DRAM, RedisTier]) with the shared tier's writer held: every object DRAM evicts is still
    found and loaded (from the queued copy), and promotions evicting others in turn lose nothing."""
    dram = DramPool(capacity_bytes=64 * 1024, pinned=False, high_watermark=1.0, low_watermark=0.75)
    pool = TieredPool([dram, tier])
    blobs = {f"tier{i}": blob(8 * 1024, 100 + i) for i in range(16)}  # 128 KiB through 64 KiB of DRAM
    for k, v in blobs.items():
        assert pool.put([k], [v]) == [True]
    assert pool.stats()["demotions"] > 0 and tier.stats()["puts"] == 0
    assert pool.exists(list(blobs)) == [True] * len(blobs)
    for k, v in blobs.items():
        out = np.empty(v.size, np.uint8)
        assert pool.get_into([k], [out]) == [True] and np.array_equal(out, v), k
    assert tier.stats()["write_queue_hits"] > 0
    tier.gate.set()
    assert pool.flush(60)
    assert tier.stats()["write_queue_bytes"] == 0
