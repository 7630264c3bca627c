"""umbp under vLLM's pipeline parallelism, end to end: a real engine with two stages (two worker
processes), the tiny Falcon-H1 hybrid split 1 + 3 layers, so the second stage's objects are three times
the size stage 0's config implies. The second turn restores its prefix at the local-hit boundary from
umbp on both stages, with tokens and logprobs identical to the first."""

from __future__ import annotations

import pytest
from script_runs import script_result

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_two_uneven_stages_restore_832_with_identical_outputs(tiny_model_dir):
    model = str(tiny_model_dir("falcon_h1"))
    result = script_result("_pipeline_turns.py", "falcon_h1", model, "1,3", timeout_s=600)
    first, second = result["turns"]
    totals = result["totals"]
    assert first["cached"] == 0
    assert second["cached"] == 832 and totals["restored_tokens"] == 832
    assert second["tokens"] == first["tokens"]
    assert max(abs(a - b) for a, b in zip(second["logprobs"], first["logprobs"])) <= 1e-5
    # stage 1 holds three layers of each group: the slots were sized for it, and no save was refused
    assert result["slot_bytes"] == [3 * n for n in result["stage0_object_bytes"]]
    assert not totals.get("save_failures")
    # the warm-up request's first step came before the stages reported: nothing offered, nothing saved
    assert totals["lookups_layout_pending"] >= 1
