"""The UMBPConnector on vLLM 0.32's real Scheduler (CPU, no model): hits, keying, failures, TP.

Every restore is checked byte for byte: the restored request's attention pages and recurrent state must
hold exactly what a recompute would have written (see sched_harness), and the restore boundary must equal
the local prefix hit vLLM itself reaches for the same prompt.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from sched_harness import GroupDef, build  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

PROMPT = [3 + (i * 37) % 500 for i in range(840)]
FA_MAMBA_400 = [GroupDef("fa", 400), GroupDef("mamba", 400)]


def compute_then_drop(h, req_id, prompt, max_tokens=3) -> int:
    """Run `prompt` to completion, read vLLM's local hit for it, then drop the local prefix cache."""
    h.add(req_id, prompt, max_tokens=max_tokens)
    h.run()
    local = h.local_hit(prompt)
    assert h.sched.reset_prefix_cache(), "local prefix cache did not reset (blocks still held?)"
    assert h.local_hit(prompt) == 0
    return local


def restore(h, req_id, prompt):
    """Admit `prompt` with an empty local cache; return (restored boundary, byte mismatches on any rank)."""
    h.add(req_id, prompt, max_tokens=4)
    h.admit(req_id)  # lookup, then the asynchronous load on the fake workers until it is reported
    hit = h.umbp.restored.get(req_id, 0)
    mism = []  # checked before any forward touches the request
    for rank in range(len(h.workers)) if hit > 0 else ():
        mism += [f"rank {rank}: {m}" for m in h.held_values(req_id, hit, rank=rank)]
    h.run()
    return hit, mism


def test_seed_scenario_restores_832(tmp_path):
    h = build(tmp_path, FA_MAMBA_400, unit=16)
    assert compute_then_drop(h, "A", PROMPT) == 832
    assert restore(h, "B", PROMPT) == (832, [])
    assert h.leaks() == {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}


def test_boundary_page_off_is_the_old_behaviour(tmp_path):
    h = build(tmp_path, FA_MAMBA_400, unit=16, extra={"dram_bytes": 64 << 20, "boundary_page": False})
    assert compute_then_drop(h, "A", PROMPT) == 832
    hit, mism = restore(h, "B", PROMPT)
    # without the page holding [800, 832) only an older boundary can be restored (here the block-aligned
    # state at 800, which this chunking hands off too), and what is restored is still correct
    assert hit < 832 and mism == []


@pytest.mark.parametrize(
    "groups,unit,prompt_len,eagle",
    [
        ([GroupDef("fa", 64), GroupDef("mamba", 64)], 16, 150, False),
        ([GroupDef("fa", 64), GroupDef("mamba", 64)], 16, 150, True),
        ([GroupDef("fa", 64), GroupDef("mamba", 64)], 16, 170, True),
        ([GroupDef("fa", 400), GroupDef("mamba", 400)], 16, 840, True),
        ([GroupDef("fa", 128), GroupDef("mamba", 128)], 64, 700, False),
        ([GroupDef("fa", 64), GroupDef("swa", 64, window=128), GroupDef("mamba", 64)], 64, 300, False),
        ([GroupDef("fa", 64), GroupDef("swa", 16, window=32), GroupDef("mamba", 64)], 16, 150, False),
    ],
    ids=["fa64-u16", "fa64-u16-eagle", "fa64-u16-eagle-170", "seed-eagle", "u64", "swa-u64", "swa16-u16"],
)
def test_restore_reaches_the_local_hit(tmp_path, groups, unit, prompt_len, eagle):
    h = build(tmp_path, groups, unit=unit, eagle=eagle)
    prompt = PROMPT[:prompt_len] if prompt_len <= len(PROMPT) else (PROMPT * 2)[:prompt_len]
    local = compute_then_drop(h, "A", prompt)
    assert local > 0
    hit, mism = restore(h, "B", prompt)
    assert (hit, mism) == (local, [])
    assert h.leaks()["index_pinned"] == 0


def test_eagle_keys_the_attention_page_one_unit_past_the_boundary(tmp_path):
    h = build(tmp_path, FA_MAMBA_400, unit=16, eagle=True, lookahead=False)  # the drop: plain hashes
    local = compute_then_drop(h, "A", PROMPT)
    b = (840 // 16) * 16 - 16  # vLLM's EAGLE tail checkpoint position: 816
    assert local == b
    umbp = h.umbp
    req_hashes = h.add("probe", PROMPT, max_tokens=1).block_hashes
    from umbp.vllm.scheduler import logical_key

    def held(group, end):
        return umbp.index.lookup([logical_key(umbp.layout.namespace, group, req_hashes[end // 16 - 1])])[0]

    assert held(0, b + 16) and not held(0, b)  # attention page keyed at b + u
    assert held(1, b)  # the recurrent state keyed at b
    h.run()


def test_prompt_shorter_than_one_unit(tmp_path):
    h = build(tmp_path, FA_MAMBA_400, unit=16)
    assert compute_then_drop(h, "A", PROMPT[:10]) == 0
    assert restore(h, "B", PROMPT[:10]) == (0, [])


def test_tp2_hit_needs_every_rank(tmp_path):
    h = build(tmp_path, FA_MAMBA_400, unit=16, tp=2)
    compute_then_drop(h, "A", PROMPT)
    hit, mism = restore(h, "B", PROMPT)
    assert (hit, mism) == (832, [])

    h2 = build(tmp_path, FA_MAMBA_400, unit=16, tp=2)
    h2.failing_save_ranks = {1}  # rank 1 never confirms its saves: nothing may become visible
    compute_then_drop(h2, "A", PROMPT)
    assert h2.umbp.index.stats()["objects"] == 0
    assert restore(h2, "B", PROMPT) == (0, [])
    assert h2.leaks() == {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}


@pytest.mark.parametrize("tp", [1, 2])
def test_corrupt_page_is_a_recompute_not_a_wrong_token(tmp_path, tp):
    h = build(tmp_path, FA_MAMBA_400, unit=16, tp=tp)  # corrupted on the last rank only
    compute_then_drop(h, "A", PROMPT)
    h.fail_next_load = True  # flip bytes in the arena slot right before the load reads it
    held = len(h.umbp.index)
    req = h.add("B", PROMPT, max_tokens=4)
    h.admit("B")
    assert h.umbp.restored.get("B", 0) == 0
    assert req.status != RequestStatus.FINISHED_ERROR
    # the worker named the one corrupt object: only it is dropped and quarantined, the rest stay offered
    assert len(h.umbp.quarantine) == 1 and len(h.umbp.index) == held - 1
    h.run()
    assert h.umbp.totals["load_failures"] == 1
    # B recomputed and stored the prompt again, so C restores correct bytes
    assert h.sched.reset_prefix_cache()
    assert restore(h, "C", PROMPT) == (832, [])


def test_abort_while_loading_leaks_nothing(tmp_path):
    h = build(tmp_path, FA_MAMBA_400, unit=16)
    compute_then_drop(h, "A", PROMPT)
    h.add("B", PROMPT, max_tokens=4)
    so = h.sched.schedule()  # B admitted, its load dispatched
    assert h.umbp.loads
    h.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    h.sched.update_from_output(so, h.execute(so))
    h.run()
    assert h.leaks() == {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}
    # the load completes after the abort: nothing is kept for B, and its tokens count as restored nowhere
    assert "B" not in h.umbp.restored and h.umbp.totals["restored_tokens"] == 0
    assert restore(h, "C", PROMPT) == (832, [])


def test_preemption_under_block_pressure(tmp_path):
    # 12 blocks of 64 tokens: two 300-token prompts cannot both stay resident
    h = build(
        tmp_path,
        [GroupDef("fa", 64), GroupDef("mamba", 64)],
        unit=16,
        num_blocks=12,
        max_num_batched_tokens=256,
    )
    p1, p2 = PROMPT[:300], PROMPT[300:600]
    h.add("A", p1, max_tokens=40)
    h.add("B", p2, max_tokens=40)
    h.run(max_steps=500)
    assert h.sched.reset_prefix_cache()
    assert h.leaks()["gpu_blocks_held"] == 0
    for req_id, prompt in (("C", p1), ("D", p2)):
        hit, mism = restore(h, req_id, prompt)
        assert hit > 0 and mism == []


@pytest.mark.parametrize("decode_saves", [False, True])
def test_multi_turn_extension_restores_what_a_local_hit_would(tmp_path, decode_saves):
    # agentic turn 2 = turn 1's prompt + its reply + a tool output
    h = build(
        tmp_path,
        [GroupDef("fa", 64), GroupDef("mamba", 64)],
        unit=16,
        extra={"dram_bytes": 64 << 20, "decode_saves": decode_saves},
        retention=None,
    )
    turn1 = PROMPT[:300]
    req = h.add("A", turn1, max_tokens=40)
    h.run()
    turn2 = turn1 + list(req.output_token_ids) + PROMPT[300:400]
    local = h.local_hit(turn2)
    assert h.sched.reset_prefix_cache()
    hit, mism = restore(h, "B", turn2)
    assert mism == []
    if decode_saves:
        assert hit == local
    else:
        assert 0 < hit <= local


def test_block_zero_is_vllms_null_block(tmp_path):
    """The worker warms its transfer kernels up by copying block 0 out and back (TransferEngine.warm_up,
    before any forward), which relies on vLLM keeping block 0 as its null block: a placeholder in block
    tables (skipped Mamba and out-of-window positions), never handed out to hold a request's tokens."""
    h = build(tmp_path, FA_MAMBA_400, unit=16)
    pool = h.sched.kv_cache_manager.block_pool
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert 0 not in {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
