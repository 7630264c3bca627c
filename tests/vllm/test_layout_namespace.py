"""Pages laid out differently in memory must never share a namespace: an instance beside NIXL (LBHNC
attention pages, DS conv states) and one without (the defaults) would restore each other's bytes wrongly."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from sched_harness import GroupDef, build  # noqa: E402

HYBRID = [GroupDef("fa", 400), GroupDef("mamba", 400)]


def test_conv_state_layout_is_part_of_the_namespace(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    default = build(tmp_path, HYBRID, unit=16).umbp.layout.namespace
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")  # the default, spelled out: same bytes
    assert build(tmp_path, HYBRID, unit=16).umbp.layout.namespace == default
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    assert build(tmp_path, HYBRID, unit=16).umbp.layout.namespace != default


def test_umbp_beside_nixl_gets_its_own_namespace(tmp_path):
    """Inside MultiConnector[NIXL, umbp] vLLM lays attention pages out for NIXL (LBHNC): umbp's namespace there
    differs from a plain instance's, and its scheduler and worker still agree with each other."""
    from test_multi_connector import build_multi

    multi = build_multi(tmp_path / "multi")
    ((umbp_sched,),) = [[c for c in multi.sched.connector._connectors if type(c).__name__ == "UMBPConnector"]]
    plain = build(tmp_path / "plain", HYBRID, unit=16)
    assert umbp_sched.layout.namespace == multi.workers[0].layout.namespace
    assert umbp_sched.layout.namespace != plain.umbp.layout.namespace
    assert any(("kv_layout", "LBHNC") in g.extra for g in umbp_sched.layout.identity.groups)
