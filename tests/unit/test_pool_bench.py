"""Smoke test of `umbp bench pool --quick`: it runs through the CLI and writes a complete JSON report.
It checks fields, never speed (the benchmark is not a timed test)."""

import json

from umbp.cli import main


def test_bench_pool_quick_writes_json(tmp_path, capsys):
    out = tmp_path / "bench_pool.json"
    assert main(["bench", "pool", "--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["quick"] is True
    assert report["config"]["working_set_bytes"] > 0 and report["config"]["reps"] >= 1
    rows = {(r["op"], r["size_bytes"]) for r in report["results"]}
    sizes = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
    assert rows == {(op, s) for op in ("put", "get") for s in sizes}
    for r in report["results"]:
        assert r["pool_gbps"] > 0 and r["numpy_gbps"] > 0 and r["ratio"] > 0
        assert len(r["ratios"]) == report["config"]["reps"]
        assert r["verdict"] == (
            "info" if r["size_bytes"] < 256 << 10 else ("PASS" if r["ratio"] >= 0.9 else "MISS")
        )
    assert report["exists"]["keys_per_s"] > 0 and report["exists"]["verdict"] in ("PASS", "MISS")
    assert report["exists"]["present"] == report["exists"]["keys"] // 2
    assert report["checksum"]["name"] == "psum64" and report["checksum"]["cache_hot_gbps"] > 0
    assert isinstance(report["all_targets_met"], bool)
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1].startswith("checksum psum64")  # the table comes last
    assert "PASS" in printed or "MISS" in printed
