"""The transfer engine's host planning kept per batch shape and laid out for all rounds in one pass must
equal what the per-Moves, per-round reference computes (plans.sorted_runs / plan_runs without a shape),
and a batch shape's cached constants must follow the key they were made for. CPU only."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from umbp.pool import Arena
from umbp.transfer import Moves, make_engine
from umbp.transfer import model_layouts as L
from umbp.transfer.api import slot_reach
from umbp.transfer.kernel_engine import KernelEngine
from umbp.transfer.plans import RUN_PAD, plan_rounds, plan_runs, round_bounds, slice_batch, sorted_runs
from umbp.transfer.shapes import ShapeCache, length_term


@pytest.fixture
def engine():
    groups = {0: L.attention(2, 64, 4, 2, 8), 1: L.hybrid(1, 64, 4, 2, 8, [200])[0][1]}
    groups[2] = L.hybrid(1, 64, 4, 2, 8, [96])[0][1]
    return make_engine(Arena(1 << 22, pinned=False), groups)


def cut_rounds(batch, budgets: list[int], cap: int) -> list:
    """The batch cut as the kernel engine cuts it: round_bounds on each object's cost, slice_batch per round."""
    cost = np.array(
        [slot_reach(g.object_bytes, m) + RUN_PAD for g, m, ids, _o in batch for _ in range(ids.size)]
    )
    bounds = round_bounds(cost.astype(np.int64), budgets, cap)
    return [slice_batch(batch, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _random_batch(engine, rng, load: bool) -> list[Moves]:
    """Moves of random groups (a group may appear twice), objects in runs or scattered, slots padded or
    not; loads may read one slot twice."""
    out, used = [], {g: set() for g in engine.groups}
    cursor = 0
    for _ in range(int(rng.integers(1, 6))):
        g = int(rng.choice(list(engine.groups)))
        obj = engine.object_bytes(g)
        pad = None if rng.random() < 0.5 else obj + 8 * int(rng.integers(0, 5))
        reach = obj if pad is None else pad
        n = int(rng.integers(1, 9))
        free = [b for b in range(64) if b not in used[g]]
        ids = [int(b) for b in rng.choice(free, size=min(n, len(free)), replace=False)]
        used[g].update(ids)
        offs = []
        for _ in ids:
            if load and offs and rng.random() < 0.2:
                offs.append(offs[-1])  # two objects from one slot
                continue
            cursor += 0 if rng.random() < 0.6 else 8 * int(rng.integers(1, 64))  # in runs or a gap
            offs.append(cursor)
            cursor += reach
        digests = (
            [int(x) for x in rng.integers(0, 1 << 62, len(ids))] if load and rng.random() < 0.7 else None
        )
        out.append(Moves(g, ids, offs, digests, pad))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def test_rounds_laid_out_in_one_pass_equal_the_per_round_reference(engine) -> None:
    rng = np.random.default_rng(3)
    for trial in range(300):
        batch = engine._checked(_random_batch(engine, rng, load=bool(trial % 2)), load=bool(trial % 2))
        shape, _ids, offs = engine.flat(batch)
        n = shape.nobj
        stand_in = SimpleNamespace(
            flat=engine.flat, _last_order=None, _last_layouts=None, _ring_bytes=1 << 30
        )
        stand_in._lay_out = lambda b, budgets, s=stand_in: KernelEngine._lay_out(s, b, budgets)
        count = KernelEngine._run_count(stand_in, batch)  # the kernel engine's _path count
        assert count == plan_runs(sorted_runs(batch))[1][0].size
        cuts = sorted({int(c) for c in rng.integers(1, n, int(rng.integers(0, 4)))}) if n > 1 else []
        budgets = [1 << 40]
        rounds = [batch]
        if cuts:  # cut where the random cuts fall, as round_bounds would (consecutive objects)
            cost = [slot_reach(g.object_bytes, m) + 16 for g, m, _i, _o in batch]
            per = np.repeat(cost, [ids.size for _g, _m, ids, _o in batch])
            edges = [0, *cuts, n]
            budgets = [int(per[a:b].sum()) for a, b in zip(edges[:-1], edges[1:], strict=True)]
            rounds = cut_rounds(batch, budgets, max(budgets))
        bounds = [0]
        for r in rounds:
            bounds.append(bounds[-1] + sum(ids.size for _g, _m, ids, _o in r))
        fast = plan_rounds(offs, shape.size, shape.reach, bounds)
        assert len(fast) == len(rounds)
        for (pos, runs, total), r in zip(fast, rounds, strict=True):
            want_pos, want_runs, want_total = plan_runs(sorted_runs(r))
            assert pos.tolist() == want_pos.tolist()
            assert [a.tolist() for a in runs] == [a.tolist() for a in want_runs]
            assert total == want_total
            # and the shape-given sort equals the one that expands sizes and reaches itself
            rs, _ri, ro = engine.flat(r)
            for a, b in zip(sorted_runs(r, rs, ro), sorted_runs(r), strict=True):
                assert a.tolist() == b.tolist()


def test_a_batch_shape_holds_its_keys_per_object_constants(engine) -> None:
    rng = np.random.default_rng(5)
    for _ in range(50):
        batch = engine._checked(_random_batch(engine, rng, load=True), load=True)
        shape, ids, offs = engine.flat(batch)
        counts = [i.size for _g, _m, i, _o in batch]
        assert shape.counts == tuple(counts) and shape.nobj == sum(counts)
        assert ids.tolist() == np.concatenate([i for _g, _m, i, _o in batch]).tolist()
        assert offs.tolist() == np.concatenate([o for _g, _m, _i, o in batch]).tolist()
        each = [(g, slot_reach(g.object_bytes, m)) for g, m, _i, _o in batch]
        assert shape.size.tolist() == [g.object_bytes for (g, _r), c in zip(each, counts) for _ in range(c)]
        assert shape.reach.tolist() == [r for (_g, r), c in zip(each, counts) for _ in range(c)]
        assert shape.limit.tolist() == [g.num_blocks for (g, _r), c in zip(each, counts) for _ in range(c)]
        assert shape.mix.tolist() == [
            length_term(g.object_bytes) for (g, _r), c in zip(each, counts) for _ in range(c)
        ]
        groups = [m.group for _g, m, _i, _o in batch]
        assert shape.distinct_groups == (len(set(groups)) == len(groups))
        assert shape.total_size == sum(g.object_bytes * c for (g, _r), c in zip(each, counts))
        assert shape.total_reach == sum(r * c for (_g, r), c in zip(each, counts))
        assert shape.max_reach == max(r for (_g, r), c in zip(each, counts) if c)
        assert not shape.size.flags.writeable  # shared by every call of the shape


def test_the_shape_cache_keys_on_group_count_and_reach_and_drops_the_least_recent(engine) -> None:
    cache = ShapeCache(engine.groups, engine.shapes.toff, capacity=3)
    obj = engine.object_bytes(0)
    a = cache.get(((0, 2, obj), (1, 1, engine.object_bytes(1))))
    assert cache.get(((0, 2, obj), (1, 1, engine.object_bytes(1)))) is a and cache.misses == 1
    wider = cache.get(((0, 2, obj + 64), (1, 1, engine.object_bytes(1))))  # another slot reach
    assert wider is not a and wider.reach.tolist() == [obj + 64, obj + 64, engine.object_bytes(1)]
    assert wider.uniform_reach is None and a.uniform_reach is None
    more = cache.get(((0, 3, obj),))
    assert more.uniform_reach == obj and more.seg[2].tolist() == [engine.groups[0].template.obj.size]
    cache.get(((0, 2, obj), (1, 1, engine.object_bytes(1))))  # a is now the most recent
    cache.get(((2, 1, engine.object_bytes(2)),))  # over capacity: `wider` (least recent) goes
    assert len(cache) == 3 and cache.misses == 4
    assert cache.get(((0, 2, obj), (1, 1, engine.object_bytes(1)))) is a
    assert cache.get(((0, 2, obj + 64), (1, 1, engine.object_bytes(1)))) is not wider  # made again
    assert cache.misses == 5


@pytest.mark.parametrize(
    "batch,match",
    [
        ([Moves(0, [1], [0]), Moves(1, [2, 2], [4096, 8192])], "group 1 twice"),
        ([Moves(0, [1, 2], [0, 4096]), Moves(0, [2], [8192])], "group 0 twice"),  # a group in two Moves
        ([Moves(1, [63], [0]), Moves(0, [64], [4096])], "block id"),
        ([Moves(1, [3], [0]), Moves(0, [-1], [4096])], "block id"),
        ([Moves(1, [3], [0]), Moves(0, [1], [-8])], "arena offset"),
        ([Moves(1, [3], [0]), Moves(0, [1], [12])], "arena offset"),
        ([Moves(1, [3], [0]), Moves(0, [1], [(1 << 22) - 8])], "arena offset"),
    ],
)
def test_checks_over_a_whole_batch_still_name_the_fault(engine, batch, match) -> None:
    with pytest.raises(ValueError, match=match):
        engine.load(batch)


def test_a_load_may_write_one_block_of_two_groups_and_read_one_slot_twice(engine) -> None:
    ok = [Moves(0, [1, 2], [0, 0]), Moves(1, [1], [4096]), Moves(2, [2], [4096])]
    assert engine.load(ok).result() == [[True, True], [True], [True]]


def _greedy_rounds(costs: list[int], budgets: list[int], cap: int) -> list[list[int]]:
    """Object by object: a round takes objects while they fit its budget (the last budget and any round
    past it: up to cap), and at least one."""
    rounds: list[list[int]] = [[]]
    used = 0
    for i, c in enumerate(costs):
        k = len(rounds) - 1
        room = budgets[k] if k < len(budgets) - 1 else max(cap, budgets[-1])
        if rounds[-1] and used + c > room:
            rounds.append([])
            used = 0
        rounds[-1].append(i)
        used += c
    return [r for r in rounds if r]


def test_rounds_are_cut_greedily_and_keep_every_objects_moves(engine) -> None:
    rng = np.random.default_rng(11)
    for trial in range(300):
        load = bool(trial % 2)
        batch = engine._checked(_random_batch(engine, rng, load=load), load=load)
        per = [slot_reach(g.object_bytes, m) + 16 for g, m, ids, _o in batch for _ in range(ids.size)]
        budgets = [int(x) for x in rng.integers(1, 3 * max(per), int(rng.integers(1, 5)))]
        cap = int(rng.integers(1, 4 * max(per)))
        want = _greedy_rounds(per, budgets, cap)
        got = cut_rounds(batch, budgets, cap)
        assert [sum(ids.size for _g, _m, ids, _o in r) for r in got] == [len(r) for r in want]
        flat = [
            (m.group, int(b), int(o), None if m.digests is None else m.digests[j], m.slot_bytes)
            for _g, m, ids, offs in batch
            for j, (b, o) in enumerate(zip(ids, offs, strict=True))
        ]
        cut = [
            (m.group, int(b), int(o), None if m.digests is None else list(m.digests)[j], m.slot_bytes)
            for r in got
            for _g, m, ids, offs in r
            for j, (b, o) in enumerate(zip(ids, offs, strict=True))
        ]
        assert cut == flat
        for r in got:  # each piece's Moves says what its arrays hold
            for _g, m, ids, offs in r:
                assert list(m.block_ids) == ids.tolist() and list(m.offsets) == offs.tolist()


def test_the_c_layout_equals_the_numpy_one() -> None:
    """plans.lay_out's C path (umbp.transfer._rounds) against round_bounds + plan_rounds: random batches
    of 1 to 5,000 objects (insertion sort and radix sort), slots in runs, scattered, shared by two
    objects (loads) and far into a large arena, one round or many."""
    from umbp.pool import native
    from umbp.transfer import plans

    if plans._rounds is None:
        if os.environ.get("UMBP_REQUIRE_NATIVE") == "1":
            pytest.fail(f"UMBP_REQUIRE_NATIVE=1 but umbp.transfer._rounds is {plans._why_not}")
        pytest.skip(f"umbp.transfer._rounds is {plans._why_not}")
    assert native.optional_extension("umbp.transfer._rounds")[0] is plans._rounds
    rng = np.random.default_rng(17)
    for trial in range(400):
        n = int(rng.choice([1, 2, 5, 47, 48, 49, 300, 5000])) if trial % 4 else int(rng.integers(1, 200))
        kinds = rng.integers(0, 3, n)  # three object sizes, slots padded or not
        size = np.array([4096, 200 * 8, 24 * 8])[kinds].astype(np.int64)
        reach = size + 8 * rng.integers(0, 3, n) * (rng.random(n) < 0.5)
        offs = np.empty(n, np.int64)
        cursor = int(rng.integers(0, 1 << 40)) & ~7 if trial % 3 == 0 else 0
        for i in range(n):
            if i and rng.random() < 0.1:
                offs[i] = offs[i - 1]  # a slot loaded twice
                continue
            cursor += 0 if rng.random() < 0.6 else 8 * int(rng.integers(1, 64))
            offs[i] = cursor
            cursor += int(reach[i])
        if rng.random() < 0.5:
            offs = offs[rng.permutation(n)]  # slots at random
            reach = reach.copy()
        cost = reach + plans.RUN_PAD
        many = rng.integers(1, max(2, int(cost.sum()) // 2), int(rng.integers(2, 6)))
        budgets = () if rng.random() < 0.3 else tuple(int(x) for x in many)  # (): one round
        cap = int(rng.integers(1, max(2, int(cost.sum()))))
        got_bounds, got = plans.lay_out(offs, size, reach, budgets, cap)
        want_bounds = plans.round_bounds(cost, list(budgets), cap) if budgets else [0, n]
        want = plans.plan_rounds(offs, size, reach, want_bounds)
        assert got_bounds == want_bounds, trial
        assert len(got) == len(want)
        for (gp, gr, gt), (wp, wr, wt) in zip(got, want, strict=True):
            assert gp.tolist() == wp.tolist() and gt == wt, trial
            assert [a.tolist() for a in gr] == [a.tolist() for a in wr], trial


def test_the_c_layout_refuses_what_it_cannot_sort() -> None:
    from umbp.transfer import plans

    if plans._rounds is None:
        pytest.skip(f"umbp.transfer._rounds is {plans._why_not}")
    one = np.ones(3, np.int64) * 64
    out = np.empty(8 * 3 + 4, np.int64)
    for bad in ([0, 8, -8], [0, 8, 12]):
        with pytest.raises(ValueError, match="offset"):
            plans._rounds.lay_out(np.array(bad, np.int64), one, one, (), 0, 16, out)
    many = 1 << 17  # 17 bits of batch index beside offset / 8: an offset of 2**62 leaves too few
    offs = np.arange(many, dtype=np.int64) * 64
    offs[-1] = 1 << 62
    size = np.full(many, 64, np.int64)
    with pytest.raises(ValueError, match="too large"):
        plans._rounds.lay_out(offs, size, size, (), 0, 16, np.empty(8 * many + 4, np.int64))
    with pytest.raises(ValueError, match="out"):
        plans._rounds.lay_out(np.zeros(3, np.int64), one, one, (), 0, 16, out[:10])
    with pytest.raises(TypeError, match="int64"):
        plans._rounds.lay_out(np.zeros(3, np.int32), one, one, (), 0, 16, out)


def test_lead_copies_reach_the_byte_target_and_leave_the_batch_call_a_run():
    """A round's first runs go to the copy engine one by one until LEAD_BYTES are queued, at most
    `most` of them, and never all: the batch call that follows gets the rest."""
    from umbp.transfer.batchcopy import _leading_runs

    mib = 1 << 20
    assert _leading_runs(np.array([mib] * 8), 2 * mib, 4) == 2  # 2 MiB reached after two
    assert _leading_runs(np.array([64 << 10] * 8), 2 * mib, 4) == 4  # small runs: capped at four
    assert _leading_runs(np.array([8 * mib] * 3), 2 * mib, 4) == 1  # one run is enough
    assert _leading_runs(np.array([mib, mib]), 8 * mib, 4) == 1  # never every run
    assert _leading_runs(np.array([mib]), 8 * mib, 4) == 0
