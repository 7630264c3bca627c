"""The `umbp` tools on bad input: arguments, trace files, layout JSON, SSD directories, server replies,
/metrics endpoints and key files. Each gives one clear message and a non-zero exit (or a note, where a
tool reports on many sources): never a traceback, never a hang, never unbounded memory."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_resp import FakeResp  # noqa: E402
from loopback import loopback_server  # noqa: E402
from umbp.cli import build_parser, main  # noqa: E402

NS = "0123456789abcdef0123456789abcdef"
KEY = f"umbp:v1:{NS}:tp0:pcp0:dcp0:pp0:g0:" + "01" * 32
MARK = b"umbp:m:" + KEY.encode()


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """`call()`'s result, or a failure if it has not returned after `seconds` (it runs in a daemon thread,
    so a call that would block forever fails the test instead of hanging it)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box["exc"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "exc" in box:
        raise box["exc"]
    return box["out"]


def umbp(capsys, *argv: str, seconds: float = 30.0) -> tuple[int, str, str]:
    rc = within(seconds, lambda: main(list(argv)))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---- umbp replay: traces ------------------------------------------------------------------------------

OK = '{"session": "a", "segments": [{"id": "x", "len": 32}]}\n'


@pytest.mark.parametrize(
    "text, message",
    [
        (
            OK + '{"session": "a", "turn": 1, "think_s": NaN, "segments": []}\n',
            "line 2: 'think_s' must be a finite",
        ),
        ('{"session": "a", "think_s": "nan", "segments": []}\n', "'think_s' must be a number"),
        ('{"session": "a", "arrival_s": NaN, "segments": []}\n', "'arrival_s' must be a finite"),
        ('{"session": "a", "arrival_s": -1, "segments": []}\n', "'arrival_s' must be a finite"),
        (
            '{"session": "a", "segments": [{"id": "x", "len": 10000000000}]}\n',
            "'len' 10000000000 is out of range",
        ),
        ('{"session": "a", "segments": [{"id": "x", "len": 1e400}]}\n', "'len' must be a whole number"),
        ('{"session": "a", "segments": [{"tokens": [1e400]}]}\n', "a token id must be a whole number"),
        ('{"session": "a", "turn": 1e400, "segments": []}\n', "'turn' must be a whole number"),
        ('{"session": "a", "output_tokens": -5, "segments": []}\n', "'output_tokens' -5 is out of range"),
        ('{"timestamp": 1e400, "input_length": 10, "hash_ids": [1]}\n', "'timestamp' (ms) must be a finite"),
        ('{"timestamp": 1, "input_length": 10, "hash_ids": [1e400]}\n', "a hash id must be a whole number"),
        ('{"session": "a", "segments": [{"id": "x", "len": ' + "1" * 5000 + "}]}\n", "line 1: not JSON"),
        ("[" * 100_000 + "]" * 100_000 + "\n", "line 1: not JSON (nested too deeply)"),
        ('{"a":' * 50_000 + "1" + "}" * 50_000 + "\n", "line 1: not JSON (nested too deeply)"),
        ('{"session": "a", "segments": [{"id": {"x": 1}, "len": 3}]}\n', "'id' must be a non-empty string"),
        ('{"session": "a", "segments": null}\n', "'segments' must be a list"),
        ('{"session": "a", "segments": [1, 2]}\n', "a segment must be an object"),
        ('{"segments": []}\n', "missing field 'session'"),
    ],
)
def test_a_malformed_trace_line_is_one_error_naming_the_line(tmp_path, capsys, text, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text(text)
    rc, _, err = umbp(capsys, "replay", "--trace", str(trace), "--dry-run")
    assert rc == 2 and err.startswith("umbp replay: trace line") and message in err, err


def test_a_trace_line_that_is_not_utf8(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(OK.encode() + b'{"session": "a", "turn": 1, "segments": [{"id": "\xff", "len": 3}]}\n')
    rc, _, err = umbp(capsys, "replay", "--trace", str(trace), "--dry-run")
    assert rc == 2 and "trace line 2: not UTF-8" in err, err


def test_a_trace_that_is_not_a_regular_file_is_refused_unread(tmp_path, capsys):
    """A FIFO without a writer (opening it would block), /dev/zero (one endless line) and a folder."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")
    for path in (fifo, zero, tmp_path):
        rc, _, err = umbp(capsys, "replay", "--trace", str(path), "--dry-run", seconds=20)
        assert rc == 2 and "not a regular file" in err, err
    rc, _, err = umbp(capsys, "replay", "--trace", str(tmp_path / "missing"), "--dry-run")
    assert rc == 2 and "cannot open it: No such file or directory" in err


def test_a_huge_trace_line_is_not_read_whole(tmp_path, capsys):
    """A 10 GB sparse file (zeros, no newline): refused after the first 16 MiB, not loaded."""
    sparse = tmp_path / "sparse.jsonl"
    with sparse.open("wb") as f:
        f.truncate(10 << 30)
    rc, _, err = umbp(capsys, "replay", "--trace", str(sparse), "--dry-run", seconds=20)
    assert rc == 2 and "trace line 1: longer than 16 MiB" in err, err


def test_write_trace_to_a_folder_or_fifo_fails_before_generating(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, why in ((tmp_path, "it is a folder"), (fifo, "not a regular file")):
        rc, _, err = umbp(capsys, "replay", "--write-trace", str(path), "--sessions", "2", "--dry-run")
        assert rc == 2 and f"umbp replay: --write-trace: cannot write the trace to {path}: {why}" in err, err


# ---- umbp replay: arguments and layouts ------------------------------------------------------------------


@pytest.mark.parametrize(
    "retention, message",
    [
        ("abc", "--retention 'abc': each value must be 'layout' or a non-negative multiple"),
        ("-400", "--retention '-400'"),
        ("0,100", "--retention '100'"),  # not a multiple of granite's 400-token scheduler block
    ],
)
def test_a_bad_retention_fails_before_any_run(capsys, retention, message):
    argv = ("replay", "--layout", "granite", f"--retention={retention}", "--sessions", "2", "--dry-run")
    rc, _, err = umbp(capsys, *argv)
    assert rc == 2 and message in err, err


@pytest.mark.parametrize(
    "option, value",
    [
        ("--hash-seed", "-1"),
        ("--hash-seed", str(2**32)),
        ("--sessions", "0"),
        ("--concurrency", "0"),
        ("--jobs", "0"),
        ("--think-s", "nan"),
        ("--think-s", "0"),
        ("--dram-gb", "inf"),
        ("--require", "nan"),
    ],
)
def test_replay_arguments_are_checked_by_the_parser(capsys, option, value):
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--sessions", "2", f"{option}={value}", "--dry-run"])
    assert exc.value.code == 2 and f"argument {option}" in capsys.readouterr().err


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for inner, subsub in _subparsers(sub):
                    yield f"{name} {inner}", subsub


def test_no_numeric_option_takes_a_bare_int_or_float():
    """Every numeric option goes through a bounded type (umbp.tools.argtypes), so a count of 0 or a
    negative size is refused by the parser, naming the option, before any work starts."""
    bare = [
        f"umbp {name} {action.option_strings[0]}"
        for name, sub in _subparsers(build_parser())
        for action in sub._actions
        if action.type in (int, float)
    ]
    assert not bare


@pytest.mark.parametrize(
    "argv",
    [
        # each ran before: a ZeroDivisionError, vLLM's traceback, or minutes of a run that measured nothing
        ["chaos", "--turns", "0"],
        ["chaos", "--conversations", "0"],
        ["chaos", "--faults", "-1"],
        ["chaos", "--tol", "nan"],
        ["demo", "--prompt-tokens", "-1"],
        ["demo", "--unit", "0"],
        ["bench", "index", "--churn", "-1"],
        ["bench", "pool", "--batch", "0"],
        ["bench", "pool", "--reps", "0"],
        ["bench", "remote", "--batch", "0"],
        ["bench", "transfer", "--batches", "0"],
        ["bench", "restore", "--reps", "x"],
        ["bench", "ssd", "--io-mib", "0"],
        ["bench", "sched", "--prompt", "0"],
        ["explain", "--groups", "full:16", "--unit", "16", "--max-tokens", "-1"],
        ["explain", "--groups", "full:16", "--unit", "16", "--max-tokens", str(10**20)],
        ["explain", "--groups", "full:16", "--unit", "16", "--max-tokens", str(2**25)],
        [
            "explain",
            "--groups",
            "full:16",
            "--unit",
            "16",
            "--max-tokens",
            "9",
            "--hashed-tokens",
            str(10**11),
        ],
        ["explain", "--groups", "full:16", "--unit", "16", "--max-tokens", "9", "--dcp", str(10**9)],
        ["replay", "--dry-run", "--gpu-blocks", "0"],
        # comma lists and names
        ["bench", "index", "--objects", "1000000,x"],
        ["bench", "index", "--objects", "1"],
        ["bench", "sched", "--requests", "0"],
        ["bench", "restore", "--tokens", ","],
        ["bench", "transfer", "--sweep-ctas", "16,-1"],
        ["bench", "transfer", "--sweep-blocks", "1000x4"],
        ["chaos", "--kinds", "dram_bitflip,bogus"],
        ["chaos", "--arch", "bogus"],
        ["demo", "--arch", "bogus"],
    ],
    ids=" ".join,
)
def test_a_numeric_option_out_of_range_is_refused_by_the_parser(capsys, argv):
    option = [a for a in argv if a.startswith("--") and a != "--dry-run"][-1]
    with pytest.raises(SystemExit) as exc:
        within(10, lambda: main(argv))
    assert exc.value.code == 2 and f"argument {option}: " in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "pool", "--working-set-mib", str(1 << 40)], "umbp bench pool: --working-set-mib"),
        (["bench", "ssd", "--working-set-mib", str(1 << 40)], "umbp bench ssd: --working-set-mib"),
        (["bench", "remote", "--working-set-mib", str(1 << 40)], "umbp bench remote: --working-set-mib"),
        (["bench", "index", "--objects", str(1 << 40)], f"umbp bench index: --objects {1 << 40}"),
    ],
)
def test_a_run_larger_than_the_free_memory_is_refused_before_it_starts(tmp_path, argv, message):
    """(MemoryError from numpy, or the OOM killer, before.)"""
    with pytest.raises(SystemExit, match=message) as exc:
        within(10, lambda: main([*argv, "--out", str(tmp_path / "o.json")]))
    assert "of memory;" in str(exc.value) and "is available" in str(exc.value)


def test_bench_remote_with_a_bad_url_is_one_error_that_hides_its_password(tmp_path):
    argv = ["bench", "remote", "--url", "http://:hunter2@127.0.0.1:1/0", "--out", str(tmp_path / "o.json")]
    with pytest.raises(
        SystemExit, match="umbp bench remote: remote tier option 'url': .* must start with"
    ) as exc:
        within(10, lambda: main(argv))
    assert "hunter2" not in str(exc.value)


@pytest.mark.parametrize("tool", ["demo", "chaos"])
def test_a_workdir_that_cannot_be_made_is_one_error(tmp_path, tool):
    (tmp_path / "file").write_text("")
    workdir = tmp_path / "file" / "models"
    with pytest.raises(SystemExit, match=f"umbp {tool}: cannot write --workdir {workdir}: .* is a file"):
        within(10, lambda: main([tool, "--workdir", str(workdir), "--out", str(tmp_path / "o.json")]))


GRANITE = {
    "name": "g",
    "description": "d",
    "groups": [
        {"kind": "attention", "block_size": 400, "layers": 4, "page_bytes": 409600},
        {"kind": "state", "block_size": 400, "layers": 28, "page_bytes": 409600, "checkpoint_alignment": 1},
    ],
    "unit": 16,
    "eagle_drop": False,
    "num_gpu_blocks": 800,
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 32,
    "max_model_len": 131072,
    "ranks": 1,
    "dram_gb_per_rank": 128,
    "retention": 2000,
}


@pytest.mark.parametrize(
    "content, message",
    [
        ({**GRANITE, "unit": 0}, "'unit' must be an integer in [1, "),
        ({**GRANITE, "unit": -16}, "'unit' must be an integer"),
        ({**GRANITE, "unit": "16"}, "'unit' must be an integer"),
        ({**GRANITE, "num_gpu_blocks": 10**10}, "'num_gpu_blocks' must be an integer in [4, "),
        (
            {**GRANITE, "dram_gb_per_rank": float("nan")},
            "'dram_gb_per_rank' must be a finite number from 3.8147e-06 to 1.04858e+06",
        ),
        (
            {**GRANITE, "timing": {"h2d_gbps": 0}},
            "timing 'h2d_gbps' must be a finite number > 0 and up to 1e+12",
        ),
        ({**GRANITE, "timing": "x"}, "'timing' must be an object"),
        ({**GRANITE, "groups": None}, "'groups' must be a list of objects"),
        ({**GRANITE, "eagle_drop": 1}, "'eagle_drop' must be a bool"),
        ([1, 2], "expected a JSON object of layout fields, got list"),
        ("str", "expected a JSON object of layout fields, got str"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON (nested too deeply)"),
        (b'{"name": "\xff"}', "not UTF-8"),
        (" " * (1 << 20) + "{}", "larger than 1 MiB"),
    ],
)
def test_a_bad_layout_file_is_one_error(tmp_path, capsys, content, message):
    path = tmp_path / "layout.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str) and content != "str":
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))
    rc, _, err = umbp(capsys, "replay", "--layout", str(path), "--print-layout")
    assert rc == 2 and err.startswith("umbp replay: layout") and message in err, err


def test_the_layout_file_from_print_layout_still_loads(tmp_path, capsys):
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(GRANITE))
    rc, out, _ = umbp(capsys, "replay", "--layout", str(path), "--print-layout")
    assert rc == 0 and json.loads(out)[0]["unit"] == 16


def test_bench_out_naming_a_folder_fails_before_the_run(tmp_path):
    with pytest.raises(
        SystemExit, match=r"umbp bench pool: cannot write --out .*: it is a folder; pass --out"
    ):
        within(30, lambda: main(["bench", "pool", "--quick", "--out", str(tmp_path)]))


# ---- umbp explain ----------------------------------------------------------------------------------------

BASE = ["explain", "--groups", "full:16,state:16", "--unit", "16", "--max-tokens", "100"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (BASE + ["--eagle-groups", "abc"], "bad --eagle-groups 'abc'"),
        (BASE + ["--eagle-groups", "-1"], "bad --eagle-groups '-1'"),
        (BASE + ["--present=-1=16"], "bad --present '-1=16'"),
        (BASE + ["--present", "0=99999999999"], "bad --present '0=99999999999'"),
        (
            ["explain", "--groups", "full:16,swa:16:0", "--unit", "16", "--max-tokens", "99"],
            "bad group 'swa:16:0'",
        ),
        (
            ["explain", "--groups", "full:16,swa:16:-5", "--unit", "16", "--max-tokens", "99"],
            "bad group 'swa:16:-5'",
        ),
        (
            ["explain", "--groups", "full:1,swa:1:4194304,state:1", "--unit", "1", "--max-tokens", "4096"],
            "blocks to walk; at most",
        ),
        (
            [
                "explain",
                "--groups",
                "full:1048576,state:16",
                "--unit",
                "16",
                "--dcp",
                "32",
                "--max-tokens",
                "9",
            ],
            "spans",
        ),
    ],
)
def test_explain_bounds_its_inputs(argv, message):
    """Its time and memory are linear in the token counts: past 2**24 tokens, or 2**22 blocks to walk,
    one clear error at once (1e20 tokens was a MemoryError, 1e12 about an hour)."""
    with pytest.raises(SystemExit, match="umbp explain: ") as exc:
        within(20, lambda: main(argv))
    assert message in str(exc.value)


def test_explain_at_its_bounds_still_answers(capsys):
    top = str(2**24)
    argv = ["explain", "--groups", "full:16,state:16", "--unit", "16", "--max-tokens", top]
    assert within(20, lambda: main([*argv, "--present", f"1={top}"])) == 0
    assert f"stopped at 0 of max {top}" in capsys.readouterr().out


# ---- umbp stats --ssd --------------------------------------------------------------------------------------


@contextmanager
def unreadable(monkeypatch, *paths: Path) -> Iterator[None]:
    """`paths` cannot be listed: mode 000, and (as root ignores modes) os.listdir/os.scandir refuse them."""
    locked = {str(p) for p in paths}
    real_listdir, real_scandir = os.listdir, os.scandir

    def check(path: Any) -> None:
        if os.fspath(path) in locked:
            raise PermissionError(13, "Permission denied", os.fspath(path))

    monkeypatch.setattr(os, "listdir", lambda path=".": (check(path), real_listdir(path))[1])
    monkeypatch.setattr(os, "scandir", lambda path=".": (check(path), real_scandir(path))[1])
    for p in paths:
        p.chmod(0)
    try:
        yield
    finally:
        for p in paths:
            p.chmod(0o755)


def _ssd_base(tmp_path: Path) -> Path:
    import numpy as np

    from umbp.identity import RankCoord, object_key
    from umbp.pool.ssd.tier import SsdTier
    from umbp.vllm.tiers import rank_dir

    base = tmp_path / "ssd"
    for tp in (0, 1):
        rank = RankCoord(tp=tp)
        tier = SsdTier(rank_dir(str(base), NS, rank), 64 << 20)
        assert all(tier.put([object_key(NS, rank, 0, b"\x01" * 32)], [np.ones(1000, np.uint8)]))
        assert tier.flush(30)
        tier.close()
    return base


def test_stats_on_unreadable_ssd_directories(tmp_path, capsys, monkeypatch):
    """An unreadable rank or namespace is a note (the rest is reported); an unreadable base is the
    source's one error."""
    base = _ssd_base(tmp_path)
    ranks = sorted((base / NS).iterdir())
    with unreadable(monkeypatch, ranks[0]):
        rc, out, err = umbp(capsys, "stats", "--ssd", str(base))
    assert rc == 0 and "tp1:pcp0:dcp0:pp0" in out and err == "", err
    assert f"note: {NS}/{ranks[0].name}: unreadable (Permission denied): not counted" in out
    with unreadable(monkeypatch, base / NS):
        rc, out, _ = umbp(capsys, "stats", "--ssd", str(base), "--json")
    assert rc == 0 and json.loads(out)["tiers"][0]["notes"] == [
        f"{NS}: unreadable (Permission denied): its ranks are not counted"
    ]
    with unreadable(monkeypatch, base):
        rc, out, err = umbp(capsys, "stats", "--ssd", str(base))
    assert rc == 2 and out == "" and f"cannot read {base}: Permission denied" in err, err


# ---- umbp stats --remote: a server's odd replies -----------------------------------------------------------


def _scan_reply(cursor: bytes, names: list[bytes], raw: bytes = b"") -> bytes:
    """[cursor, [names...]]; `raw`: one more element of the names array, as RESP bytes."""
    out = b"*2\r\n$%d\r\n%s\r\n*%d\r\n" % (len(cursor), cursor, len(names) + bool(raw))
    for n in names:
        out += b"$%d\r\n%s\r\n" % (len(n), n)
    return out + raw


def _server(table: dict[bytes, Any]) -> FakeResp:
    def respond(cmd: list[bytes]) -> Any:
        reply = table.get(cmd[0].upper(), b"-ERR unknown command\r\n")
        return reply(cmd) if callable(reply) else reply

    return FakeResp(respond)


def _counting_cursor() -> Callable[[list[bytes]], bytes]:
    count = iter(range(1, 1 << 30))
    return lambda cmd: _scan_reply(b"%d" % next(count), [])


@pytest.mark.parametrize(
    "table, message",
    [
        ({b"SCAN": _scan_reply(b"7", [])}, "SCAN: the server returned the same cursor twice"),
        ({b"SCAN": None, b"DBSIZE": b":10\r\n"}, "SCAN: not finished after 1040 pages"),
        ({b"SCAN": b":5\r\n"}, "SCAN: a reply that is not [cursor, [names]]"),
        ({b"SCAN": _scan_reply(b"zz", [MARK])}, "SCAN: a reply that is not [cursor, [names]]"),
        ({b"SCAN": _scan_reply(b"0", [], raw=b"*1\r\n$1\r\nx\r\n")}, "SCAN: a key name that is not a string"),
        (
            {b"SCAN": _scan_reply(b"0", [MARK]), b"STRLEN": b"$3\r\nabc\r\n"},
            "STRLEN: a reply that is not a length",
        ),
        (
            {b"SCAN": _scan_reply(b"0", [MARK]), b"STRLEN": b":-99\r\n"},
            "STRLEN: a reply that is not a length",
        ),
    ],
)
def test_stats_remote_on_a_server_that_is_not_redis(capsys, table, message):
    """A SCAN whose cursor never comes back to 0 (it repeats, or it counts up past what the server's key
    count calls for) ends; replies of the wrong shape are one error, not a traceback."""
    if table.get(b"SCAN", b"") is None:
        table = {**table, b"SCAN": _counting_cursor()}
    with _server(table) as server:
        rc, _, err = umbp(capsys, "stats", "--remote", server.url, seconds=20)
    assert rc == 2 and f"umbp stats: cannot read {server.url}: {message}" in err, err
    assert "Traceback" not in err


def test_stats_remote_on_a_server_streaming_an_endless_scan_reply(capsys):
    """A SCAN page whose names never end: redis-py keeps reading it (its timeout bounds each receive);
    the reply is cut off at umbp's cap on what redis-py parses, one error, bounded time."""
    from fake_resp import endless

    with FakeResp(lambda cmd: None) as server:
        stream = endless(b"*2\r\n$1\r\n0\r\n*999999999\r\n", b"$4\r\nname\r\n" * 4096, 256 << 20, server)
        server.respond = lambda cmd: stream if cmd[0].upper() == b"SCAN" else b":5\r\n"
        rc, _, err = umbp(capsys, "stats", "--remote", server.url, seconds=20)
    assert rc == 2 and "a reply of more than 8 MiB" in err, err


def test_clear_ends_on_a_cursor_that_never_returns_to_zero():
    """RedisTier.clear walks the same bounded SCAN: a server answering cursor 7 forever is a counted
    error, not a loop."""
    from umbp.pool.remote.tier import RedisTier

    with _server({b"SCAN": _scan_reply(b"7", [])}) as server:
        tier = RedisTier.from_options({"url": server.url})
        assert within(10, tier.clear) is None
        assert tier.stats()["reply_errors"] == 1
        tier.close()


def test_max_keys_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["stats", "--remote", "redis://127.0.0.1:1/0", "--max-keys", "-1"])
    assert (
        exc.value.code == 2
        and "argument --max-keys: -1 is out of range: it must be >= 1" in capsys.readouterr().err
    )


# ---- --auth-key-file --------------------------------------------------------------------------------------


def test_a_key_file_must_be_a_small_regular_file(tmp_path, capsys):
    """A FIFO (opening it would wait for a writer), /dev/zero, a 10 GB sparse file and a folder are
    refused before anything is read or connected; so is a file past 64 KiB."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sparse = tmp_path / "sparse"
    with sparse.open("wb") as f:
        f.truncate(10 << 30)
    big = tmp_path / "big"
    big.write_bytes(b"k" * ((64 << 10) + 1))
    cases = [
        (fifo, "not a regular file"),
        (Path("/dev/zero"), "not a regular file"),
        (tmp_path, "not a regular file"),
    ]
    cases += [(sparse, "larger than 64 KiB"), (big, "larger than 64 KiB")]
    for path, why in cases:
        rc, _, err = umbp(
            capsys, "stats", "--remote", "redis://127.0.0.1:1/0", "--auth-key-file", str(path), seconds=20
        )
        assert rc == 2 and f"'auth_key_file': cannot read '{path}': {why}" in err, err
    ok = tmp_path / "key"
    ok.write_text("0123456789abcdef0123456789abcdef\n")
    rc, _, err = umbp(capsys, "stats", "--remote", "redis://127.0.0.1:1/0", "--auth-key-file", str(ok))
    assert rc == 2 and "auth_key_file" not in err and "Connection refused" in err, err


# ---- umbp stats --metrics ---------------------------------------------------------------------------------


@contextmanager
def http_server(send: Callable[[socket.socket], None]) -> Iterator[str]:
    """A one-thread HTTP server on 127.0.0.1 that reads each request and hands the socket to `send`."""

    def handle(conn: socket.socket, _stop: threading.Event) -> None:
        conn.recv(65536)
        send(conn)

    with loopback_server(handle) as port:
        yield f"http://127.0.0.1:{port}/metrics"


def test_metrics_with_a_sample_that_is_not_a_number(capsys):
    body = b"vllm:umbp_stored_bytes_total 12\nvllm:umbp_hits_total abc\nvllm:umbp_misses_total NaN\n"
    reply = b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with http_server(lambda conn: conn.sendall(reply)) as url:
        rc, out, _ = umbp(capsys, "stats", "--metrics", url)
        assert rc == 0 and "stored_bytes" in out
        assert "note: 2 sample(s) whose value is not a finite number skipped (hits, misses)" in out
        rc, out, _ = umbp(capsys, "stats", "--metrics", url, "--json")
        report = json.loads(out)
        assert rc == 0 and report["metrics"] == {"stored_bytes": 12.0} and len(report["metrics_notes"]) == 1


def test_metrics_reply_is_bounded_in_size_and_time(capsys, monkeypatch):
    """An endless body stops at the size cap; a body sent a byte at a time stops at the deadline of the
    whole request (each read's timeout alone never fires)."""
    import umbp.tools.stats as stats

    monkeypatch.setattr(stats, "METRICS_MAX_BYTES", 1 << 20, raising=False)
    monkeypatch.setattr(stats, "METRICS_DEADLINE_S", 1.5, raising=False)

    def endless(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
        for _ in range(64):  # 8 MiB, then the server closes
            conn.sendall(b"vllm:umbp_x 1\n" * 10_000)

    with http_server(endless) as url:
        rc, _, err = umbp(capsys, "stats", "--metrics", url)
    assert rc == 2 and "the reply is larger than 1 MiB" in err, err

    def drip(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
        for _ in range(30):
            conn.sendall(b"v")
            time.sleep(0.2)

    with http_server(drip) as url:
        began = time.monotonic()
        rc, _, err = umbp(capsys, "stats", "--metrics", url, seconds=15)
        took = time.monotonic() - began
    assert rc == 2 and "no complete reply within 1.5 s" in err and took < 4, (err, took)


def test_metrics_url_must_be_http(tmp_path, capsys):
    local = tmp_path / "metrics.txt"
    local.write_text("vllm:umbp_stored_bytes_total 12\n")
    for url in (local.as_uri(), "ftp://127.0.0.1:9/metrics", "data:,vllm:umbp_x%201"):
        rc, out, err = umbp(capsys, "stats", "--metrics", url)
        assert rc == 2 and out == "" and "only http:// and https:// URLs are read" in err, err
