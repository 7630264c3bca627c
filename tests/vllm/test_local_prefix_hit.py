"""Proves the vLLM-CPU harness: a local (GPU-side) prefix hit on tiny hybrid models, no KV connector.

For each architecture in ``ARCH_CONFIGS`` (one engine each, 8 greedy output tokens):

1. turn 1: 840 seeded random token ids -> no hit;
2. identical resend -> ``num_cached_tokens == 832`` (768 for the attention-only llama, whose hits are per
   128-token block) (``prefix_match_unit=16``: floor(839/16)*16; one token is
   always recomputed) and the same tokens, logprobs within 1e-5 of turn 1;
3. sensitivity: a prompt that differs only in its first token changes the output (so the equality above
   says something: the sharp random weights make the output depend on the whole prefix state);
4. ``drop_gpu_prefix_cache`` -> the identical prompt gets no hit and the same output again.

``UMBP_VLLM_REFERENCE=1`` adds a second engine per architecture with prefix caching off and compares the
resend with it as well (the harness docstring records that this was verified; it doubles the runtime).
"""

from __future__ import annotations

import os
import time

import pytest

from umbp.tools import vllm_harness as H

PROMPT_LEN = 840
EXPECTED_HIT = 832
# attention only (one cache group): vLLM hashes per 128-token block, so its own hit is block-aligned
EXPECTED_HIT_OF = {"llama": 768}
MAX_TOKENS = 8
LOGPROB_TOL = 1e-5
PROMPT_SEED = 1234

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _assert_same_output(got: H.TurnResult, want: H.TurnResult, what: str) -> None:
    assert got.token_ids == want.token_ids, f"{what}: tokens differ: {got.token_ids} != {want.token_ids}"
    d = _max_abs_diff(got.logprobs, want.logprobs)
    assert d <= LOGPROB_TOL, f"{what}: max |dlogprob| {d:.3g} > {LOGPROB_TOL}"


@pytest.mark.parametrize("arch", list(H.ARCH_CONFIGS))
def test_identical_resend_gets_local_prefix_hit(arch, tiny_model_dir, vllm_engine):
    t = time.perf_counter()
    model = tiny_model_dir(arch)
    t_build = time.perf_counter() - t

    t = time.perf_counter()
    llm = vllm_engine(arch)
    t_engine = time.perf_counter() - t

    prompt = H.random_prompt(PROMPT_LEN, seed=PROMPT_SEED)
    turn1 = H.run_prompt(llm, prompt, max_tokens=MAX_TOKENS)
    assert turn1.num_cached_tokens == 0
    assert len(turn1.token_ids) == MAX_TOKENS

    resend = H.run_prompt(llm, prompt, max_tokens=MAX_TOKENS)
    assert resend.num_cached_tokens == EXPECTED_HIT_OF.get(arch, EXPECTED_HIT)
    _assert_same_output(resend, turn1, f"{arch}: resend vs turn 1")

    other = [prompt[0] + 1 if prompt[0] + 1 < 512 else 3] + prompt[1:]
    changed = H.run_prompt(llm, other, max_tokens=MAX_TOKENS)
    assert changed.num_cached_tokens == 0
    assert changed.token_ids != turn1.token_ids or _max_abs_diff(changed.logprobs, turn1.logprobs) > 1e-3, (
        f"{arch}: output does not depend on the first prompt token; equality checks would be vacuous"
    )

    H.drop_gpu_prefix_cache(llm)
    after_drop = H.run_prompt(llm, prompt, max_tokens=MAX_TOKENS)
    assert after_drop.num_cached_tokens == 0, "drop_gpu_prefix_cache left a local hit"
    _assert_same_output(after_drop, turn1, f"{arch}: recompute after drop vs turn 1")

    ref_note = ""
    if os.environ.get("UMBP_VLLM_REFERENCE") == "1":
        vllm_engine.close(llm)
        ref_llm = vllm_engine(arch, enable_prefix_caching=False)
        ref = H.run_prompt(ref_llm, prompt, max_tokens=MAX_TOKENS)
        _assert_same_output(resend, ref, f"{arch}: resend vs prefix-caching-off reference")
        ref_note = f" ref-dlp={_max_abs_diff(resend.logprobs, ref.logprobs):.1e}"

    print(
        f"\n[vllm-cpu] {arch}: {H.ARCH_CONFIGS[arch]} hit={resend.num_cached_tokens} "
        f"resend-dlp={_max_abs_diff(resend.logprobs, turn1.logprobs):.1e} "
        f"build={t_build:.1f}s engine={t_engine:.1f}s turn1={turn1.wall_s:.2f}s resend={resend.wall_s:.2f}s "
        f"changed={changed.wall_s:.2f}s after_drop={after_drop.wall_s:.2f}s "
        f"peak_rss={H.peak_rss_mib():.0f}MiB{ref_note} model={model}"
    )
