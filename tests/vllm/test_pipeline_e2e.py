"""umbp under vLLM's pipeline parallelism, end to end: a real engine with two stages (two worker
processes), the tiny Falcon-H1 hybrid split 1 + 3 layers, so the second stage's objects are three times
the size stage 0's config implies. A later turn restores its prefix at the local-hit boundary from umbp
on both stages (from DRAM, or from the SSD tier in a new engine process), with tokens and logprobs
identical to the first."""

from __future__ import annotations

import json

import pytest
from script_runs import script_result

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def turns(tiny_model_dir, extra: dict, count: int) -> dict:
    model = str(tiny_model_dir("falcon_h1"))
    return script_result(
        "_pipeline_turns.py", "falcon_h1", model, "1,3", json.dumps(extra), str(count), timeout_s=600
    )


def test_two_uneven_stages_restore_832_with_identical_outputs(tiny_model_dir):
    result = turns(tiny_model_dir, {"dram_gb": 0.0625}, 2)
    first, second = result["turns"]
    totals = result["totals"]
    assert first["cached"] == 0
    assert second["cached"] == 832 and totals["restored_tokens"] == 832
    assert second["tokens"] == first["tokens"]
    assert max(abs(a - b) for a, b in zip(second["logprobs"], first["logprobs"])) <= 1e-5
    # stage 1 holds three layers of each group: the slots were sized for it, and no save was refused
    assert result["slot_bytes"] == [3 * n for n in result["stage0_object_bytes"]]
    assert not totals.get("save_failures")
    # every stage's layout came with vLLM's start-up handshake: the first request was looked up and saved
    assert not totals.get("lookups_layout_pending") and not totals.get("saves_dropped_layout_pending")


def test_a_new_engine_restores_both_stages_from_the_ssd_tier(tiny_model_dir, tmp_path):
    """Each stage's worker writes its SSD directory under its own namespace; the new engine's scheduler
    scans them once the stages have reported, and restores 832 tokens on both."""
    extra = {"dram_gb": 0.0625, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_gb": 0.25}
    first = turns(tiny_model_dir, extra, 1)
    second = turns(tiny_model_dir, extra, 1)
    (a,), (b,) = first["turns"], second["turns"]
    assert a["cached"] == 0 and b["cached"] == 832
    assert second["totals"]["restored_tokens"] == 832 and second["totals"]["ssd_loaded_objects"] > 0
    assert not second["totals"].get("lookups_layout_pending")  # the SSD tier was scanned at start-up
    assert b["tokens"] == a["tokens"]
    assert max(abs(x - y) for x, y in zip(b["logprobs"], a["logprobs"])) <= 1e-5
