"""`umbp replay`: agentic traces through vLLM 0.32's real Scheduler with umbp, against an oracle.

    umbp replay                                   # the c70 headline: both layouts, page on/off x retention
    umbp replay --layout kimi-k3 --sessions 20    # smaller
    umbp replay --trace my.jsonl --layout granite-4.0-h
    umbp replay --write-trace trace.jsonl --sessions 280 --dry-run
    umbp replay --peers --retention 0             # + vLLM's OffloadingConnector in umbp's place (peer table)

No model runs and no GPU is needed: umbp's scheduler side decides, simulated workers acknowledge its
transfers after a modelled time. Writes replay.json, per-request JSONL and one PNG per layout to --out.
See docs/replay.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from umbp.tools.argtypes import number, whole

OUT_IS_DIR = True  # --out is a folder (umbp.cli checks it can be written before the run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layout",
        action="append",
        default=None,
        metavar="NAME|JSON",
        help="kimi-k3, granite-4.0-h or a layout JSON file (repeatable; default: both built-ins)",
    )
    parser.add_argument("--trace", help="replay this JSONL trace instead of generating one")
    parser.add_argument("--write-trace", metavar="PATH", help="write the (generated) trace as JSONL")
    parser.add_argument(
        "--sessions",
        type=whole(1, 100_000),
        default=280,
        help="generated sessions (default 280 = 4 per slot)",
    )
    parser.add_argument("--seed", type=whole(0, 2**32 - 1), default=0, help="generator seed")
    parser.add_argument("--concurrency", type=whole(1), default=70, help="sessions in flight (default 70)")
    parser.add_argument(
        "--boundary-page",
        choices=("both", "on", "off"),
        default="both",
        help="umbp's boundary page on, off (the old behaviour) or both (default)",
    )
    parser.add_argument(
        "--retention",
        default="0,layout",
        help="prefix_cache_retention_interval values, comma list; 'layout' = the layout's "
        "positive value (default 0,layout)",
    )
    parser.add_argument(
        "--drop",
        choices=("layout", "on", "off"),
        default="layout",
        help="EAGLE/DSpark-style drop (default: the layout's)",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="also run vLLM's OffloadingConnector (CPU backend, same DRAM budget; its copy step simulated) "
        "in umbp's place, per retention value, and print the peer table (docs/replay.md)",
    )
    parser.add_argument("--gpu-blocks", type=whole(4), help="override the layout's GPU block pool size")
    parser.add_argument(
        "--dram-gb", type=number(positive=True), help="override the layout's umbp DRAM per rank (GB)"
    )
    parser.add_argument(
        "--think-s", type=number(positive=True), help="generated traces: mean think time between turns (s)"
    )
    parser.add_argument(
        "--jobs", type=whole(1), default=1, help="settings run in parallel processes (default 1)"
    )
    parser.add_argument(
        "--hash-seed",
        type=whole(0, 2**32 - 1),
        default=0,
        help="PYTHONHASHSEED of the processes that run the settings (default 0): vLLM walks sets of "
        "request ids, so a fixed seed makes a run repeat exactly",
    )
    parser.add_argument("--out", default="umbp-out/replay", help="output directory")
    parser.add_argument(
        "--max-explain", type=whole(0), default=20, help="umbp explain texts kept per setting"
    )
    parser.add_argument(
        "--require",
        type=number(),
        metavar="PCT",
        help="exit 1 if a boundary-page-on setting restores less than PCT%% of the oracle's "
        "restorable tokens",
    )
    parser.add_argument("--print-layout", action="store_true", help="print the layout(s) as JSON and exit")
    parser.add_argument("--dry-run", action="store_true", help="build/write the trace and stop")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    import json

    from umbp.replay.deployments import LayoutError, load_layout
    from umbp.replay.trace import TraceError, check_trace_output

    try:
        layouts = [
            _overrides(load_layout(name), args) for name in (args.layout or ["kimi-k3", "granite-4.0-h"])
        ]
    except LayoutError as exc:
        print(f"umbp replay: {exc}", file=sys.stderr)
        return 2
    if args.print_layout:
        print(json.dumps([lay.to_dict() for lay in layouts], indent=2))
        return 0
    try:  # before the trace is read or generated: a bad value must not wait for that, or fail in a worker
        settings = _settings(args, layouts)
        if args.write_trace:
            check_trace_output(args.write_trace)
    except TraceError as exc:
        print(f"umbp replay: --write-trace: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"umbp replay: {exc}", file=sys.stderr)
        return 2
    turns = _turns(args)
    if turns is None:
        return 2
    if args.dry_run:
        print(
            f"umbp replay: {len(turns):,} turns, {sum(t.prompt_tokens for t in turns) / 1e6:.1f}M prompt tokens"
        )
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    summaries = _run_all(layouts, settings, turns, args)
    return _finish(layouts, summaries, args)


def _overrides(layout, args):
    drop = None if args.drop == "layout" else args.drop == "on"
    return layout.with_overrides(
        eagle_drop=drop, num_gpu_blocks=args.gpu_blocks, dram_gb_per_rank=args.dram_gb
    )


def _turns(args):
    from umbp.replay.generate import AgenticProfile, generate
    from umbp.replay.trace import TraceError, read_trace, write_trace

    if args.trace:
        try:
            turns = read_trace(args.trace)
        except (OSError, TraceError) as exc:
            print(f"umbp replay: {exc}", file=sys.stderr)
            return None
    else:
        profile = AgenticProfile(sessions=args.sessions, seed=args.seed)
        turns = generate(profile.scaled(think_s_mean=args.think_s))
    if args.write_trace:
        try:
            n = write_trace(turns, args.write_trace)
        except (OSError, TraceError) as exc:
            print(f"umbp replay: --write-trace: {exc}", file=sys.stderr)
            return None
        print(f"umbp replay: wrote {n:,} turns to {args.write_trace}")
    return turns


def _settings(args, layouts) -> dict[str, list]:
    """The settings to run per layout; ValueError (its message for the user) on a bad --retention."""
    from umbp.replay.driver import Setting

    pages = {"both": (True, False), "on": (True,), "off": (False,)}[args.boundary_page]
    out = {}
    for lay in layouts:
        rets = []
        for item in args.retention.split(","):
            value = lay.retention if item.strip() == "layout" else _retention(item, lay)
            if value not in rets:
                rets.append(value)
        out[lay.name] = [Setting(p, r) for r, p in itertools.product(rets, pages)]
        if args.peers:
            out[lay.name] += [Setting(False, r, "offloading") for r in rets]
    return out


def _retention(item: str, layout) -> int:
    block = layout.scheduler_block_size
    try:
        value = int(item)
    except ValueError:
        value = -1
    if value < 0 or value % block:
        raise ValueError(
            f"--retention {item.strip()!r}: each value must be 'layout' or a non-negative multiple of "
            f"layout {layout.name}'s scheduler block size {block}"
        )
    return value


# ------------------------------------------------------------------------------------------ running


def _one(layout, setting, turns, concurrency: int, workdir: str, max_explain: int, progress=None) -> tuple:
    """Run one setting (in this process or a worker); returns (summary, per-request records as dicts)."""
    from umbp.replay.driver import replay
    from umbp.replay.report import refused_summary, summarize

    counter = {"n": 0}

    def tick(_rec) -> None:
        counter["n"] += 1
        if progress is not None and counter["n"] % 25 == 0:
            progress.put(25)

    try:
        result = replay(
            layout, setting, turns, concurrency, Path(workdir), on_finish=tick, max_explain=max_explain
        )
    except Exception as exc:  # noqa: BLE001 - a peer that refuses the layout is a result, reported verbatim
        if setting.connector == "umbp":
            raise
        if progress is not None:
            progress.put(len(turns) - counter["n"])
        return refused_summary(layout.name, setting, f"{type(exc).__name__}: {exc}"), []
    if progress is not None:
        progress.put(counter["n"] % 25)
    return summarize(result, max_examples=max_explain), [r.to_json() for r in result.records]


def _run_all(layouts, settings, turns, args) -> dict[tuple[str, str], tuple]:
    """Each (layout, setting) run in a spawned process whose string hashing is seeded with --hash-seed:
    vLLM's scheduler and its OffloadingConnector walk sets of request ids (finished loads, for one),
    whose order follows the process's hash seed. Under eviction that order decides which blocks the
    peer's LRU drops first, and the same command gave its Granite row 20.28% or 20.60% by the hash seed."""
    from multiprocessing import Manager

    jobs = [(lay, s) for lay in layouts for s in settings[lay.name]]
    workdir = str(Path(args.out) / "work")
    total = len(jobs) * len(turns)
    bar = _bar(total, args)
    t0 = time.perf_counter()
    with Manager() as manager, seeded_pool(max(1, args.jobs), args.hash_seed) as pool:
        queue = manager.Queue()
        futures = {}
        for lay, s in jobs:
            future = pool.submit(_one, lay, s, turns, args.concurrency, workdir, args.max_explain, queue)
            futures[future] = (lay.name, s.label)
        while any(not f.done() for f in futures):
            _drain(queue, bar, timeout=0.5)
        _drain(queue, bar, timeout=0)
        results = {key: f.result() for f, key in futures.items()}
    if bar is not None:
        bar.close()
    print(f"umbp replay: {len(jobs)} runs in {time.perf_counter() - t0:.0f} s wall", file=sys.stderr)
    return results


@contextmanager
def seeded_pool(workers: int, hash_seed: int) -> Iterator:
    """A pool of spawned processes that start with PYTHONHASHSEED=hash_seed. Workers spawn lazily, on
    submits, so the variable stays set in this process for the pool's life; it is restored after."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    before = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = str(hash_seed)
    try:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as executor:
            yield executor
    finally:
        if before is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = before


def _drain(queue, bar, timeout: float) -> None:
    import queue as q

    try:
        n = queue.get(timeout=timeout) if timeout else queue.get_nowait()
        while True:
            if bar is not None:
                bar.update(n)
            n = queue.get_nowait()
    except q.Empty:
        return


def _bar(total: int, args):
    if args.no_progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", desc="umbp replay", file=sys.stderr, dynamic_ncols=True)


# ------------------------------------------------------------------------------------------ output


def _finish(layouts, results, args) -> int:
    from umbp.replay.report import header_line, peer_payload, peer_table, plot, table, verdict, write_json

    out = Path(args.out)
    payload = {
        "concurrency": args.concurrency,
        "trace": args.trace or f"generated, seed {args.seed}",
        "layouts": {},
        "verdict": [],
    }
    failed = False
    for lay in layouts:
        every = [results[key][0] for key in results if key[0] == lay.name]
        summaries = [s for s in every if "refused" not in s]
        for s in summaries:
            _write_records(
                out / f"requests-{lay.name}-{_slug(s['label'])}.jsonl", results[(lay.name, s["label"])][1]
            )
        head = header_line(lay.summary(), summaries[0])
        print()
        print(table(summaries, head))
        if args.peers:
            print()
            print(peer_table(every, f"peers, {head}"))
        lines = verdict(summaries)
        print("\n".join(lines))
        payload["verdict"] += lines
        payload["layouts"][lay.name] = {"layout": lay.to_dict(), "settings": every}
        if not args.no_plots:
            png = plot(summaries, head, out / f"replay-{lay.name}.png")
            print(f"plot: {png}" if png else "plot: skipped (matplotlib not installed)")
        if args.require is not None:
            failed |= any(
                s["restored_fraction_of_restorable"] * 100 < args.require
                for s in summaries
                if s["boundary_page"]
            )
    write_json(out / "replay.json", payload)
    if args.peers:
        write_json(out / "peers.json", peer_payload(payload))
    print(f"\nJSON: {out / 'replay.json'}; per-request records: {out}/requests-*.jsonl")
    sys.stdout.flush()
    return 1 if failed else 0


def _slug(label: str) -> str:
    return label.replace(", ", "-").replace(" ", "")


def _write_records(path: Path, records: list[dict]) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
