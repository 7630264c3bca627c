"""umbp.hybrid under decode/prefill context parallelism: per-rank block sizes, DCP spans, refusals.

vLLM 0.32 keeps block sizes per rank in its specs; a DCP-sharded attention block covers
``block_size * dcp`` tokens (each rank holds its interleaved shard) while recurrent state is not sharded.
The differential test in tests/vllm proves the lookup against vLLM's coordinator; these pin the
deployment's numbers and the planner's keys without vLLM.
"""

from __future__ import annotations

import pytest

from umbp.hybrid import (
    FullAttention,
    RecurrentState,
    SlidingWindow,
    explain,
    hit_alignment,
    longest_hit,
    partial_hits_enabled,
    resolve_groups,
)
from umbp.hybrid.planner import RequestStorePlanner

KIMI = [FullAttention(128), RecurrentState(128)]  # MLA 128 tokens per rank, KDA 128; u = 128
FA, STATE = 0, 1


def test_spans_scale_only_sharded_attention():
    groups = [FullAttention(128), FullAttention(64, dcp_sharded=False), RecurrentState(128)]
    assert [g.block_size for g in resolve_groups(groups, 8)] == [1024, 64, 128]
    assert resolve_groups(groups, 1) == tuple(groups)
    assert hit_alignment([FullAttention(128), SlidingWindow(64, 100, dcp_sharded=False)], 64, 8) == 1024


def test_partial_hits_rule_is_ge_under_dcp():
    assert partial_hits_enabled(KIMI, 128, dcp_world_size=8)
    assert not partial_hits_enabled(KIMI, 128)  # TP only: Mamba's block must exceed the unit
    assert not partial_hits_enabled([FullAttention(128), RecurrentState(64)], 128, dcp_world_size=8)
    assert hit_alignment(KIMI, 128, 8) == 128 and hit_alignment(KIMI, 128) == 128


def test_kimi_tail_inside_a_1024_token_block():
    b = 5 * 1024 + 640
    present = [{1024, 2048, 3072, 4096, 5120, b}, {b}]
    hit = longest_hit(KIMI, 128, present, b + 99, dcp_world_size=8)
    assert hit.tokens == b
    assert hit.loads == ((1024, 2048, 3072, 4096, 5120, b), (b,))
    # the page ending at b goes into block (b - 1) // 1024 = 5 of vLLM's table, the sixth 1024-token block
    assert (b - 1) // resolve_groups(KIMI, 8)[FA].block_size == 5


def test_refusals_name_the_group():
    with pytest.raises(ValueError, match="sharded sliding window"):
        longest_hit([FullAttention(16), SlidingWindow(16, 32)], 16, [set(), set()], 100, dcp_world_size=2)
    with pytest.raises(ValueError, match="PCP"):
        longest_hit(KIMI, 128, [set(), set()], 1000, pcp_world_size=2)
    with pytest.raises(ValueError, match="DCP span"):
        longest_hit([FullAttention(16)], 16, [set()], 100, dcp_world_size=4)  # one group: unit = 64
    assert longest_hit([FullAttention(16)], 64, [{64, 128}], 150, dcp_world_size=4).tokens == 128
    # PCP changes no boundary in vLLM 0.32: a full-attention-only layout looks up as without it
    fa = [FullAttention(32), FullAttention(64, tag="1")]
    present = [{32, 64, 96}, {64, 128}]
    assert longest_hit(fa, 32, present, 127, pcp_world_size=2) == longest_hit(fa, 32, present, 127)


def test_explain_speaks_of_spans():
    text = explain(KIMI, 128, [{1024}, {1152}], 2000, dcp_world_size=8)
    assert "DCP 8" in text and "full_attention, B=1024" in text and "partial page of block 1" in text


@pytest.mark.parametrize("eagle", [False, True])
def test_planner_keys_the_boundary_page_where_the_dcp_lookup_probes(eagle):
    """Kimi-like prompt of 3,000 tokens: blocks of 1,024 tokens over DCP 8, unit 128. The tail state is
    handed off at b (EAGLE: one unit lower); the planner stores block b // 1024 keyed at b (EAGLE: b + u)
    and the lookup over exactly the planned keys lands on b."""
    prompt = 3000
    b = (prompt // 128 * 128 - 128) if eagle else (prompt - 1) // 128 * 128
    planner = RequestStorePlanner(
        KIMI, 128, eagle_groups=frozenset({FA}) if eagle else frozenset(), dcp_world_size=8
    )
    hashed = prompt // 128 * 128
    tables = ([11, 12, 13], [0, 0, 0] + [0] * 20 + [21])
    plans = planner.step(computed_tokens=2048, hashed_tokens=hashed, block_ids=tables)
    plans += planner.step(
        computed_tokens=prompt, hashed_tokens=hashed, block_ids=tables, offloads=[(STATE, 21, b)]
    )
    page = b + (128 if eagle else 0)
    keyed = {(p.group, p.key_end, p.block_id) for p in plans}
    assert keyed == {(FA, 1024, 11), (FA, 2048, 12), (FA, page, 13), (STATE, b, 21)}
    present = [{e for g, e, _ in keyed if g == FA}, {b}]
    hit = longest_hit(
        KIMI,
        128,
        present,
        prompt - 1,
        eagle=eagle,
        eagle_groups={FA} if eagle else None,
        hashed_tokens=hashed,
        dcp_world_size=8,
    )
    assert hit.tokens == b
