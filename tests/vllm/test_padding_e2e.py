"""On real vLLM-CPU with the tiny hybrids, the DRAM tier holds state pages without vLLM's padding.

vLLM pads each state page of these models to the attention page (Granite's Mamba2 page: 19,840 bytes of
state in a 196,608-byte page; Qwen3-Next's GDN page: 134,144 in 327,680). One engine per model computes
an 840-token prompt, drops its local prefix cache and resends it: umbp must restore the same boundary as a
local hit (832) with identical outputs, while its DRAM tier takes at most 1.1 bytes per byte of state and
KV stored. The DRAM figure is the index's own count of arena bytes taken, the data figure comes from
vLLM's specs (``real_page_size_bytes``) and umbp's per-group object counts, so neither trusts umbp's
sizing; umbp's ``stored_bytes`` and ``stored_data_bytes`` counters must agree with both.
"""

from __future__ import annotations

import pytest

from umbp.tools import vllm_harness as H
from umbp.tools.demo import umbp_scheduler

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TRANSFER = H.umbp_transfer({"dram_gb": 0.25})


@pytest.mark.parametrize("arch", ["granite", "qwen3_next"])
def test_dram_holds_state_pages_without_padding(tiny_model_dir, arch):
    prompt = H.random_prompt(840, seed=3)
    llm = H.make_llm_for_arch(arch, tiny_model_dir(arch), kv_transfer_config=TRANSFER, prefix_match_unit=16)
    try:
        turn1 = H.run_prompt(llm, prompt, max_tokens=4)
        H.drop_gpu_prefix_cache(llm)
        turn2 = H.run_prompt(llm, prompt, max_tokens=4)
        sched = umbp_scheduler(llm)
        totals, dram = dict(sched.totals), sched.index.stats()
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        turn3 = H.run_prompt(llm, prompt, max_tokens=4)
    finally:
        H.shutdown_llm(llm)

    specs = [g.kv_cache_spec for g in groups]
    assert any(s.page_size_bytes > s.real_page_size_bytes for s in specs), "vLLM pads no page here"
    data = sum(
        totals.get(f"stored_objects_g{i}", 0) * s.real_page_size_bytes * len(g.layer_names)
        for i, (g, s) in enumerate(zip(groups, specs, strict=True))
    )
    assert data > 0 and dram["reserved"] == 0
    factor = dram["used_bytes"] / data
    assert factor <= 1.1, (
        f"{arch}: DRAM takes {factor:.2f} bytes per byte of data ({dram['used_bytes']} / {data})"
    )
    assert totals["stored_bytes"] == dram["used_bytes"]
    assert totals["stored_data_bytes"] == data

    assert turn2.num_cached_tokens == turn3.num_cached_tokens == 832
    assert totals["restored_tokens"] == 832
    assert turn1.token_ids == turn2.token_ids == turn3.token_ids
    assert max(abs(a - b) for a, b in zip(turn2.logprobs, turn3.logprobs)) <= 1e-5
