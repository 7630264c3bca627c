"""Prompt-tail restores on vLLM 0.32's real Scheduler: an attention-only layout resumes inside a block.

With one full-attention group vLLM hashes (and hits) per block, so its own restore of an 840-token prompt
with 128-token blocks ends at 768. umbp stores the prompt's partly filled last block under its own key and
restores 832 (the last whole ``tail_unit`` of 16): every restored token is checked byte for byte on every
rank, and the resumed request's first computed token is the one after the restore.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # redis_servers
from sched_harness import GroupDef, build  # noqa: E402
from test_connector_scheduler import PROMPT, compute_then_drop, restore  # noqa: E402

from redis_servers import require_redis, start_server  # noqa: E402

LLAMA_128 = [GroupDef("fa", 128)]
NO_LEAKS = {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}


def test_attention_only_restores_to_the_last_whole_tail_unit(tmp_path):
    h = build(tmp_path, LLAMA_128, unit=128)
    assert compute_then_drop(h, "A", PROMPT) == 768  # vLLM's own (block-aligned) local hit
    assert h.umbp.totals["stored_objects"] == 7  # six full blocks and the tail page
    hit, mism = restore(h, "B", PROMPT)
    assert (hit, mism) == (832, [])
    assert h.umbp.totals["restored_tokens"] == 832
    assert h.leaks() == NO_LEAKS


def test_tail_unit_zero_keeps_the_block_aligned_restore(tmp_path):
    h = build(tmp_path, LLAMA_128, unit=128, extra={"dram_bytes": 64 << 20, "tail_unit": 0})
    compute_then_drop(h, "A", PROMPT)
    assert h.umbp.totals["stored_objects"] == 6
    assert restore(h, "B", PROMPT) == (768, [])


def test_a_longer_turn_resumes_in_the_tail_and_a_different_tail_misses(tmp_path):
    h = build(tmp_path, LLAMA_128, unit=128)
    compute_then_drop(h, "A", PROMPT)
    longer = PROMPT + [11 + i % 300 for i in range(100)]
    assert restore(h, "B", longer) == (832, [])
    # same first 800 tokens, different tokens in [800, 832): the tail key differs, the full blocks match
    assert h.sched.reset_prefix_cache()
    other = PROMPT[:800] + [499 - i for i in range(40)]
    assert restore(h, "C", other) == (768, [])
    assert h.leaks() == NO_LEAKS


def test_the_local_gpu_hit_is_extended_by_the_tail_page(tmp_path):
    """Blocks 0-5 are still held by vLLM's prefix cache: only the tail page is loaded, on top of them."""
    h = build(tmp_path, LLAMA_128, unit=128)
    h.add("A", PROMPT, max_tokens=3)
    h.run()
    assert h.local_hit(PROMPT) == 768
    hit, mism = restore(h, "B", PROMPT)
    assert (hit, mism) == (832, [])
    assert h.umbp.totals["hit_tokens"] == 64  # beyond the local 768
    assert h.umbp.totals["loaded_objects"] == 1


def test_tp2_tail_restore_is_byte_exact_on_every_rank(tmp_path):
    h = build(tmp_path, LLAMA_128, unit=128, tp=2)
    compute_then_drop(h, "A", PROMPT)
    assert restore(h, "B", PROMPT) == (832, [])
    assert h.leaks() == NO_LEAKS


def test_a_corrupt_tail_page_is_a_recompute(tmp_path):
    h = build(tmp_path, LLAMA_128, unit=128)
    compute_then_drop(h, "A", PROMPT)
    h.fail_next_load = True  # the first page of the load is corrupted in the arena
    hit, _ = restore(h, "B", PROMPT)
    assert hit == 0 and h.umbp.totals["load_failures"] == 1
    assert h.leaks() == NO_LEAKS


def test_dcp_keeps_the_block_aligned_restore(tmp_path):
    """Under DCP a block is sharded over ranks; the tail path is off there (docs/hybrid.md)."""
    h = build(tmp_path, [GroupDef("fa", 64)], unit=128, tp=2, dcp=2)
    assert compute_then_drop(h, "A", PROMPT) == 768
    assert restore(h, "B", PROMPT) == (768, [])
    assert h.leaks() == NO_LEAKS


def test_a_fresh_instance_restores_the_tail_from_ssd_and_from_the_shared_tier(tmp_path):
    """The tail key travels like any other: written through to the SSD tier and to Redis by the workers,
    found again by a fresh instance (empty DRAM) through each tier."""
    require_redis()
    srv = start_server(tmp_path / "redis")
    try:
        tiers = {
            "ssd": {"ssd_dirs": [str(tmp_path / "ssd")], "ssd_gb": 0.25},
            "remote": {"remote": {"url": srv.url, "timeout_s": 0.5}},
        }
        for name, tier in tiers.items():
            extra = {"dram_bytes": 64 << 20, **tier}
            h1 = build(tmp_path, LLAMA_128, unit=128, extra=extra)
            compute_then_drop(h1, "A", PROMPT)
            for w in h1.workers:
                w.shutdown()  # flushes the asynchronous write-through
            h2 = build(tmp_path, LLAMA_128, unit=128, extra=extra)
            assert h2.umbp.index.stats()["objects"] == 0
            assert restore(h2, "B", PROMPT) == (832, []), name
            assert h2.workers[0]._worker.totals[f"{name}_loaded_bytes"] > 0, name
            assert h2.leaks() == NO_LEAKS
            for w in h2.workers:
                w.shutdown()
    finally:
        srv.stop()


def test_a_prompt_inside_the_first_block_restores_its_tail(tmp_path):
    """No full block at all: the tail page of block 0 (keyed without a parent hash) is the whole restore."""
    h = build(tmp_path, LLAMA_128, unit=128)
    assert compute_then_drop(h, "A", PROMPT[:100]) == 0
    assert restore(h, "B", PROMPT[:100]) == (96, [])
    assert restore(h, "C", PROMPT[:90] + [5] * 10) == (0, [])  # differs inside [80, 96): no key matches
    assert h.leaks() == NO_LEAKS


@pytest.mark.parametrize(
    "groups",
    [
        [GroupDef("swa", 128, window=150)],  # one sliding-window group (every layer windowed)
        [GroupDef("fa", 128), GroupDef("swa", 128, window=150)],  # vLLM's hybrid coordinator, no state
    ],
    ids=["swa", "fa+swa"],
)
def test_sliding_window_layouts_restore_into_the_tail(tmp_path, groups):
    """The window at 832 ([683, 832)) no longer covers block 4, which vLLM nulls: it is not loaded; the
    window's tokens and the tail are checked byte for byte."""
    h = build(tmp_path, groups, unit=128)
    assert compute_then_drop(h, "A", PROMPT) == 768
    assert restore(h, "B", PROMPT) == (832, [])
    assert h.leaks() == NO_LEAKS


def test_an_external_count_cut_back_to_the_block_loads_the_block_aligned_hit(tmp_path):
    """vLLM cuts an external hit back to a block boundary for bounded-replay sliding windows; when it
    allocates for 768 of the 832 offered, umbp loads the block-aligned hit instead of failing the load."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    h = build(tmp_path, LLAMA_128, unit=128)
    compute_then_drop(h, "A", PROMPT)
    req = Request(
        request_id="B",
        prompt_token_ids=list(PROMPT),
        pooling_params=None,
        block_hasher=h.hasher,
        sampling_params=SamplingParams(max_tokens=1),
    )
    assert h.umbp.lookup(req, 0) == (832, True)
    h.umbp.on_alloc(req, [list(range(1, 8))], 768)
    load = h.umbp.loads.pop("B")
    assert not load.job.poisoned and load.tokens == 768
    assert sorted(m.block_id for m in load.job.moves[0]) == [1, 2, 3, 4, 5, 6]
    h.umbp.index.unpin(load.keys)


def test_speculative_decoding_keeps_the_block_aligned_restore(tmp_path):
    """With a drafter the tail path is off (its KV at e - 1 depends on tokens past a tail key's prefix)."""
    h = build(tmp_path, LLAMA_128, unit=128, eagle=True)
    compute_then_drop(h, "A", PROMPT)
    assert h.umbp.totals["stored_objects"] == 6
    hit, mism = restore(h, "B", PROMPT)
    assert hit % 128 == 0 and mism == []
