"""The transfer engine's host planning kept per batch shape and laid out for all rounds in one pass must
equal what the per-Moves, per-round reference computes (plans.sorted_runs / plan_runs without a shape),
and a batch shape's cached constants must follow the key they were made for. CPU only."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from umbp.pool import Arena
from umbp.transfer import Moves, make_engine
from umbp.transfer import model_layouts as L
from umbp.transfer.api import slot_reach
from umbp.transfer.kernel_engine import KernelEngine
from umbp.transfer.plans import cut_rounds, plan_rounds, plan_runs, sorted_runs
from umbp.transfer.shapes import ShapeCache, length_term


@pytest.fixture
def engine():
    groups = {0: L.attention(2, 64, 4, 2, 8), 1: L.hybrid(1, 64, 4, 2, 8, [200])[0][1]}
    groups[2] = L.hybrid(1, 64, 4, 2, 8, [96])[0][1]
    return make_engine(Arena(1 << 22, pinned=False), groups)


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
        stand_in = SimpleNamespace(flat=engine.flat, _last_order=None)  # the kernel engine's _path count
        assert KernelEngine._run_count(stand_in, batch) == plan_runs(sorted_runs(batch))[1][0].size
        cuts = sorted({int(c) for c in rng.integers(1, n, int(rng.integers(0, 4)))}) if n > 1 else []
        budgets = [1 << 40]
        rounds = [batch]
        if cuts:  # cut where the random cuts fall, as cut_rounds would (consecutive objects)
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
