"""The `umbp` command's cheap subcommands (the benchmarks and the demo have their own tests)."""

import pytest

import umbp
from umbp.cli import main


def test_version(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"umbp {umbp.__version__}"


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("version", "bench", "demo", "explain"):
        assert name in out


def test_explain_names_the_missing_boundary_page(capsys):
    argv = ["explain", "--groups", "full:400,state:400", "--unit", "16", "--max-tokens", "839",
            "--present", "0=400,800", "--present", "1=800,832"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "stopped at 800" in out and "no object at 832" in out


def test_explain_rejects_bad_groups():
    with pytest.raises(SystemExit, match="bad group"):
        main(["explain", "--groups", "full", "--unit", "16", "--max-tokens", "10"])
