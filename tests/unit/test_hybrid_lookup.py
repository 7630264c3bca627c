"""umbp.hybrid lookup: the Granite example (840-token prompt, tail at 832), the per-manager boundaries of vLLM 0.32 (notes §3.3, B=64, u=16),
EAGLE, joint lookups, validation and explanations. Pure and fast; tests/vllm/test_hybrid_differential.py
checks the same function against vLLM's real coordinator."""

from __future__ import annotations

import pytest

from umbp.hybrid import (
    FullAttention,
    RecurrentState,
    SlidingWindow,
    explain,
    explain_hit,
    hit_alignment,
    longest_hit,
    partial_hits_enabled,
)

SEED = [FullAttention(block_size=400), RecurrentState(block_size=400)]


def every(unit: int, limit: int) -> set[int]:
    return set(range(unit, limit + 1, unit))


# ------------------------------------------------------------------------------------------- seed scenario


def test_seed_scenario_restores_the_tail_boundary():
    # Granite 4.0-H: 400-token blocks, unit 16, 840-token prompt; the tail state sits at 832.
    hit = longest_hit(SEED, unit=16, present=[{400, 800, 832}, {832}], max_tokens=839)
    assert hit.tokens == 832
    assert hit.loads == ((400, 800, 832), (832,))
    assert hit.alignment == 16


def test_seed_scenario_without_the_partial_page_restores_nothing():
    # What main stored: full blocks and the state, never the page holding [800, 832).
    assert longest_hit(SEED, 16, [{400, 800}, {832}], 839).tokens == 0
    # A block-aligned state at 800 would be the fallback.
    hit = longest_hit(SEED, 16, [{400, 800}, {800, 832}], 839)
    assert (hit.tokens, hit.loads) == (800, ((400, 800), (800,)))


def test_partial_page_past_the_hit_serves_a_lower_boundary():
    # Attention pages are append-only: the page saved at 832 also holds [800, 816).
    hit = longest_hit(SEED, 16, [{400, 800, 832}, {816}], 839)
    assert (hit.tokens, hit.loads) == (816, ((400, 800, 832), (816,)))


def test_seed_scenario_with_eagle_keys_the_page_one_unit_past_the_state():
    # EAGLE, prompt 848: the engine checkpoints the state at 832 and the lookup probes the page at 848.
    hit = longest_hit(SEED, 16, [{400, 800, 848}, {832}], max_tokens=847, eagle=True)
    assert (hit.tokens, hit.loads) == (832, ((400, 800, 848), (832,)))
    # Keyed at the state's boundary instead, the page is useless under EAGLE.
    assert longest_hit(SEED, 16, [{400, 800, 832}, {832}], 847, eagle=True).tokens == 0


def test_hashed_tokens_caps_the_eagle_margin():
    present = [{400, 800, 848}, {832}]
    assert longest_hit(SEED, 16, present, 847, eagle=True).tokens == 832  # default: 848 hashed tokens
    assert longest_hit(SEED, 16, present, 847, eagle=True, hashed_tokens=848).tokens == 832
    assert longest_hit(SEED, 16, present, 847, eagle=True, hashed_tokens=832).tokens == 0


def test_eagle_groups_limits_the_drop_to_flagged_groups():
    present = [{400, 800, 832}, {832}]
    assert longest_hit(SEED, 16, present, 839, eagle=True, eagle_groups={1}).tokens == 832  # state: no shift
    assert longest_hit(SEED, 16, present, 839, eagle=True, eagle_groups={0}).tokens == 0
    assert longest_hit(SEED, 16, present, 839, eagle=False, eagle_groups=set()).tokens == 832


# ------------------------------------------------------------- per-manager boundaries (notes §3.3, verified)

FA64_MAMBA64 = [FullAttention(64), RecurrentState(64)]


@pytest.mark.parametrize(
    "fa_keys, max_tokens, eagle, expected",
    [
        ({64, 128, 144}, 189, False, 144),
        ({64, 128, 144}, 189, True, 128),  # EAGLE needs the key at 160 to report 144
        ({64, 128, 144, 160}, 189, True, 144),
        ({64, 144}, 189, False, 64),  # phase 2 only probes inside block n (here block 1)
    ],
)
def test_full_attention_fine_grained(fa_keys, max_tokens, eagle, expected):
    hit = longest_hit(FA64_MAMBA64, 16, [fa_keys, every(16, 512)], max_tokens, eagle=eagle, hashed_tokens=208)
    assert hit.tokens == expected


def test_full_attention_block_granular_eagle_drops_a_block():
    groups = [FullAttention(64), RecurrentState(64)]  # unit == Mamba block: no partial hits
    assert hit_alignment(groups, 64) == 64
    hit = longest_hit(groups, 64, [{64, 128, 192}, every(64, 512)], 191, eagle=True)
    assert (hit.tokens, hit.loads) == (128, ((64, 128), (128,)))


@pytest.mark.parametrize(
    "states, max_tokens, eagle, expected",
    [
        ({64, 144}, 189, False, 144),
        ({64, 144}, 143, False, 64),
        ({64, 144}, 189, True, 144),
        ({80}, 189, False, 80),
    ],
)
def test_recurrent_state_fine_grained(states, max_tokens, eagle, expected):
    hit = longest_hit(FA64_MAMBA64, 16, [every(16, 512), states], max_tokens, eagle=eagle)
    assert hit.tokens == expected
    assert hit.loads[1] == ((expected,) if expected else ())


@pytest.mark.parametrize("states, expected", [({64, 144}, 64), ({64, 128}, 128)])
def test_recurrent_state_block_aligned_when_a_window_group_disables_partial_hits(states, expected):
    groups = [FullAttention(64), RecurrentState(64), SlidingWindow(64, window=128)]
    assert not partial_hits_enabled(groups, 16) and hit_alignment(groups, 16) == 64
    hit = longest_hit(groups, 16, [every(16, 512), states, every(16, 512)], 189)
    assert hit.tokens == expected


@pytest.mark.parametrize(
    "swa_keys, max_tokens, eagle, expected, swa_loads",
    [
        ({128, 192}, 255, False, 192, (128, 192)),
        ({64, 128, 192}, 191, True, 128, (64, 128)),  # needs one more block, then drops it
        ({192}, 255, False, 0, ()),
    ],
)
def test_sliding_window(swa_keys, max_tokens, eagle, expected, swa_loads):
    groups = [FullAttention(64), SlidingWindow(64, window=128)]  # window 128: two blocks
    hit = longest_hit(groups, 64, [every(64, 512), swa_keys], max_tokens, eagle=eagle)
    assert (hit.tokens, hit.loads[1]) == (expected, swa_loads)


def test_window_clipped_at_the_prompt_start():
    groups = [FullAttention(64), SlidingWindow(64, window=200)]  # needs 4 blocks, but 64 has only one before
    assert longest_hit(groups, 64, [every(64, 512), {64}], 255).tokens == 64


# ------------------------------------------------------------------------------------------ configuration


def test_partial_hits_need_a_recurrent_group_longer_than_the_unit():
    assert partial_hits_enabled([FullAttention(64), RecurrentState(64)], 16)
    assert not partial_hits_enabled([FullAttention(64), RecurrentState(16)], 16)
    assert not partial_hits_enabled([FullAttention(64), SlidingWindow(64, 128)], 16)
    assert partial_hits_enabled([FullAttention(64), RecurrentState(64), SlidingWindow(16, 128)], 16)
    assert not partial_hits_enabled([FullAttention(64), RecurrentState(64), SlidingWindow(32, 128)], 16)
    assert hit_alignment([FullAttention(48), SlidingWindow(32, 64)], 16) == 96  # lcm


def test_single_group_is_block_granular_without_eagle_margin():
    # vLLM's one-group coordinator: unit == block size; EAGLE drops a block matched within max_tokens.
    group = [FullAttention(16)]
    assert longest_hit(group, 16, [{16, 32, 48}], 50).tokens == 48
    assert longest_hit(group, 16, [{16, 32, 48}], 50, eagle=True).tokens == 32
    assert longest_hit(group, 16, [{16, 32, 48, 64}], 50, eagle=True).tokens == 32
    with pytest.raises(ValueError, match="unit must equal"):
        longest_hit([FullAttention(64)], 16, [set()], 100)


def test_identical_groups_are_looked_up_jointly():
    same = [FullAttention(64), FullAttention(64), RecurrentState(64)]
    present = [{64, 128, 144}, {64, 128, 160}, every(16, 512)]
    hit = longest_hit(same, 16, present, 189)
    assert (hit.tokens, hit.loads[:2]) == (128, ((64, 128), (64, 128)))  # both must hold each object
    present = [{64, 128, 160}, {64, 128, 144}, every(16, 512)]
    assert longest_hit(same, 16, present, 189).loads[:2] == ((64, 128), (64, 128))
    # Different specs (tag): separate lookups; the second full-attention group only up to the first's hit.
    tagged = [FullAttention(64), FullAttention(64, tag="draft"), RecurrentState(64)]
    hit = longest_hit(tagged, 16, present, 189)
    assert (hit.tokens, hit.loads[:2]) == (144, ((64, 128, 160), (64, 128, 144)))


def test_kind_strings_and_equality():
    assert [g.kind for g in (FullAttention(16), SlidingWindow(16, 64), RecurrentState(16))] == [
        "full_attention",
        "sliding_window",
        "recurrent_state",
    ]
    assert FullAttention(16) == FullAttention(16) != FullAttention(16, tag="x")
    assert FullAttention(16) != RecurrentState(16)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(unit=24), "must divide"),
        (dict(present=[{400, 801}, {832}]), "not positive multiples"),
        (dict(present=[{400}]), "entries for 2 groups"),
        (dict(hashed_tokens=800), "covering max_tokens"),
        (dict(eagle_groups={2}), "out of range"),
        (dict(max_tokens=-1), ">= 0"),
    ],
)
def test_invalid_arguments(kwargs, message):
    args = dict(groups=SEED, unit=16, present=[{400, 800, 832}, {832}], max_tokens=839) | kwargs
    with pytest.raises(ValueError, match=message):
        longest_hit(**args)


def test_nothing_present_and_zero_budget():
    assert longest_hit(SEED, 16, [set(), set()], 839).loads == ((), ())
    assert longest_hit(SEED, 16, [{400, 800, 832}, {832}], 0).tokens == 0


# ------------------------------------------------------------------------------------------- explanations


def test_explain_names_the_missing_partial_page():
    text = explain(SEED, 16, [{400, 800}, {768, 832}], 839)
    assert text.splitlines() == [
        "stopped at 768 of max 839 (unit 16, hits aligned to 16)",
        "  at 800: group 1 (recurrent_state, B=400) has no object at 800 (state); "
        "group 0 (full_attention, B=400) has 400, 800",
        "  at 832: group 0 (full_attention, B=400) has no object at 832 (partial page of block 2); "
        "group 1 (recurrent_state, B=400) has 832",
    ]


def test_explain_eagle_points_at_the_key_one_unit_past():
    why = explain_hit(SEED, 16, [{400, 800, 832}, {832}], 847, eagle=True)
    assert why.hit.tokens == 0
    at_832 = next(b for b in why.boundaries if b.tokens == 832)
    fa = next(st for st in at_832.groups if st.group == 0)
    assert not fa.ready and fa.missing[0].end == 848 and "partial page of block 2" in fa.missing[0].what
    assert "EAGLE drop on groups [0, 1]" in why.text


def test_explain_structured_form_and_limits():
    why = explain_hit(SEED, 16, [{400, 800, 832}, {832}], 839)
    assert why.hit.tokens == 832 and why.boundaries == () and why.at_hit == ()
    assert "next boundary 848 exceeds max 839" in why.text
    why = explain_hit(SEED, 16, [{400}, set()], 839)
    assert why.boundaries[0].tokens == 400  # full attention alone could resume up to 400
    assert "has no object at 400 (state)" in why.text
    many = explain_hit(
        [FullAttention(16), RecurrentState(32)], 16, [every(16, 128), {96, 160, 224, 288, 352}], 511
    )
    assert [b.tokens for b in many.boundaries] == [128, 160, 224]
    assert many.text.endswith("(2 more boundaries above 224 not shown)")


def test_explain_window_group():
    groups = [FullAttention(64), SlidingWindow(64, window=128)]
    text = explain(groups, 64, [every(64, 512), {64, 192}], 255)
    assert text.splitlines()[0].startswith("stopped at 64 ")
    assert "group 1 (sliding_window, B=64, window=128) has no object at 128 (window block 1)" in text
