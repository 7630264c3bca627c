"""The `umbp` command. Each subcommand lives in its own module under umbp.tools and is imported lazily,
so `umbp --help` stays fast and `umbp bench pool` never imports vLLM."""

from __future__ import annotations

import argparse
import importlib
import sys

import umbp

# subcommand path -> (module, help). The module provides add_arguments(parser) and run(args) -> int.
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("bench", "pool"): ("umbp.tools.bench_pool", "DRAM pool put/get throughput vs a plain numpy copy"),
    ("bench", "transfer"): (
        "umbp.tools.bench_transfer",
        "GPU pages <-> page-locked arena vs a 1 GiB pinned copy (CUDA)",
    ),
    ("bench", "restore"): (
        "umbp.tools.bench_restore",
        "restore/save of N tokens vs a pinned copy of the same bytes, Granite-4.0-H-350M (CUDA)",
    ),
    ("bench", "remote"): (
        "umbp.tools.bench_remote",
        "shared Redis tier: 8,192-key lookup, put/get vs redis-benchmark",
    ),
    ("bench", "index"): (
        "umbp.tools.bench_index",
        "the scheduler's DRAM index at 1-30 M objects: us/op, bytes/object, pauses",
    ),
    ("bench", "sched"): (
        "umbp.tools.bench_sched",
        "what umbp's connector adds to vLLM's scheduler step (real Scheduler, no model)",
    ),
    ("bench", "ssd"): (
        "umbp.tools.bench_ssd",
        "SSD tier write/read throughput vs the disk's sequential bandwidth",
    ),
    ("chaos",): (
        "umbp.tools.chaos",
        "a fault campaign through real vLLM: every tier damaged, every output checked",
    ),
    ("demo",): (
        "umbp.tools.demo",
        "the hybrid restore at a boundary inside an attention block, on real vLLM (tiny random-weight model)",
    ),
    ("explain",): ("umbp.tools.explain", "why did a hybrid restore stop at T?"),
    ("replay",): (
        "umbp.tools.replay",
        "agentic traces on vLLM's real scheduler with umbp vs an oracle (no model)",
    ),
    ("stats",): ("umbp.tools.stats", "what umbp's SSD and shared tiers hold; a running vLLM's umbp counters"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="umbp", description=umbp.__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("version", help="print the umbp version")
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (module, help_text) in COMMANDS.items():
        if len(path) == 1:
            p = sub.add_parser(path[0], help=help_text, description=help_text)
        else:
            if path[0] not in groups:
                g = sub.add_parser(path[0], help=f"{path[0]} subcommands")
                groups[path[0]] = g.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            p = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        p.set_defaults(_module=module, _adder_done=False)
        _add_module_arguments(module, p)
    return parser


def _add_module_arguments(module: str, parser: argparse.ArgumentParser) -> None:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:  # a tool whose optional dependency is missing still shows up in --help
        parser.set_defaults(_import_error=str(exc))
        return
    mod.add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "version":
        print(f"umbp {umbp.__version__}")
        return 0
    if getattr(args, "_import_error", None):
        print(f"umbp {args.command}: cannot import its module: {args._import_error}", file=sys.stderr)
        return 2
    mod = importlib.import_module(args._module)
    if getattr(args, "out", None):
        from umbp.tools.benchutil import check_output

        name = " ".join(p for p in (args.command, getattr(args, "subcommand", None)) if p)
        check_output(f"umbp {name}", args.out, directory=getattr(mod, "OUT_IS_DIR", False))
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
