"""Decode steps cost umbp one set lookup per request once a request's planner has nothing left to plan
(SchedulerSide.settled), on vLLM 0.32's real Scheduler; what gets stored is unchanged (the finish-time
saves still run) and a preempted request is planned again."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from sched_harness import GroupDef, build  # noqa: E402

PROMPT = [3 + (i * 37) % 500 for i in range(840)]
FA_MAMBA_400 = [GroupDef("fa", 400), GroupDef("mamba", 400)]


class _NeverSettled(set):
    """Turns the skip off: every request is planned at every step, as before it existed."""

    def add(self, item) -> None:
        pass


def _run(tmp_path, skip: bool):
    h = build(tmp_path, FA_MAMBA_400, unit=16)
    if not skip:
        h.umbp.settled = _NeverSettled()
    h.add("A", PROMPT, max_tokens=40)
    # the prefill (1,024-token budget), then decode until the block hashes pass the 840-token prompt
    # (hashed in whole 16-token units: 848 after 8 more tokens); from then on nothing can be planned
    for _ in range(12):
        h.step()
    return h


def test_settled_requests_skip_the_planner_while_decoding(tmp_path):
    h = _run(tmp_path / "skip", skip=True)
    side, idle_calls = h.umbp, []
    assert "A" in side.settled
    planner = side.requests["A"].planner
    real_idle = planner.idle
    planner.idle = lambda *a: idle_calls.append(a) or real_idle(*a)
    for _ in range(20):
        h.step()
    assert idle_calls == []  # skipped: the prompt is stored and decode saves are off
    h.run()
    assert "A" not in side.settled and "A" not in side.requests
    assert h.leaks() == {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}
    ref = _run(tmp_path / "ref", skip=False)
    ref.run()
    assert side.totals == ref.umbp.totals  # the same objects stored, with or without the skip
    assert side.totals["stored_objects"] > 0


def test_a_preempted_request_is_planned_again(tmp_path):
    h = _run(tmp_path, skip=True)
    side = h.umbp
    assert "A" in side.settled
    state = SimpleNamespace(req_ids=[], boundary_state_offloads={}, get_block_ids=lambda r: None)
    preempted = SimpleNamespace(  # the fields plan_saves reads of vLLM's SchedulerOutput
        kv_connector_block_state=state,
        preempted_req_ids={"A"},
        scheduled_spec_decode_tokens=None,
        num_scheduled_tokens={},
    )
    side.plan_saves(preempted)
    assert "A" not in side.settled
