"""The UMBPConnector on vLLM 0.32's real Scheduler (CPU, no model): hits, keying, failures, TP."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

from sched_harness import GroupDef, build  # noqa: E402

PROMPT = [3 + (i * 37) % 500 for i in range(840)]


def finish_and_drop(h, req_id, prompt, max_tokens=3):
    h.add(req_id, prompt, max_tokens=max_tokens)
    h.run()
    assert h.sched.reset_prefix_cache(), "local prefix cache did not reset (blocks still held?)"


def restored(h, req_id, prompt):
    """Admit `prompt` with an empty local cache; return (num_cached_tokens, mismatches)."""
    h.add(req_id, prompt, max_tokens=4)
    h.step()  # admission: lookup, async load dispatched and run by the fake workers, reported finished
    hit = h.sched.connector._sched.restored.get(req_id, 0)
    mism = h.held_values(req_id, hit) if hit > 0 else []  # before any forward touches the request
    h.run()
    return hit, mism


def test_seed_scenario_restores_832(tmp_path):
    h = build(tmp_path, [GroupDef("fa", 400), GroupDef("mamba", 400)], unit=16)
    finish_and_drop(h, "A", PROMPT)
    n, mism = restored(h, "B", PROMPT)
    assert n == 832
    assert mism == []


def test_boundary_page_off_restores_older_boundary(tmp_path):
    h = build(tmp_path, [GroupDef("fa", 400), GroupDef("mamba", 400)], unit=16,
              extra={"dram_bytes": 64 << 20, "boundary_page": False})
    finish_and_drop(h, "A", PROMPT)
    n, mism = restored(h, "B", PROMPT)
    assert n < 832
    assert mism == []
