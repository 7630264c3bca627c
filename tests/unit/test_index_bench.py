"""Smoke test of `umbp bench index` at a tiny object count: both indexes run in child processes and the
output ends with the line a script reads. It checks fields, never speed."""

import json
import re

from umbp.cli import main


def test_bench_index_tiny_writes_json_and_the_last_line(tmp_path, capsys):
    out = tmp_path / "index.json"
    assert main(["bench", "index", "--objects", "3000", "--churn", "1000", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["index"] for r in report["results"]] == ["old", "compact"]
    for r in report["results"]:
        assert r["objects"] == 3000 and r["rss_bytes_per_object"] > -1e6
        assert r["fill"]["us_reserve_commit"] > 0 and r["steady"]["us_lookup_per_key"] > 0
        assert r["evict"]["us_evict"] > 0 and set(r["targets_met"]) == {
            "bytes",
            "us",
            "steady_pauses",
            "index_pauses_cpu",
        }
        assert r["fill"]["worst_op_cpu_ms"] >= 0 and r["fill"]["involuntary_switches"] >= 0
        assert r["saves"]["batch"] == 16 and r["saves"]["us_per_key"] > 0
    compact = report["results"][1]
    assert compact["table_bytes_per_object"] > 0
    last = capsys.readouterr().out.splitlines()[-1]
    m = re.fullmatch(r"index: (\d+) objects, ([\d.]+) bytes/object, ([\d.]+) us/reserve\+commit", last)
    assert m and int(m.group(1)) == 3000
    assert float(m.group(3)) == compact["steady"]["us_reserve_commit"]


def test_bench_index_rejects_bad_counts(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(["bench", "index", "--objects", "1"])
    assert exc.value.code == 2
    assert "argument --objects: 1 is out of range: it must be >= 2" in capsys.readouterr().err
