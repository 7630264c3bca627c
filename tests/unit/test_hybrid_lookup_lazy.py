"""longest_hit asked through lazy containers (membership only, never enumerated) answers exactly as with
sets: the scheduler side's lookups of long prompts rely on it (umbp.vllm.scheduler_lookup)."""

from __future__ import annotations

import random

import pytest

from umbp.hybrid import FullAttention, RecurrentState, SlidingWindow, longest_hit


class Probe:
    """A container with `in` only; records every boundary asked."""

    def __init__(self, ends: set[int]) -> None:
        self.ends, self.asked = ends, []

    def __contains__(self, end: object) -> bool:
        self.asked.append(end)
        return end in self.ends


LAYOUTS = [
    ([FullAttention(64), RecurrentState(64)], 16),
    ([FullAttention(400), RecurrentState(400)], 16),
    ([FullAttention(64), SlidingWindow(64, window=128), RecurrentState(64)], 64),
    ([FullAttention(64), FullAttention(64), RecurrentState(64)], 16),
]


@pytest.mark.parametrize("groups,unit", LAYOUTS)
@pytest.mark.parametrize("eagle", [False, True])
def test_lazy_containers_give_the_same_hit_as_sets(groups, unit, eagle):
    rng = random.Random(7)
    for _ in range(300):
        prompt = rng.randrange(1, 3000)
        ends = range(unit, prompt // unit * unit + 1, unit)
        density = rng.random()
        present = [{e for e in ends if rng.random() < density} for _ in groups]
        args = {"groups": groups, "unit": unit, "max_tokens": prompt - 1, "eagle": eagle}
        expected = longest_hit(present=present, **args)
        assert longest_hit(present=[Probe(s) for s in present], **args) == expected


def test_a_cold_long_prompt_is_answered_from_its_first_block():
    groups, unit, prompt = [FullAttention(400), RecurrentState(400)], 16, 131072
    probes = [Probe(set()), Probe(set())]
    hit = longest_hit(groups, unit, probes, max_tokens=prompt - 1)
    assert hit.tokens == 0
    # the first full-attention block is missing: only the unit boundaries inside it (a partial page) can
    # still give a hit; nothing past it is asked, and the state is not asked at all
    assert sorted(probes[0].asked) == list(range(unit, 401, unit))
    assert probes[1].asked == []


def test_a_stored_long_prompt_is_answered_from_a_few_hundred_probes():
    groups, unit, prompt = [FullAttention(400), RecurrentState(400)], 16, 131072
    ends = set(range(unit, prompt + 1, unit))
    probes = [Probe(ends), Probe({e for e in ends if e % 400 == 0} | {prompt - unit})]
    hit = longest_hit(groups, unit, probes, max_tokens=prompt - 1)
    assert hit.tokens == prompt - unit
    assert sum(len(p.asked) for p in probes) < 400  # of 2 x 8,192 boundaries
