"""Smoke test of `umbp bench sched --quick`: real vLLM Schedulers with and without umbp's connector run
side by side through the CLI and the JSON report is complete. It checks fields, never speed."""

import json

import pytest

from umbp.cli import main


def test_bench_sched_quick_writes_json(tmp_path, capsys):
    out = tmp_path / "bench_sched.json"
    assert main(["bench", "sched", "--quick", "--requests", "4,8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["layout"] == "granite-4.0-h" and report["steps"] == 20
    assert [r["requests"] for r in report["rows"]] == [4, 8]
    for r in report["rows"]:
        assert r["decode"]["steps"] == 20 and r["prefill"]["steps"] >= 1
        for phase in ("prefill", "decode"):
            p = r[phase]
            assert p["plain_step_ms"] > 0 and p["umbp_step_ms"] > 0
            assert 0 < p["hooks_ms"] < p["umbp_step_ms"] and 0 < p["hooks_share"] < 1
        assert r["lookup_first"]["calls"] >= r["requests"] and r["lookup_first"]["max_ms"] > 0
        stored = r["lookup_stored"]  # prompts it stored, asked again: a hit over most of the prompt
        assert stored["calls"] == r["requests"] and stored["median_matched_tokens"] >= 400
    shares = [r["decode"]["hooks_share"] for r in report["rows"]]
    assert report["all_targets_met"] == (max(shares) <= report["target_decode_hooks_share"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2].startswith("lookup, 8 requests of 500 tokens") and printed[-2].endswith("info")
    assert printed[-1].startswith("garbage collection during the run: longest")
    assert printed[-5].split()[:2] == ["8", "decode"] and printed[-5].split()[-1] in ("PASS", "MISS")
    for r in report["rows"]:
        assert r["connector_totals"]["stored_objects"] > 0 and r["gc"]["longest_ms"] >= 0


def test_bench_sched_rejects_bad_input(capsys):
    assert main(["bench", "sched", "--layout", "no-such-layout"]) == 2
    assert "no-such-layout" in capsys.readouterr().err
    for bad in (["--requests", "0"], ["--requests", "x"], ["--prompt", "-5"], ["--steps", "-1"]):
        with pytest.raises(SystemExit) as exc:  # the parser's types
            main(["bench", "sched", "--quick", *bad])
        assert exc.value.code == 2 and f"argument {bad[0]}: " in capsys.readouterr().err


def test_long_prompts_get_room_to_decode():
    """A 131,072-token prompt needs blocks in every cache group (vLLM's pool is shared by them) and a
    max_model_len past the prompt plus what it decodes while the others prefill: with the layout's own
    131,072 the run stalled with nothing schedulable."""
    from umbp.replay.deployments import load_layout
    from umbp.tools.bench_sched import sized_layout

    layout = load_layout("granite-4.0-h")
    sized = sized_layout(layout, 256, 131072, 30)
    prefill_steps = 256 * 131072 // layout.max_num_batched_tokens
    assert sized.max_model_len >= 131072 + prefill_steps + 30
    per_group = [-(-sized.max_model_len // layout.span(g)) for g in layout.groups]
    assert sized.num_gpu_blocks >= 256 * sum(per_group) and sized.max_num_seqs >= 256
