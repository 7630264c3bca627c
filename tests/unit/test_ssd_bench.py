"""Smoke test of `umbp bench ssd --quick`: it runs through the CLI, writes a complete JSON report and
removes its scratch data. It checks fields, never speed (the benchmark is not a timed test)."""

import json

import pytest

from umbp.cli import main


def test_bench_ssd_quick_writes_json(tmp_path, capsys):
    out, data = tmp_path / "bench_ssd.json", tmp_path / "scratch"
    assert main(["bench", "ssd", "--quick", "--out", str(out), "--dir", str(data)]) == 0
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert cfg["quick"] is True and cfg["reps"] == 1 and cfg["working_set_bytes"] > 0
    assert isinstance(cfg["direct_io_used"], bool)
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    assert [(r["op"], r["size_bytes"]) for r in report["results"]] == [
        (op, s) for s in sizes for op in ("write", "read")
    ]
    for r in report["results"]:
        assert r["tier_mbps"] > 0 and r["disk_mbps"] > 0 and r["ratio"] > 0 and len(r["ratios"]) == 1
        assert r["verdict"] == ("PASS" if r["ratio"] >= 0.8 else "MISS")
    assert set(report["checksum_gbps"]) == {"psum64", "zlib.crc32"}
    assert isinstance(report["all_targets_met"], bool)
    assert not data.exists()  # scratch files removed
    assert "ratio = tier / disk" in capsys.readouterr().out


def test_bench_ssd_polling_client_and_copy_threads_are_recorded(tmp_path):
    out, data = tmp_path / "bench_ssd.json", tmp_path / "scratch"
    assert (
        main(
            [
                "bench",
                "ssd",
                "--quick",
                "--refused",
                "poll",
                "--copy-threads",
                "1",
                "--out",
                str(out),
                "--dir",
                str(data),
            ]
        )
        == 0
    )
    cfg = json.loads(out.read_text())["config"]
    assert cfg["refused"] == "poll" and cfg["copy_threads"] == 1


def test_bench_ssd_refuses_zero_copy_threads(tmp_path, capsys):
    argv = ["bench", "ssd", "--quick", "--copy-threads", "0", "--out", str(tmp_path / "o.json")]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--dir", str(tmp_path / "d")])
    assert exc.value.code == 2
    assert "argument --copy-threads: 0 is out of range: it must be >= 1" in capsys.readouterr().err
