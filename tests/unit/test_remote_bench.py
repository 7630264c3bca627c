"""Smoke test of `umbp bench remote --quick`: it starts its own redis-server, runs through the CLI and writes
a complete JSON report. It checks fields, never speed (the benchmark is not a timed test)."""

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import require_redis  # noqa: E402
from umbp.cli import main  # noqa: E402


def test_bench_remote_quick_writes_json(tmp_path, capsys):
    require_redis()
    out = tmp_path / "bench_remote.json"
    assert (
        main(["bench", "remote", "--quick", "--working-set-mib", "4", "--reps", "1", "--out", str(out)]) == 0
    )
    report = json.loads(out.read_text())
    assert report["config"]["quick"] is True and report["server"]["version"]
    lk = report["lookup"]
    assert lk["keys"] == 8192 and lk["present"] == 4096 and lk["median_ms"] > 0
    assert lk["verdict"] == ("PASS" if lk["median_ms"] <= 5.0 else "MISS")
    rows = {(r["op"], r["size_bytes"]) for r in report["results"]}
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    assert rows == {(op, s) for op in ("put", "get", "put_async") for s in sizes}
    has_rb = shutil.which("redis-benchmark") is not None
    for r in report["results"]:
        assert r["umbp_gbps"] > 0
        if r["op"] != "put_async" and has_rb:
            assert r["ref_gbps"] > 0 and r["ratio"] > 0 and r["verdict"] in ("PASS", "MISS")
    stats = report["tier_stats"]
    assert stats["checksum_failures"] == 0 and stats["puts_dropped"] == 0 and stats["load_errors"] == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith("put_async") and "4 MiB" in printed[-1]  # the table comes last
