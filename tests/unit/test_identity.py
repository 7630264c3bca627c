import dataclasses

import pytest

from umbp.identity import (
    GroupLayout,
    ModelIdentity,
    ParallelSizes,
    RankCoord,
    all_ranks,
    object_key,
    parse_key,
)

BASE = ModelIdentity(
    model="tiny/granite",
    revision="r1",
    dtype="float32",
    groups=(
        GroupLayout("full_attention", 400, ("l3.attn",), ((2, 400, 2, 32),), ("float32",)),
        GroupLayout("recurrent_state", 400, ("l0.mamba", "l1.mamba"), ((19840,), (19840,)), ("int8", "int8")),
    ),
    parallel=ParallelSizes(tp=2),
    prefix_hash_algo="sha256",
)


def test_namespace_is_stable_and_hex():
    ns = BASE.namespace()
    assert ns == dataclasses.replace(BASE).namespace()
    assert len(ns) == 32 and int(ns, 16) >= 0


def test_namespace_is_pinned():
    """Stored objects are found by it: an identity with no model option set keeps the namespace it had
    before model options existed (a new field must not move every deployment's objects out of reach)."""
    assert BASE.namespace() == "22d0c73ac761880523cd9ec021ff1c0e"


@pytest.mark.parametrize(
    "change",
    [
        {"model": "tiny/nemotron"},
        {"revision": "r2"},
        {"dtype": "bfloat16"},
        {"parallel": ParallelSizes(tp=4)},
        {"parallel": ParallelSizes(tp=2, dcp=2)},
        {"speculative_method": "eagle"},
        {"draft_model": "tiny/draft"},
        {"prefix_hash_algo": "xxhash"},
        {"tenant": "team-b"},
        {"model_options": (("quantization", '"fp8"'),)},
        {"model_options": (("hf_overrides", '{"rope_theta":1234.0}'),)},
        {"groups": (BASE.groups[0],)},
        {"groups": (dataclasses.replace(BASE.groups[0], block_size=640), BASE.groups[1])},
        {"groups": (dataclasses.replace(BASE.groups[0], layer_names=("l2.attn",)), BASE.groups[1])},
        {"groups": (dataclasses.replace(BASE.groups[0], page_shapes=((2, 400, 4, 32),)), BASE.groups[1])},
    ],
)
def test_anything_that_changes_bytes_changes_namespace(change):
    assert dataclasses.replace(BASE, **change).namespace() != BASE.namespace()


def test_different_rank_or_group_never_shares_a_key():
    ns, h = BASE.namespace(), bytes(range(32))
    keys = {object_key(ns, r, g, h) for r in all_ranks(ParallelSizes(tp=2, pp=2)) for g in (0, 1)}
    assert len(keys) == 8


def test_key_round_trips_and_matches_documented_format():
    key = object_key(BASE.namespace(), RankCoord(tp=1, pp=3), 4, b"\x01\x02")
    assert key == f"umbp:v1:{BASE.namespace()}:tp1:pcp0:dcp0:pp3:g4:0102"
    parsed = parse_key(key)
    assert parsed.rank == RankCoord(tp=1, pp=3) and parsed.group == 4 and parsed.prefix_hash == b"\x01\x02"
    assert str(parsed) == key


def test_dcp_partitions_tp_ranks():
    ranks = all_ranks(ParallelSizes(tp=4, dcp=2))
    assert [r.dcp for r in ranks] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    "bad", ["nope", "umbp:v1:xyz:tp0:pcp0:dcp0:pp0:g0:00", "umbp:v9:" + "0" * 32 + ":tp0:pcp0:dcp0:pp0:g0:00"]
)
def test_bad_keys_get_a_clear_error(bad):
    with pytest.raises(ValueError, match="umbp"):
        parse_key(bad)


def test_empty_hash_and_bad_namespace_rejected():
    with pytest.raises(ValueError, match="prefix_hash"):
        object_key(BASE.namespace(), RankCoord(), 0, b"")
    with pytest.raises(ValueError, match="namespace"):
        object_key("short", RankCoord(), 0, b"\x01")
