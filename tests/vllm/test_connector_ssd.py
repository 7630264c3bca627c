"""The SSD tier behind the connector (real Scheduler, fake CPU workers): write-through, restart, faults."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from sched_harness import GroupDef, build  # noqa: E402
from test_connector_scheduler import PROMPT, compute_then_drop, restore  # noqa: E402

GROUPS = [GroupDef("fa", 400), GroupDef("mamba", 400)]


def shut(h) -> None:
    for w in h.workers:
        w.shutdown()


def test_restart_restores_from_ssd(tmp_path):
    extra = {"dram_bytes": 64 << 20, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_gb": 0.25}
    h1 = build(tmp_path, GROUPS, unit=16, extra=extra)
    assert compute_then_drop(h1, "A", PROMPT) == 832
    shut(h1)  # engine 1 exits; its DRAM is gone

    h2 = build(tmp_path, GROUPS, unit=16, extra=extra)  # a new engine: empty DRAM, same SSD directory
    assert h2.umbp.index.stats()["objects"] == 0 and h2.umbp.ssd_keys
    assert restore(h2, "B", PROMPT) == (832, [])
    assert h2.workers[0]._worker.totals["ssd_loaded_bytes"] > 0
    # the load promoted the objects into DRAM: the next restore reads DRAM only
    assert h2.sched.reset_prefix_cache()
    before = h2.workers[0]._worker.totals["ssd_loaded_bytes"]
    assert restore(h2, "C", PROMPT) == (832, [])
    assert h2.workers[0]._worker.totals["ssd_loaded_bytes"] == before
    shut(h2)


def test_a_differently_configured_model_never_restores_anothers_objects(tmp_path):
    """One checkpoint served with a config override (or quantized) computes other KV and state for the
    same tokens: an engine without it, on the same SSD directory, must not find those objects."""
    extra = {"dram_bytes": 64 << 20, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_gb": 0.25}
    h1 = build(tmp_path, GROUPS, unit=16, extra=extra, model_options={"hf_overrides": {"rope_theta": 1234.0}})
    assert compute_then_drop(h1, "A", PROMPT) == 832
    shut(h1)
    h2 = build(tmp_path, GROUPS, unit=16, extra=extra)
    assert h2.umbp.layout.namespace != h1.umbp.layout.namespace
    assert restore(h2, "B", PROMPT) == (0, [])
    shut(h2)
    h3 = build(tmp_path, GROUPS, unit=16, extra=extra, model_options={"hf_overrides": {"rope_theta": 1234.0}})
    assert restore(h3, "C", PROMPT) == (832, [])  # the same configuration finds its own objects
    shut(h3)


def test_dram_eviction_falls_back_to_ssd(tmp_path):
    # a DRAM arena too small for two prompts: the first one's objects are evicted, SSD still has them
    extra = {"dram_bytes": 256 << 10, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_gb": 0.25}
    h = build(tmp_path, GROUPS, unit=16, extra=extra)
    other = [x + 1 for x in PROMPT]
    compute_then_drop(h, "A", PROMPT)
    compute_then_drop(h, "B", other)
    assert h.umbp.totals["evictions"] > 0
    assert restore(h, "C", PROMPT) == (832, [])
    shut(h)


def test_corrupt_ssd_record_is_a_miss_and_a_recompute(tmp_path):
    extra = {"dram_bytes": 64 << 20, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_gb": 0.25}
    h1 = build(tmp_path, GROUPS, unit=16, extra=extra)
    compute_then_drop(h1, "A", PROMPT)
    shut(h1)
    for seg in Path(tmp_path / "ssd").rglob("*"):
        if seg.is_file() and seg.stat().st_size > 64 << 10:
            data = bytearray(seg.read_bytes())
            for off in range(8192, len(data), 4096):  # flip a byte in every payload block
                data[off] ^= 0xFF
            seg.write_bytes(bytes(data))
    h2 = build(tmp_path, GROUPS, unit=16, extra=extra)
    hit, mism = restore(h2, "B", PROMPT)
    assert mism == []  # whatever was restored (nothing, or an intact older boundary) holds the right bytes
    assert h2.umbp.totals["load_failures"] >= 1 or hit == 0
    shut(h2)


def test_reset_external_forgets_dram_and_ssd(tmp_path):
    """reset_prefix_cache?reset_external=true (reset_connector on the Scheduler) must not leave SSD objects restorable by this engine."""
    extra = {"dram_bytes": 64 << 20, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_gb": 0.25}
    h = build(tmp_path, GROUPS, unit=16, extra=extra)
    assert compute_then_drop(h, "A", PROMPT) == 832
    assert h.umbp.ssd_keys and h.umbp.index.stats()["objects"] > 0
    assert h.sched.reset_prefix_cache(reset_connector=True)
    assert h.umbp.index.stats()["objects"] == 0 and not h.umbp.ssd_keys
    assert restore(h, "B", PROMPT) == (0, [])
    shut(h)
