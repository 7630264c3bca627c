"""Engine 1 (one process) computes an 840-token hybrid prompt and exits; engine 2 (a new process, empty
DRAM) restores 832 tokens from the SSD tier, or from the shared Redis tier (the 1P1D pattern: one
instance computes, another reuses), with identical tokens and logprobs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from script_runs import script_result  # noqa: E402


def one_turn(arch: str, model_dir: Path, extra: dict, *flags: str) -> dict:
    return script_result("_one_turn.py", arch, str(model_dir), json.dumps(extra), *flags)


def test_new_process_restores_832_from_ssd(tiny_model_dir, tmp_path, capsys):
    """Through `umbp demo --restart ssd`, which runs both engines as separate processes."""
    from umbp.cli import main

    out = tmp_path / "demo.json"
    rc = main(["demo", "--restart", "ssd", "--workdir", str(tmp_path / "models"), "--out", str(out)])
    assert rc == 0, capsys.readouterr().out[-3000:]
    result = json.loads(out.read_text())
    assert result["engine1"]["cached_tokens"] == 0 and result["engine1"]["stored_objects"] > 0
    assert result["engine2"]["cached_tokens"] == 832 and result["engine2"]["restored_tokens"] == 832
    assert result["tokens_identical"] and result["max_abs_logprob_diff"] <= 1e-5
    assert "restored 832 tokens from the SSD tier; outputs identical" in capsys.readouterr().out


def test_slow_ssd_read_does_not_stall_the_engine(tiny_model_dir, tmp_path):
    """The restore's SSD reads are held until vLLM has stepped 3 times meanwhile: only a load that runs
    beside the engine's steps (umbp's I/O thread) lets those steps happen; the restore is still exact."""
    extra = {"dram_gb": 0.0625, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_gb": 0.25}
    first = one_turn("granite", tiny_model_dir("granite"), extra)
    second = one_turn("granite", tiny_model_dir("granite"), extra, "gate")
    assert second["steps_while_reading"] >= 3
    assert second["cached"] == 832 and second["totals"]["restored_tokens"] == 832
    assert second["tokens"] == first["tokens"]
    assert max(abs(a - b) for a, b in zip(second["logprobs"], first["logprobs"])) <= 1e-5


def test_second_instance_restores_832_from_redis(tiny_model_dir, tmp_path):
    from redis_servers import require_redis, start_server

    require_redis()
    server = start_server(tmp_path / "redis")
    try:
        extra = {"dram_gb": 0.0625, "remote": {"url": server.url}}
        first = one_turn("granite", tiny_model_dir("granite"), extra)
        assert first["cached"] == 0
        second = one_turn("granite", tiny_model_dir("granite"), extra)
    finally:
        server.stop()
    assert second["cached"] == 832
    assert second["totals"]["restored_tokens"] == 832
    assert second["tokens"] == first["tokens"]
    assert max(abs(a - b) for a, b in zip(second["logprobs"], first["logprobs"])) <= 1e-5
