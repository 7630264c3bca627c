"""umbp.vllm.stages: what the scheduler side learns of each rank's layout under pipeline parallelism, and
which reports it refuses (a stage whose layout is in doubt is never restored into)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from umbp.identity import ParallelSizes, all_ranks
from umbp.vllm.stages import StageLayouts

OWN, OTHER = "a" * 32, "b" * 32


def layout(pp: int, tp: int = 1, object_bytes=(4096, 1024)):
    ranks = tuple(all_ranks(ParallelSizes(tp=tp, pp=pp)))
    return SimpleNamespace(
        ranks=ranks, groups=(None,) * len(object_bytes), namespace=OWN, object_bytes=object_bytes, pp=pp
    )


def test_without_pipeline_parallelism_every_rank_has_the_schedulers_layout():
    stages = StageLayouts(layout(pp=1, tp=4))
    assert stages.ready and stages.aliases() == {}
    assert stages.slot_bytes() == (4096, 1024) and stages.data_bytes() == (4 * 4096, 4 * 1024)


def test_ready_once_every_stage_reported():
    stages = StageLayouts(layout(pp=2, tp=2))
    assert not stages.ready
    assert not stages.learn(
        {"tp0:pcp0:dcp0:pp0": (OWN, (4096, 1024)), "tp1:pcp0:dcp0:pp0": (OWN, (4096, 1024))}
    )
    assert stages.learn({"tp0:pcp0:dcp0:pp1": (OTHER, (8192, 0)), "tp1:pcp0:dcp0:pp1": (OTHER, (8192, 0))})
    assert stages.ready
    assert stages.slot_bytes() == (8192, 1024)  # the largest rank's object of each group
    assert stages.data_bytes() == (2 * 4096 + 2 * 8192, 2 * 1024)
    assert stages.aliases() == {OTHER: OWN}
    assert not stages.learn({"tp0:pcp0:dcp0:pp1": (OTHER, (8192, 0))})  # a repeat changes nothing


def bad_reports():
    good = (OTHER, (8192, 0))
    return {
        "unknown rank": {"tp9:pcp0:dcp0:pp1": good},
        "short namespace": {"tp0:pcp0:dcp0:pp1": ("b" * 31, (8192, 0))},
        "group count": {"tp0:pcp0:dcp0:pp1": (OTHER, (8192,))},
        "negative size": {"tp0:pcp0:dcp0:pp1": (OTHER, (8192, -1))},
        "not a size": {"tp0:pcp0:dcp0:pp1": (OTHER, (8192, True))},
        "not a pair": {"tp0:pcp0:dcp0:pp1": OTHER},
        "not a mapping": [("tp0:pcp0:dcp0:pp1", good)],
    }


def test_a_malformed_report_refuses_the_stages_once(caplog):
    for why, report in bad_reports().items():
        stages = StageLayouts(layout(pp=2))
        with caplog.at_level(logging.WARNING, logger="umbp"):
            caplog.clear()
            assert not stages.learn(report), why
            assert not stages.learn(
                {"tp0:pcp0:dcp0:pp0": (OWN, (4096, 1024)), "tp0:pcp0:dcp0:pp1": (OTHER, (8192, 0))}
            )
        assert not stages.ready and stages.refused, why
        assert len([r for r in caplog.records if "uncached" in r.getMessage()]) == 1, why


def test_a_rank_that_changes_its_layout_is_refused():
    stages = StageLayouts(layout(pp=2, tp=2))
    stages.learn({"tp0:pcp0:dcp0:pp1": (OTHER, (8192, 0))})
    assert not stages.learn({"tp0:pcp0:dcp0:pp1": (OTHER, (8192, 1024))})
    assert stages.refused and "two different layouts" in stages.refused
