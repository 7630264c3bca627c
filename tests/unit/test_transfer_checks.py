"""A transfer batch's validation in C (umbp.transfer._checks) and its Python twin
(TransferEngine._checked_py) agree: on valid batches the same joined ids, offsets and per-Moves views;
on every kind of bad batch the same error."""

from __future__ import annotations

import random

import numpy as np
import pytest

from umbp.pool import Arena
from umbp.transfer import Moves, api, make_engine
from umbp.transfer import model_layouts as L

pytestmark = pytest.mark.skipif(api._checks is None, reason="umbp.transfer._checks is not built")

CAPACITY = 1 << 16


@pytest.fixture(scope="module")
def engine():
    groups = {
        0: L.attention(2, 8, 4, 2, 8),
        1: L.hybrid(1, 8, 4, 2, 8, [200])[0][1],
        7: L.attention(1, 4, 4, 2, 8),
    }
    # objects of 512, 200 and 256 bytes: _valid's 512-byte slots hold any of them
    return make_engine(Arena(CAPACITY, pinned=False), groups)


def _outcome(fn):
    """What a check call gives: ('ok', key, ids, offsets, per-Moves views) or (error type, message)."""
    try:
        out = fn()
    except (KeyError, ValueError, TypeError, OverflowError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", [(id(g), m, i.tolist(), o.tolist()) for g, m, i, o in out]


def _same(engine, batch, load: bool):
    c = _outcome(lambda: engine._checked(batch, load))
    shape_c = engine._flat_of[1].key if c[0] == "ok" and c[1] else None
    py = _outcome(lambda: engine._checked_py(batch, load))
    shape_py = engine._flat_of[1].key if py[0] == "ok" and py[1] else None
    if c[0] == py[0] == "OverflowError":  # numpy's message and CPython's name different C types
        return c[0]
    assert c == py, batch
    assert shape_c == shape_py
    return c[0]


def _valid(rng: random.Random, engine, load: bool) -> list[Moves]:
    """Moves over the three groups (a group may appear twice), ids distinct per group, slots disjoint,
    some with slot_bytes past the object; lists or tuples."""
    free_slots = list(range(0, CAPACITY // 512))
    rng.shuffle(free_slots)
    used: dict[int, set[int]] = {}
    batch = []
    for _ in range(rng.randint(1, 5)):
        g = rng.choice([0, 1, 7])
        geom = engine.groups[g]
        n = rng.randint(0, 4)
        ids = [
            b
            for b in rng.sample(range(geom.num_blocks), geom.num_blocks)
            if b not in used.setdefault(g, set())
        ]
        ids = ids[:n]
        used[g].update(ids)
        offs = [free_slots.pop() * 512 for _ in ids]
        slot_bytes = rng.choice([None, geom.object_bytes, 512]) if geom.object_bytes <= 512 else None
        digests = [rng.getrandbits(63) for _ in ids] if load and rng.random() < 0.5 else None
        seq = tuple if rng.random() < 0.3 else list
        batch.append(Moves(g, seq(ids), seq(offs), digests, slot_bytes))
    return batch


def test_valid_batches_flatten_alike(engine) -> None:
    rng = random.Random(1)
    kinds = set()
    for i in range(300):
        load = i % 2 == 0
        kinds.add(_same(engine, _valid(rng, engine, load), load))
    assert kinds == {"ok"}


BAD = [
    (lambda b: b.append(Moves(5, [0], [0])), "KeyError"),
    (lambda b: b.append(Moves(0, [0, 1], [0])), "ValueError"),
    (lambda b: b.append(Moves(0, [0], [0], [1, 2])), "ValueError"),
    (lambda b: b.append(Moves(0, [0], [0], None, 8)), "ValueError"),  # slot_bytes under the object
    (lambda b: b.append(Moves(0, [8], [CAPACITY - 512])), "ValueError"),  # id past the group's blocks
    (lambda b: b.append(Moves(1, [-1], [CAPACITY - 512])), "ValueError"),
    (lambda b: b.append(Moves(0, [0], [-8])), "ValueError"),
    (lambda b: b.append(Moves(0, [0], [CAPACITY - 8])), "ValueError"),  # slot past the arena's end
    (lambda b: b.append(Moves(0, [0], [12])), "ValueError"),  # not 8-byte aligned
    (lambda b: b.append(Moves(0, [1.5], [0])), "TypeError"),
    (lambda b: b.append(Moves(0, ["3"], [0])), "TypeError"),
    (lambda b: b.append(Moves(0, [0], [1 << 64])), "OverflowError"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_batches_fail_alike(engine, case: int) -> None:
    rng = random.Random(case)
    mutate, kind = BAD[case]
    for i in range(20):
        load = i % 2 == 0
        batch = _valid(rng, engine, load)
        mutate(batch)
        rng.shuffle(batch)
        assert _same(engine, batch, load) == kind


def test_repeated_writes_and_overlaps_fail_alike(engine) -> None:
    """A load writing one block twice (within one Moves or across two of one group) and a save writing
    one arena byte twice (equal or overlapping slots, one reach or mixed): the same error, and the
    first offending group named."""
    assert _same(engine, [Moves(0, [1, 2, 1], [0, 512, 1024])], load=True) == "ValueError"
    assert (
        _same(engine, [Moves(1, [3], [0]), Moves(0, [2], [512]), Moves(0, [2], [1024])], True) == "ValueError"
    )
    two = [Moves(1, [3, 3], [0, 512]), Moves(0, [2, 2], [1024, 2048])]
    c = _outcome(lambda: engine._checked(two, True))
    assert c == _outcome(lambda: engine._checked_py(two, True)) and "group 1" in c[1]
    assert _same(engine, [Moves(0, [1, 2], [512, 512])], load=False) == "ValueError"
    wide = engine.groups[0].object_bytes + 8
    assert _same(engine, [Moves(0, [1], [0], None, wide), Moves(1, [1], [wide - 8])], False) == "ValueError"
    assert _same(engine, [Moves(0, [1], [0], None, wide), Moves(1, [1], [wide])], False) == "ok"
    assert _same(engine, [Moves(0, [1, 2], [512, 512])], load=True) == "ok"  # loads may share slots


def test_non_list_moves_take_the_python_twin(engine) -> None:
    """numpy arrays (or anything not a list or tuple) are not read in C: the twin checks them, and an
    array of non-integers is refused rather than truncated."""
    batch = [Moves(0, np.array([1, 2]), np.array([0, 512]))]
    assert api._checks.flatten(batch, engine._limits, CAPACITY, True) is None
    assert [o.tolist() for _g, _m, _i, o in engine._checked(batch, True)] == [[0, 512]]
    with pytest.raises(TypeError, match="must be integers"):
        engine._checked([Moves(0, np.array([1.0]), np.array([0]))], True)


def test_a_list_changed_while_read_is_refused(engine) -> None:
    """An id whose __index__ shrinks its own list: a clear error, not a read past the list's end."""
    ids: list = []

    class Shrinks:
        def __index__(self) -> int:
            ids.clear()
            return 0

    ids += [Shrinks(), 1, 2]
    with pytest.raises(ValueError, match="changed while it was read"):
        engine._checked([Moves(0, ids, [0, 512, 1024])], True)
