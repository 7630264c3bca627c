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
    argv = [
        "explain",
        "--groups",
        "full:400,state:400",
        "--unit",
        "16",
        "--max-tokens",
        "839",
        "--present",
        "0=400,800",
        "--present",
        "1=800,832",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "stopped at 800" in out and "no object at 832" in out


def test_explain_with_dcp_uses_block_spans(capsys):
    argv = [
        "explain",
        "--groups",
        "full:128,state:128",
        "--unit",
        "128",
        "--dcp",
        "8",
        "--max-tokens",
        "9999",
        "--present",
        "0=1024",
        "--present",
        "1=1152",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "DCP 8" in out and "no object at 1152 (partial page of block 1)" in out
    with pytest.raises(SystemExit, match="sliding window"):
        main(["explain", "--groups", "full:16,swa:16:32", "--unit", "16", "--dcp", "2", "--max-tokens", "99"])


def test_explain_rejects_bad_groups():
    with pytest.raises(SystemExit, match="bad group"):
        main(["explain", "--groups", "full", "--unit", "16", "--max-tokens", "10"])


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "pool", "--quick", "--out", "{file}/bench.json"],
        ["replay", "--out", "{file}/replay"],
        ["demo", "--out", "{file}/sub/demo.json"],
    ],
)
def test_an_unwritable_out_fails_at_once_with_one_message(tmp_path, argv):
    """Before any work (the demo would load vLLM, a bench would run for minutes): a --out below a file."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = [a.replace("{file}", str(blocker)) for a in argv]
    with pytest.raises(SystemExit, match=r"cannot write --out .*is a file, not a folder; pass --out"):
        main(argv)


def test_bench_ssd_names_an_unusable_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(
        SystemExit, match=r"umbp bench ssd: cannot use --dir .*a-file/x: Not a directory; pass --dir"
    ):
        main(["bench", "ssd", "--quick", "--dir", str(blocker / "x"), "--out", str(tmp_path / "o.json")])


def test_bench_remote_names_an_unreachable_url(tmp_path):
    import socket

    with socket.socket() as s:  # a free port: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(
        SystemExit, match=rf"umbp bench remote: cannot reach redis://127.0.0.1:{port}/0; start"
    ):
        main(
            [
                "bench",
                "remote",
                "--quick",
                "--url",
                f"redis://127.0.0.1:{port}/0",
                "--out",
                str(tmp_path / "o.json"),
            ]
        )
