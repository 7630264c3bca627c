"""Prompt-tail restores on attention-only layouts (umbp.hybrid.tail and the planner's PROMPT_TAIL plan).

The round trips feed what the planner stores back to the lookup: block-aligned :func:`longest_hit`, then
:func:`extend_hit` with the planned tail ends as the pages present.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.hybrid.groups import FullAttention, RecurrentState, SlidingWindow
from umbp.hybrid.lookup import longest_hit
from umbp.hybrid.planner import PROMPT_TAIL, RequestStorePlanner, StorePlan
from umbp.hybrid.tail import extend_hit, tail_page_end, tail_probe_ends, tail_span

LLAMA = [FullAttention(block_size=128)]


def run_prompt(
    planner: RequestStorePlanner, prompt: int, chunk: int = 512, unit: int = 128
) -> list[StorePlan]:
    """Chunked prefill of ``prompt`` tokens on one attention group (block ids 1, 2, ...), then finish."""
    plans: list[StorePlan] = []
    computed = 0
    while computed < prompt:
        computed = min(prompt, computed + chunk)
        table = ([*range(1, -(-computed // 128) + 1)],)
        hashed = prompt // unit * unit
        if not planner.idle(computed, hashed):
            plans += planner.step(computed_tokens=computed, hashed_tokens=hashed, block_ids=table)
    table = ([*range(1, -(-prompt // 128) + 1)],)
    plans += planner.step(
        computed_tokens=prompt, hashed_tokens=prompt // unit * unit, block_ids=table, finished=True
    )
    return plans


def restore(groups, plans: list[StorePlan], max_tokens: int, tail_unit: int = 16, local: int = 0):
    present = [{p.key_end for p in plans if p.group == g} for g in range(len(groups))]
    unit = groups[0].block_size
    full = [{e for e in ends if e % unit == 0} for ends in present]
    hit = longest_hit(groups, unit, full, max_tokens)
    span = tail_span(groups, tail_unit)
    if span is None:
        return hit
    base = max(hit.tokens, local)
    return extend_hit(
        groups, hit, base, tail_unit, max_tokens, max_tokens + 1, lambda e: all(e in ends for ends in present)
    )


def test_planner_stores_the_prompt_tail_page_of_an_attention_only_model():
    planner = RequestStorePlanner(LLAMA, unit=128, tail_unit=16, prompt_tokens=840, store_limit=840)
    plans = run_prompt(planner, 840)
    assert StorePlan(0, 7, 832, (768, 832), PROMPT_TAIL) in plans
    assert sorted(p.key_end for p in plans) == [128, 256, 384, 512, 640, 768, 832]
    assert planner.counters[PROMPT_TAIL] == 1


def test_lookup_returns_the_unit_aligned_end_inside_the_block():
    planner = RequestStorePlanner(LLAMA, unit=128, tail_unit=16, prompt_tokens=840, store_limit=840)
    hit = restore(LLAMA, run_prompt(planner, 840), max_tokens=839)
    assert hit.tokens == 832  # was 768: the block-aligned hit
    assert hit.loads == ((128, 256, 384, 512, 640, 768, 832),)


def test_without_tail_unit_the_old_block_aligned_restore_stays():
    planner = RequestStorePlanner(LLAMA, unit=128, prompt_tokens=840, store_limit=840)
    plans = run_prompt(planner, 840)
    assert max(p.key_end for p in plans) == 768
    assert restore(LLAMA, plans, 839, tail_unit=0).tokens == 768


def test_a_longer_prompt_resumes_in_the_tail_and_a_full_block_serves_a_repeat():
    planner = RequestStorePlanner(LLAMA, unit=128, tail_unit=16, prompt_tokens=840, store_limit=840)
    plans = run_prompt(planner, 840)
    # a second turn extends the prompt: the tail page at 832 still matches its first 832 tokens
    assert restore(LLAMA, plans, max_tokens=1999).tokens == 832
    # a prompt of exactly 7 blocks: no tail page is stored, but the last full block serves 895 of 896
    full = run_prompt(
        RequestStorePlanner(LLAMA, unit=128, tail_unit=16, prompt_tokens=896, store_limit=896), 896
    )
    assert not [p for p in full if p.reason == PROMPT_TAIL]
    hit = restore(LLAMA, full, max_tokens=895)
    assert (hit.tokens, hit.loads[0][-1]) == (895, 896)


def test_the_local_gpu_hit_is_the_base_of_the_tail():
    planner = RequestStorePlanner(LLAMA, unit=128, tail_unit=16, prompt_tokens=840, store_limit=840)
    only_tail = [p for p in run_prompt(planner, 840) if p.reason == PROMPT_TAIL]
    assert restore(LLAMA, only_tail, 839, local=0).tokens == 0  # blocks 0-5 missing: no tail
    assert restore(LLAMA, only_tail, 839, local=768).tokens == 832  # held on the GPU: the tail extends it


@pytest.mark.parametrize(
    "groups, dcp, eagle",
    [
        ([FullAttention(128), RecurrentState(128)], 1, ()),  # hybrid: boundary rule
        ([FullAttention(128), FullAttention(64, tag="x")], 1, ()),  # unequal spans
        (LLAMA, 2, ()),  # DCP: sharded blocks keep the old behaviour
        (LLAMA, 1, (0,)),  # EAGLE: its drop is not modelled here
        ([FullAttention(16)], 1, ()),  # the unit does not split the block
    ],
)
def test_layouts_outside_the_tail_rule_keep_the_old_behaviour(groups, dcp, eagle):
    assert tail_span(groups, 16, dcp, eagle) is None
    planner = RequestStorePlanner(
        groups, unit=16, tail_unit=16, prompt_tokens=840, dcp_world_size=dcp, eagle_groups=frozenset(eagle)
    )
    table = tuple([*range(1, 60)] for _ in groups)
    plans = planner.step(computed_tokens=840, hashed_tokens=832, block_ids=table, finished=True)
    assert not [p for p in plans if p.reason == PROMPT_TAIL]


def test_two_attention_groups_of_one_span_both_store_and_both_must_hold_the_page():
    groups = [FullAttention(128), FullAttention(128, tag="draft")]
    assert tail_span(groups, 16) == 128
    planner = RequestStorePlanner(groups, unit=128, tail_unit=16, prompt_tokens=840, store_limit=840)
    table = ([*range(1, 8)], [*range(11, 18)])
    plans = planner.step(computed_tokens=840, hashed_tokens=768, block_ids=table, finished=True)
    assert {(p.group, p.block_id) for p in plans if p.reason == PROMPT_TAIL} == {(0, 7), (1, 17)}
    assert restore(groups, plans, 839).tokens == 832
    assert (
        restore(groups, [p for p in plans if not (p.group == 1 and p.reason == PROMPT_TAIL)], 839).tokens
        == 768
    )


def test_a_sliding_window_stores_its_tail_and_loads_only_its_window_at_the_new_point():
    groups = [FullAttention(128), SlidingWindow(128, window=150)]
    assert tail_span(groups, 16) == 128
    planner = RequestStorePlanner(groups, unit=128, tail_unit=16, prompt_tokens=840, store_limit=840)
    table = ([*range(1, 8)], [0, 0, 0, 0, 5, 6, 7])  # vLLM nulls the window's blocks below it
    plans = planner.step(computed_tokens=840, hashed_tokens=768, block_ids=table, finished=True)
    assert {(p.group, p.block_id, p.key_end) for p in plans if p.reason == PROMPT_TAIL} == {
        (0, 7, 832),
        (1, 7, 832),
    }
    hit = restore(groups, plans, 839)
    assert hit.tokens == 832
    # at 768 the window [619, 768) needs blocks 4 and 5; at 832 it is [683, 832): block 4 is null in vLLM
    assert hit.loads[1] == (768, 832)
    assert hit.loads[0] == (128, 256, 384, 512, 640, 768, 832)


def test_the_tail_waits_for_its_tokens_and_a_failed_save_is_planned_again():
    planner = RequestStorePlanner(LLAMA, unit=128, tail_unit=16, prompt_tokens=840, store_limit=840)
    table = ([*range(1, 8)],)
    first = planner.step(computed_tokens=800, hashed_tokens=768, block_ids=table)
    assert not [p for p in first if p.reason == PROMPT_TAIL]
    assert not planner.idle(840, 768)  # no new full block, but the tail page is due
    tail = planner.step(computed_tokens=840, hashed_tokens=768, block_ids=table)
    assert [p.key_end for p in tail] == [832]
    assert planner.idle(841, 768)
    planner.mark_failed(tail)
    assert not planner.idle(841, 768)
    assert planner.step(computed_tokens=841, hashed_tokens=768, block_ids=table) == tail


def test_probe_ends_stay_inside_the_block_and_the_known_tokens():
    assert tail_probe_ends(768, 128, 16, 839, 840) == [832, 816, 800, 784]
    assert tail_probe_ends(768, 128, 16, 1999, 2000) == [896, 880, 864, 848, 832, 816, 800, 784]
    assert tail_probe_ends(768, 128, 16, 767, 768) == []
    assert tail_probe_ends(700, 128, 16, 839, 840) == []  # not a block boundary
    assert tail_page_end(840, 128, 16) == 832 and tail_page_end(896, 128, 16) is None
    assert tail_page_end(10, 128, 16) is None


@settings(max_examples=150, deadline=None)
@given(prompt=st.integers(1, 2000), second=st.integers(1, 2000), tail_unit=st.sampled_from([8, 16, 32, 64]))
def test_a_tail_restore_never_passes_the_tokens_the_stored_page_holds(prompt, second, tail_unit):
    """A second prompt shares ``min(prompt, second)`` tokens with the first (pages keyed by prefix: a key
    the second prompt computes matches only if the tokens below it are shared). The restore may reach no
    further than that shared part, its own ``max_tokens``, and the first prompt's stored pages."""
    planner = RequestStorePlanner(
        LLAMA, unit=128, tail_unit=tail_unit, prompt_tokens=prompt, store_limit=prompt
    )
    shared = min(prompt, second)
    plans = [p for p in run_prompt(planner, prompt) if p.key_end <= shared]
    hit = restore(LLAMA, plans, second - 1, tail_unit)
    assert hit.tokens <= min(second - 1, shared)
    stored_end = max((p.key_end for p in plans), default=0)
    assert hit.tokens <= stored_end
    if hit.tokens:
        assert max(hit.loads[0]) >= hit.tokens  # the page loaded covers every restored token
    # the old rule's hit is never lowered
    assert hit.tokens >= min(shared, second - 1, prompt) // 128 * 128 or hit.tokens == stored_end
