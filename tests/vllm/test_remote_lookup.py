"""The scheduler's shared-tier lookup asks in two rounds (full-attention blocks first, then only up to a
block past their first gap): on vLLM's real Scheduler, with a shared tier holding random objects (gaps,
strays past the gaps, objects only some ranks hold), it must give exactly the hit that asking for every
object gives, and ask far fewer keys for a cold prompt."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sched_harness import GroupDef, build  # noqa: E402


class SetTier:
    """A shared tier holding a fixed set of object keys (what RedisTier.exists answers), counting asks."""

    def __init__(self, keys: set[str]) -> None:
        self.keys, self.asked = keys, 0

    def exists(self, keys: list[str]) -> list[bool]:
        self.asked += len(keys)
        return [k in self.keys for k in keys]


def _request(h, rid: str, tokens: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        pooling_params=None,
        block_hasher=h.hasher,
        sampling_params=SamplingParams(max_tokens=1),
    )


def _objects(h, req, rng: random.Random) -> set[str]:
    """Random objects of every rank: per group a stored prefix with holes, a few strays past it, and
    some objects that only one rank holds (not a hit)."""
    from umbp.identity import object_key

    layout = h.umbp.layout
    keys = set()
    for g in range(len(layout.groups)):
        cut = rng.randrange(0, len(req.block_hashes) + 1)
        hole = rng.choice([0.0, 0.05, 0.3])
        for i, bh in enumerate(req.block_hashes):
            if (i < cut and rng.random() >= hole) or rng.random() < 0.03:
                ranks = layout.ranks if rng.random() > 0.05 else layout.ranks[:1]
                keys.update(object_key(layout.namespace, r, g, bh) for r in ranks)
    return keys


VARIANTS = {
    "fa400-mamba-tp2": ([GroupDef("fa", 400), GroupDef("mamba", 400)], False, 2),
    "fa64-mamba-eagle": ([GroupDef("fa", 64), GroupDef("mamba", 64)], True, 1),
    "fa64-swa-mamba": (
        [GroupDef("fa", 64), GroupDef("swa", 64, window=128), GroupDef("mamba", 64)],
        False,
        1,
    ),
    "fa64-swa16-mamba-eagle": (
        [GroupDef("fa", 64), GroupDef("swa", 16, window=32), GroupDef("mamba", 64)],
        True,
        1,
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_rounds_give_the_hit_of_asking_everything(tmp_path, variant):
    groups, eagle, tp = VARIANTS[variant]
    h = build(tmp_path, groups, unit=16, eagle=eagle, tp=tp)
    side, rng = h.umbp, random.Random(variant)
    full_blocks = dict(side._full_blocks)
    for trial in range(40):
        tokens = [rng.randrange(1, 500) for _ in range(rng.randrange(40, 3000))]
        req = _request(h, f"r{trial}", tokens)
        side.remote = SetTier(_objects(h, req, rng))
        side._full_blocks = full_blocks  # two rounds (the connector's way)
        got = side.lookup(req, 0), side.track(req).hit
        two_rounds = side.remote.asked
        side._full_blocks = {}  # one round over every object: the reference
        side.remote.asked = 0
        ref = _request(h, f"ref{trial}", tokens)
        want = side.lookup(ref, 0), side.track(ref).hit
        assert got == want, (trial, len(tokens))  # the hit and every group's objects to load
        assert two_rounds <= side.remote.asked  # the two rounds ask a subset of every object
    for w in h.workers:
        w.shutdown()


def test_a_cold_long_prompt_asks_few_keys(tmp_path):
    h = build(tmp_path, [GroupDef("fa", 400), GroupDef("mamba", 400)], unit=16, max_model_len=8192)
    side = h.umbp
    side.remote = SetTier(set())
    req = _request(h, "cold", list(range(1, 8001)))
    assert side.lookup(req, 0) == (0, False)
    # round 1: the attention group's 20 whole blocks; round 2: the boundaries below the first gap (400)
    # plus one block, 16 ... 784, in both groups (the attention group's 400 was asked already)
    assert side.remote.asked == 20 + 48 + 49
    assert 2 * len(req.block_hashes) == 1000  # what one round over every boundary of both groups asks
    # vLLM looks a waiting request up again every step: within REMOTE_REUSE_S nothing more is asked (the
    # whole blocks' fresh answers still cap the second round)
    assert side.lookup(req, 0) == (0, False) and side.remote.asked == 117
    for w in h.workers:
        w.shutdown()
