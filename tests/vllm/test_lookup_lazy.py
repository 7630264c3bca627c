"""The scheduler side's lookup asks the local tiers lazily (umbp.vllm.scheduler_lookup.LocalPresence):
on vLLM 0.32's real Scheduler it must answer exactly what asking every boundary answers (DRAM, SSD keys,
quarantine, holes), while asking the index for far fewer keys than the prompt has boundaries."""

from __future__ import annotations

import os
import random
import time

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from sched_harness import GroupDef, build  # noqa: E402

from umbp.hybrid import longest_hit  # noqa: E402

PROMPT = [3 + (i * 37) % 500 for i in range(2000)]
FA_MAMBA_400 = [GroupDef("fa", 400), GroupDef("mamba", 400)]


def hit_with(side, req, present):
    unit = side.layout.unit
    return longest_hit(
        list(side.layout.groups),
        unit=unit,
        present=present,
        max_tokens=req.num_tokens - 1,
        eagle_groups=side.layout.eagle_groups,
        hashed_tokens=len(req.block_hashes) * unit,
        dcp_world_size=side.layout.dcp,
    )


@pytest.fixture
def stored(tmp_path):
    """A harness whose DRAM tier holds PROMPT (GPU prefix cache dropped), and a fresh request for it."""
    h = build(tmp_path, FA_MAMBA_400, unit=16, extra={"dram_bytes": 256 << 20})
    h.add("A", PROMPT)
    h.run()
    assert h.sched.reset_prefix_cache()
    req = h.add("B", PROMPT, max_tokens=2)
    return h, req


def test_lazy_lookup_matches_asking_every_boundary(stored):
    h, req = stored
    side, rng = h.umbp, random.Random(3)
    hashed = len(req.block_hashes) * side.layout.unit
    keys = side.boundary_keys(req)
    assert hit_with(side, req, side.presence(req, hashed)).tokens > 1600  # the stored prompt is found
    for _ in range(40):
        # holes in DRAM, some of them held by the SSD tier instead, some keys quarantined
        for group in keys:
            side.index.remove([k for k in group if rng.random() < 0.05])
        side.ssd_keys = {k for group in keys for k in group if rng.random() < 0.02}
        side.quarantine = {k: time.monotonic() + 60 for group in keys for k in group if rng.random() < 0.01}
        eager = hit_with(side, req, side.present_sets(req, hashed))
        assert hit_with(side, req, side.presence(req, hashed)) == eager


def test_stored_prompt_lookup_asks_few_keys(stored):
    h, req = stored
    side = h.umbp
    asked = []
    lookup = side.index.lookup
    side.index.lookup = lambda keys, touch=False: asked.append(len(keys)) or lookup(keys, touch)
    tokens, _ = side.lookup(req, 0)
    boundaries = len(req.block_hashes) * len(side.layout.groups)  # 2 x 125
    assert tokens > 1600
    assert sum(asked) < boundaries / 2 and len(asked) <= 8, asked
