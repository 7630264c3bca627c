"""RequestStorePlanner: what a request stores, and that a later lookup finds exactly it.

The round-trip tests feed every planned key back as ``present`` to :func:`umbp.hybrid.longest_hit` and
check the hit lands on the last handed-off boundary the request could truly store. Histories come from
``simulate_request``, a tiny model of vLLM 0.32's scheduler for one request (chunked prefill in align
mode, boundary-state hand-offs, SWA nulling, decode, finish/abort), after the vLLM 0.32 notes
(/work/shared/notes, §3.5 and §4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umbp.hybrid.groups import FullAttention, RecurrentState, SlidingWindow
from umbp.hybrid.lookup import longest_hit, partial_hits_enabled
from umbp.hybrid.planner import RequestStorePlanner, StorePlan, resolve_eagle_groups

FA, MAMBA = 0, 1
SEED_GROUPS = [FullAttention(block_size=400), RecurrentState(block_size=400)]


def present_of(plans: list[StorePlan], num_groups: int) -> list[set[int]]:
    present: list[set[int]] = [set() for _ in range(num_groups)]
    for plan in plans:
        present[plan.group].add(plan.key_end)
    return present


def seed_steps(planner: RequestStorePlanner, handoff: int = 832, prompt: int = 840) -> list[StorePlan]:
    """Granite-like seed: chunk [0, 800) (block stop), [800, 832) (tail stop), [832, 840) with the CoW
    hand-off of the state at 832. Retention 0: only the tail state is handed off."""
    hashed = prompt // 16 * 16
    plans = planner.step(computed_tokens=800, hashed_tokens=hashed, block_ids=([1, 2], [0, 3]))
    plans += planner.step(computed_tokens=832, hashed_tokens=hashed, block_ids=([1, 2, 4], [0, 0, 5]))
    plans += planner.step(
        computed_tokens=prompt,
        hashed_tokens=hashed,
        block_ids=([1, 2, 4], [0, 0, 5]),
        offloads=[(MAMBA, 6, handoff)],
    )
    return plans


# ---------------------------------------------------------------------------------------- the Granite example


def test_seed_boundary_page_restores_832():
    planner = RequestStorePlanner(SEED_GROUPS, unit=16)
    plans = seed_steps(planner)
    assert StorePlan(FA, 4, 832, (800, 832), "boundary_page") in plans
    assert StorePlan(MAMBA, 6, 832, (0, 832), "boundary_state") in plans
    assert {(p.group, p.key_end) for p in plans} == {(FA, 400), (FA, 800), (FA, 832), (MAMBA, 832)}
    hit = longest_hit(SEED_GROUPS, 16, present_of(plans, 2), max_tokens=839)
    assert hit.tokens == 832
    assert hit.loads == ((400, 800, 832), (832,))


def test_seed_ablation_reproduces_old_behaviour():
    planner = RequestStorePlanner(SEED_GROUPS, unit=16, boundary_page=False)
    plans = seed_steps(planner)
    assert all(p.reason != "boundary_page" for p in plans)
    assert longest_hit(SEED_GROUPS, 16, present_of(plans, 2), max_tokens=839).tokens == 0


def test_eagle_page_keyed_one_unit_past_boundary():
    # EAGLE: N=850 -> Mamba tail b = floor(850/16)*16 - 16 = 832; the FA page is keyed at 848.
    eagle = resolve_eagle_groups(2, eagle=True)
    planner = RequestStorePlanner(SEED_GROUPS, unit=16, eagle_groups=eagle)
    plans = seed_steps(planner, handoff=832, prompt=850)
    assert StorePlan(FA, 4, 848, (800, 848), "boundary_page") in plans
    assert not any(p.group == FA and p.key_end == 832 for p in plans)
    hit = longest_hit(SEED_GROUPS, 16, present_of(plans, 2), max_tokens=849, eagle=True)
    assert hit.tokens == 832
    # Keyed at b instead (the bug the PR fixes), the EAGLE lookup cannot reach 832.
    wrong = [{400, 800, 832}, {832}]
    assert longest_hit(SEED_GROUPS, 16, wrong, max_tokens=849, eagle=True).tokens == 0


def test_eagle_page_waits_for_its_tokens():
    # Hand-off at 832 with an 840-token prompt: [832, 848) is not computed yet, so the page is pending
    # until decode computes it and its hash exists.
    planner = RequestStorePlanner(SEED_GROUPS, unit=16, eagle_groups=frozenset({FA, MAMBA}))
    plans = seed_steps(planner, handoff=832, prompt=840)
    assert planner.pending_pages == {(FA, 848)}
    assert not any(p.reason == "boundary_page" for p in plans)
    for computed in range(841, 849):  # decode: num_tokens = computed + 1 when scheduled
        hashed = (computed + 1) // 16 * 16
        plans += planner.step(
            computed_tokens=computed, hashed_tokens=hashed, block_ids=([1, 2, 4], [0, 0, 7])
        )
    assert plans[-1] == StorePlan(FA, 4, 848, (800, 848), "boundary_page")
    assert planner.pending_pages == frozenset()
    hit = longest_hit(SEED_GROUPS, 16, present_of(plans, 2), max_tokens=849, eagle=True)
    assert hit.tokens == 832


@pytest.mark.parametrize("eagle", [False, True])
def test_finished_path_keys_like_the_step_path(eagle: bool):
    """register_finished_partial_tail: the tail state comes with finish; its page is keyed the same way."""
    prompt = 850 if eagle else 840
    computed = 850 if eagle else 832  # EAGLE's page needs [832, 848) computed
    planner = RequestStorePlanner(SEED_GROUPS, 16, eagle_groups=resolve_eagle_groups(2, eagle))
    plans = planner.step(computed_tokens=800, hashed_tokens=prompt // 16 * 16, block_ids=([1, 2], [0, 3]))
    plans += planner.step(
        computed_tokens=computed,
        hashed_tokens=prompt // 16 * 16,
        block_ids=([1, 2, 4], [0, 0, 5]),
        offloads=[(MAMBA, 5, 832)],
        finished=True,
    )
    end = 848 if eagle else 832
    assert StorePlan(FA, 4, end, (800, end), "finished_tail") in plans
    assert StorePlan(MAMBA, 5, 832, (0, 832), "boundary_state") in plans
    hit = longest_hit(SEED_GROUPS, 16, present_of(plans, 2), max_tokens=prompt - 1, eagle=eagle)
    assert hit.tokens == 832
    assert planner.step(computed_tokens=900, hashed_tokens=896, block_ids=([1, 2, 4], [0, 0, 5])) == []


def test_eagle_finish_at_boundary_stores_no_half_valid_page():
    """Aborted exactly at b under EAGLE: [b, b+u) was never computed, so no page may claim h(b+u)."""
    planner = RequestStorePlanner(SEED_GROUPS, 16, eagle_groups=frozenset({FA, MAMBA}))
    plans = planner.step(
        computed_tokens=832,
        hashed_tokens=848,
        block_ids=([1, 2, 4], [0, 0, 5]),
        offloads=[(MAMBA, 5, 832)],
        finished=True,
    )
    assert [(p.group, p.key_end) for p in plans] == [(FA, 400), (FA, 800), (MAMBA, 832)]


def test_finished_plans_pending_pages_whose_tokens_are_computed():
    planner = RequestStorePlanner(SEED_GROUPS, 16, eagle_groups=frozenset({FA, MAMBA}))
    seed_steps(planner, handoff=832, prompt=840)  # page at 848 pending
    plans = planner.step(
        computed_tokens=849, hashed_tokens=848, block_ids=([1, 2, 4], [0, 0, 7]), finished=True
    )
    assert plans == [StorePlan(FA, 4, 848, (800, 848), "finished_tail")]


# ---------------------------------------------------------------------------------------- rules


def test_block_aligned_boundary_adds_nothing_extra():
    groups = [FullAttention(64), RecurrentState(64)]
    planner = RequestStorePlanner(groups, 16)
    plans = planner.step(
        computed_tokens=128, hashed_tokens=144, block_ids=([1, 2], [0, 3]), offloads=[(1, 3, 128)]
    )
    assert [p.reason for p in plans] == ["full_block", "full_block", "boundary_state"]
    # EAGLE with b = 112: the page would end at 128, which is full block 1.
    planner = RequestStorePlanner(groups, 16, eagle_groups=frozenset({0, 1}))
    plans = planner.step(
        computed_tokens=128, hashed_tokens=144, block_ids=([1, 2], [0, 3]), offloads=[(1, 9, 112)]
    )
    assert [(p.key_end, p.reason) for p in plans] == [
        (64, "full_block"),
        (128, "full_block"),
        (112, "boundary_state"),
    ]
    assert planner.pending_pages == frozenset()


def test_recurrent_state_only_from_handoffs():
    groups = [FullAttention(64), RecurrentState(64)]
    planner = RequestStorePlanner(groups, 16)
    plans = planner.step(computed_tokens=256, hashed_tokens=256, block_ids=([1, 2, 3, 4], [5, 6, 7, 8]))
    assert all(p.group == 0 for p in plans)


def test_null_blocks_and_sliding_window():
    groups = [SlidingWindow(64, window=64), FullAttention(64), RecurrentState(64)]
    planner = RequestStorePlanner(groups, 64)
    first = planner.step(computed_tokens=128, hashed_tokens=128, block_ids=([1, 2], [3, 4], [0, 5]))
    assert {(p.group, p.key_end) for p in first} == {(0, 64), (0, 128), (1, 64), (1, 128)}
    # Block 0 of the SWA group fell out of the window (null); block 2 is complete but null already.
    later = planner.step(
        computed_tokens=256, hashed_tokens=256, block_ids=([0, 0, 0, 9], [3, 4, 6, 7], [0, 0, 0, 8])
    )
    assert {(p.group, p.block_id, p.key_end) for p in later} == {(0, 9, 256), (1, 6, 192), (1, 7, 256)}
    assert all(p.block_id != 0 for p in first + later)


def test_keys_never_end_past_hashed_or_store_limit():
    groups = [FullAttention(64), RecurrentState(64)]
    planner = RequestStorePlanner(groups, 16, store_limit=150)
    plans = planner.step(
        computed_tokens=200, hashed_tokens=128, block_ids=([1, 2, 3, 4], [0, 0, 0, 5]), offloads=[(1, 5, 144)]
    )
    assert [p.key_end for p in plans] == [64, 128]  # 144 > hashed: the state cannot be keyed
    assert planner.counters["dropped_states"] == 1
    plans = planner.step(
        computed_tokens=260,
        hashed_tokens=256,
        block_ids=([1, 2, 3, 4, 6], [0, 0, 0, 0, 7]),
        offloads=[(1, 7, 256)],
    )
    assert plans == []  # 192 and 256 exceed store_limit=150


def test_never_planned_twice_and_reoffers_deduped():
    groups = [FullAttention(64), RecurrentState(64)]
    planner = RequestStorePlanner(groups, 16)
    tables = ([1, 2, 3], [0, 0, 4])
    first = planner.step(computed_tokens=144, hashed_tokens=144, block_ids=tables, offloads=[(1, 4, 144)])
    again = planner.step(computed_tokens=150, hashed_tokens=144, block_ids=tables, offloads=[(1, 8, 144)])
    assert {(p.key_end, p.reason) for p in first} == {
        (64, "full_block"),
        (128, "full_block"),
        (144, "boundary_state"),
        (144, "boundary_page"),
    }
    assert again == []


def test_page_dropped_when_block_no_longer_owned():
    planner = RequestStorePlanner(SEED_GROUPS, 16, eagle_groups=frozenset({FA, MAMBA}))
    seed_steps(planner, handoff=832, prompt=840)  # page at 848 pending in block 2
    plans = planner.step(computed_tokens=849, hashed_tokens=848, block_ids=([1, 2, 0], [0, 0, 7]))
    assert plans == [] and planner.pending_pages == frozenset()
    assert planner.counters["dropped_pages"] == 1


def test_eagle_without_partial_hits_needs_no_page():
    # SWA with B=64 != unit disables partial hits: EAGLE's margin is a whole block, i.e. a full block.
    groups = [SlidingWindow(64, window=32), RecurrentState(64)]
    planner = RequestStorePlanner(groups, 16, eagle_groups=frozenset({0, 1}))
    plans = planner.step(
        computed_tokens=128, hashed_tokens=128, block_ids=([1, 2], [0, 3]), offloads=[(1, 3, 128)]
    )
    assert planner.pending_pages == frozenset()
    plans += planner.step(computed_tokens=192, hashed_tokens=192, block_ids=([0, 2, 4], [0, 0, 5]))
    assert [(p.group, p.key_end) for p in plans] == [(0, 64), (0, 128), (1, 128), (0, 192)]
    hit = longest_hit(groups, 16, present_of(plans, 2), max_tokens=200, eagle=True)
    assert hit.tokens == 128


def test_mark_failed_replans_while_owned():
    groups = [FullAttention(64), RecurrentState(64)]
    planner = RequestStorePlanner(groups, 16)
    tables = ([1, 2, 3], [0, 0, 4])
    plans = planner.step(computed_tokens=144, hashed_tokens=144, block_ids=tables, offloads=[(1, 4, 144)])
    planner.mark_failed(plans)
    retry = planner.step(computed_tokens=150, hashed_tokens=144, block_ids=tables)
    # Blocks and the page come back; the state's block was only valid in the step it was offered.
    assert {(p.key_end, p.reason) for p in retry} == {
        (64, "full_block"),
        (128, "full_block"),
        (144, "boundary_page"),
    }
    planner.mark_failed(retry)
    assert planner.step(computed_tokens=150, hashed_tokens=144, block_ids=([0, 0, 0], [0, 0, 0])) == []


def test_reset_after_preemption_uses_new_tables():
    groups = [SlidingWindow(16, window=16), FullAttention(64), RecurrentState(64)]
    planner = RequestStorePlanner(groups, 16)
    planner.step(computed_tokens=64, hashed_tokens=64, block_ids=([0, 0, 1, 2], [3], [4]))  # 16, 32 lost
    planner.reset()  # preempted: blocks freed; resumes from 0 with new tables
    plans = planner.step(computed_tokens=64, hashed_tokens=64, block_ids=([5, 6, 7, 8], [9], [10]))
    assert {(p.group, p.block_id, p.key_end) for p in plans} == {(0, 5, 16), (0, 6, 32)}


def test_idle_follows_every_change_of_the_planner():
    """idle() lets the connector skip a step (and vLLM's block tables); a stale answer would lose a save."""
    groups = [SlidingWindow(16, window=16), FullAttention(64), RecurrentState(64)]
    planner = RequestStorePlanner(groups, 16)
    assert not planner.idle(16, 16)  # a complete 16-token block
    planner.step(computed_tokens=64, hashed_tokens=64, block_ids=([0, 0, 1, 2], [3], [4]))  # 16, 32 lost
    assert planner.idle(64, 64) and planner.idle(79, 79) and not planner.idle(80, 80)
    planner.reset()  # preempted: the rescan may find the blocks SWA had nulled
    assert not planner.idle(64, 64)
    plans = planner.step(computed_tokens=64, hashed_tokens=64, block_ids=([5, 6, 7, 8], [9], [10]))
    assert planner.idle(64, 64)
    planner.mark_failed(plans)
    assert not planner.idle(64, 64)
    assert planner.step(computed_tokens=64, hashed_tokens=64, block_ids=([5, 6, 7, 8], [9], [10])) == plans
    planner.step(
        computed_tokens=70,
        hashed_tokens=64,
        block_ids=([5, 6, 7, 8, 11], [9, 12], [13]),
        offloads=[(2, 13, 64)],
    )
    assert planner.idle(70, 64) and not planner.idle(80, 80)  # the sliding window's block [64, 80)
    planner.step(
        computed_tokens=80, hashed_tokens=80, block_ids=([5, 6, 7, 8, 11], [9, 12], [13]), finished=True
    )
    assert planner.idle(10**6, 10**6)


def test_ignores_offloads_of_attention_groups():
    planner = RequestStorePlanner(SEED_GROUPS, 16)
    assert (
        planner.step(computed_tokens=16, hashed_tokens=16, block_ids=([1], [2]), offloads=[(FA, 1, 16)]) == []
    )
    assert planner.counters["ignored_offloads"] == 1


def test_resolve_eagle_groups():
    assert resolve_eagle_groups(3, eagle=False, flagged=[1]) == frozenset()
    assert resolve_eagle_groups(3, eagle=True) == frozenset({0, 1, 2})
    assert resolve_eagle_groups(3, eagle=True, flagged=[2]) == frozenset({2})
    with pytest.raises(ValueError):
        resolve_eagle_groups(2, eagle=True, flagged=[5])


def test_rejects_block_sizes_not_multiple_of_unit():
    with pytest.raises(ValueError):
        RequestStorePlanner([FullAttention(40), RecurrentState(64)], 16)


# ---------------------------------------------------------------------------------------- simulator


@dataclass(frozen=True)
class Step:
    """One connector call: what vLLM's scheduler-side connector sees for this request."""

    computed_tokens: int
    hashed_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    offloads: tuple[tuple[int, int, int], ...] = ()
    finished: bool = False
    preempted: bool = False  # a marker, not a step: the request's blocks were freed here


@dataclass
class History:
    steps: list[Step] = field(default_factory=list)
    handoffs: list[int] = field(default_factory=list)  # boundaries whose states were handed off
    num_tokens: int = 0  # prompt + sampled tokens at the end


class _Tables:
    """Per-group block tables of one request, allocated like vLLM's single-type managers."""

    def __init__(self, groups: list, next_id: int = 1) -> None:
        self.groups, self.next_id = groups, next_id
        self.tables: list[list[int]] = [[] for _ in groups]

    def fresh(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def allocate(self, computed: int, end: int) -> None:
        """allocate_slots for [computed, end): null SWA blocks out of the window, grow the tables."""
        for g, spec in enumerate(self.groups):
            table, size = self.tables[g], spec.block_size
            if isinstance(spec, RecurrentState):  # align mode: one running state block, nulls before it
                if -(-end // size) > len(table):
                    self.tables[g] = [0] * (-(-end // size) - 1) + [self.fresh()]
                continue
            if isinstance(spec, SlidingWindow):
                self.null_out_of_window(g, computed)
            while len(table) * size < end:
                table.append(self.fresh())

    def null_out_of_window(self, g: int, computed: int) -> None:
        spec = self.groups[g]
        skipped = max(0, computed - spec.window + 1)
        for i in range(min(skipped // spec.block_size, len(self.tables[g]))):
            self.tables[g][i] = 0

    def snapshot(self, computed: int | None = None) -> tuple[tuple[int, ...], ...]:
        """The tables; at finish attention tables are clipped to the computed blocks (vLLM)."""
        if computed is None:
            return tuple(tuple(t) for t in self.tables)
        return tuple(
            tuple(t) if isinstance(s, RecurrentState) else tuple(t[: -(-computed // s.block_size)])
            for s, t in zip(self.groups, self.tables, strict=True)
        )


def prompt_tail(prompt: int, unit: int, block: int, eagle: bool, partial: bool) -> int:
    """The prompt's last recurrent checkpoint: sub-block with partial hits, else the last block stop."""
    if partial:
        return prompt // unit * unit - unit if eagle else (prompt - 1) // unit * unit
    return (prompt - 1) // block * block - (block if eagle else 0)


class _Engine:
    """vLLM 0.32's scheduler as one request sees it (align-mode recurrent groups, retention 0 or dense).

    Prefill runs in chunks (multiples of the scheduler block L), forced to stop at the last block
    boundary and at the prompt tail. States are handed off at block-aligned chunk ends when ``dense``
    and always at the tail: in the step computing it if block-aligned or ``checkpoint_in_step`` (Mamba2
    internal checkpoint), else as a CoW copy in the next step.
    """

    def __init__(self, groups, unit, prompt, chunks, eagle, dense, checkpoint_in_step) -> None:
        self.groups, self.unit, self.prompt, self.chunks = groups, unit, prompt, chunks
        self.dense, self.in_step = dense, checkpoint_in_step
        self.block = math.lcm(*(g.block_size for g in groups))
        self.recurrent = [g for g, s in enumerate(groups) if isinstance(s, RecurrentState)]
        self.tail = prompt_tail(prompt, unit, self.block, eagle, partial_hits_enabled(groups, unit))
        self.sub_block_tail = self.tail > 0 and self.tail % self.block != 0
        stops = {prompt, self.tail, (prompt - 1) // self.block * self.block - (self.block if eagle else 0)}
        if checkpoint_in_step and self.sub_block_tail:
            stops.discard(self.tail)
        self.stops = {s for s in stops if s > 0}
        self.tables, self.hist = _Tables(groups), History(num_tokens=prompt)
        self.computed, self.cow_due, self.chunk_index = 0, False, 0

    def hashed(self) -> int:
        return self.hist.num_tokens // self.unit * self.unit

    def handoff(self, boundary: int, fresh: bool) -> list[tuple[int, int, int]]:
        self.hist.handoffs.append(boundary)
        return [
            (g, self.tables.fresh() if fresh else self.tables.tables[g][-1], boundary) for g in self.recurrent
        ]

    def prefill_step(self, target: int) -> None:
        """One chunk towards ``target`` (the prompt, or what a preempted request had computed)."""
        stops = self.stops | {target}
        end = self.computed + self.chunks[self.chunk_index % len(self.chunks)]
        end = min(end, min(s for s in stops if s > self.computed))
        if end not in stops:
            end = max(end // self.block * self.block, self.computed + 1)
        self.chunk_index += 1
        self.tables.allocate(self.computed, end)
        offloads = self.handoff(self.tail, fresh=True) if self.cow_due else []
        if end % self.block == 0 and (self.dense or end == self.tail):
            offloads += self.handoff(end, fresh=False)
        elif self.in_step and self.sub_block_tail and self.computed < self.tail <= end:
            offloads += self.handoff(self.tail, fresh=True)
        self.computed = end
        self.cow_due = end == self.tail and self.sub_block_tail and not self.in_step
        self.hist.steps.append(Step(end, self.hashed(), self.tables.snapshot(), tuple(offloads)))

    def decode_step(self) -> None:
        end = self.computed + 1
        self.tables.allocate(self.computed, end)
        offloads = self.handoff(end, fresh=False) if self.dense and end % self.block == 0 else []
        self.hist.steps.append(Step(end, self.hashed(), self.tables.snapshot(), tuple(offloads)))
        self.computed = end
        self.hist.num_tokens += 1

    def preempt(self) -> None:
        """Blocks freed, offers dropped; the request restarts from 0 with new tables."""
        self.hist.steps.append(Step(self.computed, self.hashed(), (), preempted=True))
        self.tables = _Tables(self.groups, self.tables.next_id)
        self.computed, self.cow_due = 0, False

    def finish(self, offloads: list[tuple[int, int, int]]) -> History:
        """request_finished_all_groups (after remove_skipped_blocks) or, with ``offloads``,
        register_finished_partial_tail."""
        for g, spec in enumerate(self.groups):
            if isinstance(spec, SlidingWindow):
                self.tables.null_out_of_window(g, self.computed)
        step = Step(self.computed, self.hashed(), self.tables.snapshot(self.computed), tuple(offloads), True)
        self.hist.steps.append(step)
        return self.hist


def simulate_request(
    groups: list,
    unit: int,
    prompt: int,
    chunks: list[int],
    *,
    eagle: bool = False,
    dense: bool = False,
    checkpoint_in_step: bool = False,
    abort_at_tail: bool = False,
    decode: int = 0,
    preempt_after: int | None = None,
) -> History:
    """An engine-like history of one request: prefill, ``decode`` tokens, finish. ``abort_at_tail``:
    the request stops exactly at a sub-block prompt tail, whose state then comes through the finish path.
    ``preempt_after``: preempted after that many steps, then recomputed from 0 and continued."""
    eng = _Engine(groups, unit, prompt, chunks, eagle, dense, checkpoint_in_step)
    while eng.computed < prompt:
        eng.prefill_step(prompt)
        if abort_at_tail and eng.cow_due:  # stopped at the tail with nothing in flight
            return eng.finish(eng.handoff(eng.tail, fresh=False))
        if len(eng.hist.steps) == preempt_after:
            done = eng.computed
            eng.preempt()
            while eng.computed < done:
                eng.prefill_step(done)
    eng.hist.num_tokens = prompt + 1  # the first sampled token
    for _ in range(decode):
        eng.decode_step()
        if len(eng.hist.steps) == preempt_after:
            done = eng.computed
            eng.preempt()
            while eng.computed < done:
                eng.prefill_step(done)
    return eng.finish([])


# ---------------------------------------------------------------------------------------- round trip


def _state(planner: RequestStorePlanner) -> tuple:
    return (
        set(planner._planned),
        set(planner._pending_pages),
        list(planner._next_block),
        dict(planner.counters),
    )


def replay(
    planner: RequestStorePlanner, hist: History, groups: list, unit: int, skip_idle: bool = False
) -> list[StorePlan]:
    """Feed the history to the planner; every plan must be true for the step that produced it. Where
    idle() says so, the step must plan nothing and change nothing; `skip_idle` then leaves it out, as
    the connector does."""
    plans: list[StorePlan] = []
    keys: set[tuple[int, int]] = set()
    for step in hist.steps:
        if step.preempted:
            planner.reset()
            continue
        if not step.offloads and not step.finished and planner.idle(step.computed_tokens, step.hashed_tokens):
            if skip_idle:
                continue
            before = _state(planner)
            assert (
                planner.step(
                    computed_tokens=step.computed_tokens,
                    hashed_tokens=step.hashed_tokens,
                    block_ids=step.block_ids,
                )
                == []
            )
            assert _state(planner) == before, "idle() said the step would change nothing"
            continue
        out = planner.step(
            computed_tokens=step.computed_tokens,
            hashed_tokens=step.hashed_tokens,
            block_ids=step.block_ids,
            offloads=step.offloads,
            finished=step.finished,
        )
        for p in out:
            assert (p.group, p.key_end) not in keys, f"planned twice: {p}"
            keys.add((p.group, p.key_end))
            assert p.block_id != 0 and p.key_end % unit == 0 and 0 < p.key_end <= step.hashed_tokens
            assert planner.store_limit is None or p.key_end <= planner.store_limit
            assert p.valid[1] == p.key_end
            if isinstance(groups[p.group], RecurrentState):
                assert (p.group, p.block_id, p.key_end) in step.offloads and p.valid == (0, p.key_end)
                continue
            size = groups[p.group].block_size
            k = p.valid[0] // size
            assert p.valid[0] == k * size < p.key_end <= (k + 1) * size
            assert p.key_end <= step.computed_tokens, "a page claims tokens not yet computed"
            assert step.block_ids[p.group][k] == p.block_id, "a plan names a block the request does not own"
        plans += out
    assert planner.step(computed_tokens=10**6, hashed_tokens=10**6, block_ids=hist.steps[-1].block_ids) == []
    return plans


def expected_hit(
    hist: History, groups: list, unit: int, eagle_ids: frozenset[int], store_limit: int | None
) -> int:
    """The last handed-off boundary every attention group can truly serve: the tokens its lookup probes
    (``b``, or ``b`` + EAGLE's margin) were computed and hashed while the request owned them."""
    last = hist.steps[-1]
    limit = min(last.computed_tokens, last.hashed_tokens, store_limit or 10**9)
    partial = partial_hits_enabled(groups, unit)

    dropping = {groups[g] for g in eagle_ids}  # vLLM merges equal specs; one flagged member flags all

    def probe_end(g: int, b: int) -> int:
        size = groups[g].block_size
        if groups[g] not in dropping:
            return b
        return b + (unit if partial and size > unit else size)

    attention = [g for g, s in enumerate(groups) if not isinstance(s, RecurrentState)]
    ok = [
        b for b in hist.handoffs if b < hist.num_tokens and all(probe_end(g, b) <= limit for g in attention)
    ]
    return max(ok, default=0)


def assert_loads_truly_stored(hit, plans: list[StorePlan], groups: list) -> None:
    """Every object the lookup loads was planned, and its valid tokens cover what resuming needs."""
    by_key = {(p.group, p.key_end): p for p in plans}
    for g, spec in enumerate(groups):
        ranges = [by_key[(g, end)].valid for end in hit.loads[g]]
        if isinstance(spec, RecurrentState):
            assert ranges == ([(0, hit.tokens)] if hit.tokens else [])
            continue
        start = max(0, hit.tokens - spec.window + 1) if isinstance(spec, SlidingWindow) else 0
        covered = start
        for lo, hi in sorted(ranges):
            if lo <= covered:
                covered = max(covered, hi)
        assert covered >= hit.tokens, f"group {g}: loads {ranges} do not cover [{start}, {hit.tokens})"


@st.composite
def scenarios(draw):
    unit = draw(st.sampled_from([4, 16]))
    block = unit * draw(st.integers(1, 6))
    fa_sizes = [d for d in range(unit, block + 1, unit) if block % d == 0]
    groups: list = [FullAttention(draw(st.sampled_from(fa_sizes))) for _ in range(draw(st.integers(1, 2)))]
    if draw(st.booleans()):
        groups.append(SlidingWindow(draw(st.sampled_from([unit, block])), draw(st.integers(2, 3 * block))))
    groups += [RecurrentState(block)] * draw(st.integers(1, 2))
    groups = draw(st.permutations(groups))
    eagle = draw(st.booleans())
    flagged = draw(st.sets(st.integers(0, len(groups) - 1), max_size=2)) if eagle else set()
    prompt = draw(st.integers(1, 6 * block))
    history = dict(
        chunks=draw(st.lists(st.integers(1, 3).map(lambda n: n * block), min_size=1, max_size=3)),
        eagle=eagle,
        dense=draw(st.booleans()),
        checkpoint_in_step=draw(st.booleans()),
        abort_at_tail=draw(st.booleans()),
        decode=draw(st.integers(0, 2 * block + unit)),
        preempt_after=draw(st.none() | st.integers(1, 12)),
    )
    store_limit = draw(st.sampled_from([None, prompt]))
    return groups, unit, prompt, history, flagged, store_limit


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_round_trip_reaches_last_storable_handoff(scenario):
    groups, unit, prompt, history, flagged, store_limit = scenario
    hist = simulate_request(groups, unit, prompt, **history)
    eagle_ids = resolve_eagle_groups(len(groups), history["eagle"], flagged)
    planner = RequestStorePlanner(groups, unit, eagle_groups=eagle_ids, store_limit=store_limit)
    plans = replay(planner, hist, groups, unit)
    skipping = RequestStorePlanner(groups, unit, eagle_groups=eagle_ids, store_limit=store_limit)
    assert replay(skipping, hist, groups, unit, skip_idle=True) == plans  # what the connector does

    present = present_of(plans, len(groups))
    lookup = dict(max_tokens=hist.num_tokens - 1, eagle=history["eagle"], eagle_groups=flagged or None)
    hit = longest_hit(groups, unit, present, **lookup)
    assert hit.tokens == expected_hit(hist, groups, unit, eagle_ids, store_limit)
    assert_loads_truly_stored(hit, plans, groups)

    # The ablation (no boundary pages) stores a subset and never restores more.
    old = RequestStorePlanner(
        groups, unit, eagle_groups=eagle_ids, store_limit=store_limit, boundary_page=False
    )
    old_plans = replay(old, hist, groups, unit)
    assert {(p.group, p.key_end) for p in old_plans} <= {(p.group, p.key_end) for p in plans}
    assert longest_hit(groups, unit, present_of(old_plans, len(groups)), **lookup).tokens <= hit.tokens


@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("abort", [False, True])
def test_seed_history_from_simulator(eagle: bool, abort: bool):
    """The Granite example through the simulator: N=840 (EAGLE: 850 so the tail is 832), u=16, B=400."""
    prompt = 850 if eagle else 840
    hist = simulate_request(SEED_GROUPS, 16, prompt, [400], eagle=eagle, abort_at_tail=abort, decode=4)
    assert hist.handoffs == [832]
    ids = resolve_eagle_groups(2, eagle)
    plans = replay(RequestStorePlanner(SEED_GROUPS, 16, eagle_groups=ids), hist, SEED_GROUPS, 16)
    hit = longest_hit(SEED_GROUPS, 16, present_of(plans, 2), max_tokens=hist.num_tokens - 1, eagle=eagle)
    # Aborted at 832 under EAGLE, [832, 848) was never computed: no honest page, so no hit.
    assert hit.tokens == (0 if eagle and abort else 832)
