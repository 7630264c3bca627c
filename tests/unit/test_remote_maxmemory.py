"""A full server (maxmemory + noeviction) refuses saves: the refused ones must leave no marker behind, so a
lookup never promises a value that was never stored, and every acknowledged save stays loadable."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import require_redis, start_server  # noqa: E402

require_redis()

from umbp.pool.remote.tier import RedisTier, RemoteConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("impl")


@pytest.mark.parametrize("size, batch", [(256 << 10, 1), (64 << 10, 8)])
def test_refused_saves_leave_no_marker(tmp_path, size, batch):
    s = start_server(tmp_path, "--maxmemory", "6mb", "--maxmemory-policy", "noeviction")
    t = RedisTier(RemoteConfig.from_options({"url": s.url, "quarantine_s": 0, "retry_interval_s": 0}))
    try:
        keys = [f"k{i:04d}" for i in range(96 * (1 << 20) // size // 8)]  # ~12x what fits
        stored: list[bool] = []
        for i in range(0, len(keys), batch):
            chunk = keys[i : i + batch]
            stored += t.put(chunk, [np.full(size, j % 251, np.uint8) for j in range(i, i + len(chunk))])
        assert any(stored) and not all(stored), "the server should fill up part way"
        assert t.stats()["reply_errors"] > 0  # the OOM refusals, counted
        present = t.exists(keys)
        outs = [np.empty(size, np.uint8) for _ in keys]
        loaded = t.get_into(keys, outs)
        assert present == loaded, "a lookup said present for a value that does not load"
        assert [p for p, ok in zip(present, stored, strict=True) if ok] == [True] * sum(stored)
        for j, (ok, out) in enumerate(zip(loaded, outs, strict=True)):
            assert not ok or (out == j % 251).all()
    finally:
        t.close()
        s.stop()
