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
        digests = [rng.getrandbits(64) for _ in ids] if load and rng.random() < 0.5 else None
        if digests is not None and rng.random() < 0.3:  # numpy's, converted to ints by both checkers
            digests = np.array(digests, np.uint64) if rng.random() < 0.5 else [np.uint64(d) for d in digests]
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
    # offset + reach past 2**63 wrapped negative in the twin's int64 sum: accepted, then a copy past the
    # arena (a segfault on the zero-copy kernel path)
    (lambda b: b.append(Moves(0, [0], [(1 << 63) - 8])), "ValueError"),
    (lambda b: b.append(Moves(1, [0], [8], None, (1 << 63) - 1)), "ValueError"),  # slot reach wraps
    (lambda b: b.append(Moves(1, [0], [0], None, CAPACITY + 8)), "ValueError"),  # a slot wider than the arena
    (lambda b: b.append(Moves(0, [0], [0], None, 1 << 63)), "OverflowError"),
    (lambda b: b.append(Moves(0, [0], [0], None, 1024.0)), "TypeError"),
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


# each as the twin raised it before checking digest values (an error after earlier objects were
# written, or a quiet miss), the C side not at all
BAD_DIGESTS = ["x", None, 1.5, -1, 1 << 64, (1 << 64) + 5, np.int64(-1), np.float64(3.0)]


@pytest.mark.parametrize("value", BAD_DIGESTS, ids=repr)
def test_digest_values_are_checked_alike(engine, value) -> None:
    """A load's digests must be integers in [0, 2**64): anything else is one ValueError from both
    checkers, before anything is written (and before the duplicate-write check). Saves ignore them."""
    rng = random.Random(7)
    bad = Moves(7, [3, 2], [CAPACITY - 512, CAPACITY - 1024], [5, value])
    for _ in range(10):
        batch = _valid(rng, engine, load=True)
        batch.insert(rng.randint(0, len(batch)), bad)
        assert _same(engine, batch, load=True) == "ValueError"
        with pytest.raises(ValueError, match=r"digest must be an integer in \[0, 2\*\*64\)"):
            engine._checked(batch, True)
    assert _same(engine, [bad], load=False) == "ok"


def test_digests_reach_the_backends_as_ints(engine) -> None:
    """Digests given as numpy integers, bools or a numpy array reach the backends as a list of Python
    ints (the staged path compares them with ==, the kernel path packs them as uint64); a list or
    tuple of ints is passed on as it is."""
    top = (1 << 64) - 1
    for digests, want in [
        (np.array([top, 3], np.uint64), [top, 3]),
        ([np.uint64(top), True], [top, 1]),
        ((top, 2), (top, 2)),
    ]:
        batch = [Moves(0, [1, 2], [0, 512], digests)]
        for check in (engine._checked, engine._checked_py):
            got = check(batch, True)[0][1].digests
            assert got == want and type(got) is type(want) and all(type(v) is int for v in got)
    kept = [5, 6]
    assert engine._checked([Moves(0, [1, 2], [0, 512], kept)], True)[0][1].digests is kept


HOSTILE = {  # batch, load: what only the C checker refused before (api._checks None took the twin)
    "offset 2**63-8": ([Moves(0, [1], [(1 << 63) - 8])], False),
    "offset 2**63-8, load": ([Moves(0, [1], [0]), Moves(0, [2], [(1 << 63) - 8])], True),
    "slot_bytes 2**63-1": ([Moves(0, [1], [8], None, (1 << 63) - 1)], False),
    "two groups' slots overlap, one slot_bytes 2**63-1": (
        [Moves(0, [1], [8], None, (1 << 63) - 1), Moves(7, [2], [8])],
        False,
    ),
    "slot_bytes 2**63": ([Moves(0, [1], [0], None, 1 << 63)], False),
    "slot_bytes a float": ([Moves(0, [1], [0], None, 1024.0)], False),
    "a digest of -1": ([Moves(0, [1, 2], [0, 512], [3, -1])], True),
    "a digest of 2**64": ([Moves(0, [1], [0], [1 << 64])], True),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_batches_fail_alike_without_the_extension(engine, monkeypatch, case: str) -> None:
    """The same hostile batches through _checked with the extension and without it (it is optional: the
    twin then checks every batch), as lists and as numpy arrays (which the twin always checks)."""
    batch, load = HOSTILE[case]
    as_arrays = [
        Moves(m.group, np.array(m.block_ids), np.array(m.offsets), m.digests, m.slot_bytes) for m in batch
    ]
    with_c = _outcome(lambda: engine._checked(batch, load))
    monkeypatch.setattr(api, "_checks", None)
    without = [_outcome(lambda b=b: engine._checked(b, load)) for b in (batch, as_arrays)]
    kinds = {with_c[0], *(o[0] for o in without)}
    assert kinds <= {"ValueError", "TypeError", "OverflowError"} and len(kinds) == 1, (with_c, without)
    if with_c[0] != "OverflowError":  # numpy's message and CPython's differ there (see _same)
        assert with_c == without[0] == without[1]


@pytest.fixture(scope="module")
def shared():
    """vLLM's hybrid layout: groups 0-2 view one buffer per layer slot (block b of each is one page),
    group 5 has buffers of its own."""
    groups, _raws = L.hybrid(2, 8, 4, 2, 8, [200, 120])
    groups[5] = L.attention(1, 8, 4, 2, 8)
    return make_engine(Arena(CAPACITY, pinned=False), groups)


def test_groups_sharing_memory_load_a_block_once(shared, monkeypatch) -> None:
    """A load naming block b in two groups that share memory writes one page from two objects and
    verified both (corrupt metadata: vLLM never gives one block to two groups): refused by both
    checkers, naming the first Moves of the class and the groups that share; other groups, saves, and
    different blocks pass."""
    assert api.alias_classes(shared.groups) == {0: 0, 1: 0, 2: 0, 5: 1}
    refused = [
        ([Moves(0, [3], [0], [1]), Moves(1, [3], [512], [2])], "group 0"),
        ([Moves(5, [3], [0]), Moves(2, [4], [512]), Moves(1, [4], [1024])], "group 2"),
        ([Moves(1, [3, 4], [0, 512]), Moves(5, [4], [1024]), Moves(0, [5, 3], [1536, 2048])], "group 1"),
    ]
    allowed = [
        [Moves(0, [3], [0]), Moves(5, [3], [512]), Moves(1, [4], [1024]), Moves(2, [5], [1536])],
        [Moves(2, [1, 2], [0, 512]), Moves(0, [3], [1024])],
    ]
    for batch, named in refused:
        got = _outcome(lambda b=batch: shared._checked(b, True))
        assert got[0] == "ValueError" and named in got[1] and "groups 0, 1, 2 share" in got[1], got
        assert _same(shared, batch, load=True) == "ValueError"
        assert (
            _same(shared, [Moves(m.group, m.block_ids, [o * 4 for o in m.offsets]) for m in batch], False)
            == "ok"
        )
    for batch in allowed:
        assert _same(shared, batch, load=True) == "ok"
    monkeypatch.setattr(api, "_checks", None)
    for batch, named in refused:
        with pytest.raises(ValueError, match=named):
            shared._checked(batch, True)
