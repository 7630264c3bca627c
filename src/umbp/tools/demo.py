"""`umbp demo`: the hybrid restore at a boundary inside an attention block, on real vLLM, with a tiny random-weight hybrid model.

For each setting (umbp with the boundary page, and the old behaviour without it) one in-process vLLM engine
runs: turn 1 computes an 840-token prompt (umbp stores it); vLLM's local prefix cache is dropped; turn 2
resends the prompt (only umbp can supply a prefix now); turn 3 resends it once more with the local cache
warm (the reference: a plain local GPU prefix hit). The table compares the three.

`--restart ssd|redis` runs the cross-process version instead (umbp.tools.demo_restart); `--pd` a 1P1D
with a prefill and a decode instance (umbp.tools.pd).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from umbp.tools.argtypes import whole
from umbp.tools.benchutil import write_json
from umbp.tools.tiny_models import add_model_arguments, model_from_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, "tiny model architecture (default granite)")
    parser.add_argument("--prompt-tokens", type=whole(1), default=840)
    parser.add_argument("--unit", type=whole(1), default=16, help="vLLM --prefix-match-unit")
    parser.add_argument("--max-tokens", type=whole(1), default=8, help="tokens generated per turn")
    parser.add_argument("--out", default="umbp-out/demo.json", help="JSON result path")
    parser.add_argument("--only", choices=["umbp", "old"], help="run one setting only")
    parser.add_argument(
        "--restart",
        choices=["ssd", "redis"],
        help="instead: engine 1 (a process) computes the prompt and exits, engine 2 (a new "
        "process, empty DRAM) restores it from the SSD tier or a shared Redis tier",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="with --restart redis or --pd store: this server (default: start redis-server on 127.0.0.1)",
    )
    parser.add_argument(
        "--pd",
        nargs="?",
        const="auto",
        choices=["auto", "nixl", "store"],
        help="instead: a 1P1D (prefill and decode instance, a proxy) on this machine: 'nixl' "
        "(MultiConnector[NIXL, umbp] on P), 'store' (through umbp's shared tier); "
        "default nixl when importable",
    )


def run_setting(arch: str, model_dir: Path, prompt: list[int], args, boundary_page: bool) -> dict:
    from umbp.tools import vllm_harness as H

    transfer = H.umbp_transfer({"dram_gb": 0.25, "boundary_page": boundary_page})
    t0 = time.perf_counter()
    llm = H.make_llm_for_arch(arch, model_dir, kv_transfer_config=transfer, prefix_match_unit=args.unit)
    try:
        turn1 = H.run_prompt(llm, prompt, max_tokens=args.max_tokens)
        H.drop_gpu_prefix_cache(llm)
        turn2 = H.run_prompt(llm, prompt, max_tokens=args.max_tokens)
        sched = umbp_scheduler(llm)
        umbp_totals = dict(sched.totals) if sched is not None else {}
        dram = dram_footprint(llm, sched)
        turn3 = H.run_prompt(llm, prompt, max_tokens=args.max_tokens)
    finally:
        H.shutdown_llm(llm)
    max_dlp = max(abs(a - b) for a, b in zip(turn2.logprobs, turn3.logprobs))
    return {
        "boundary_page": boundary_page,
        "gpu_prefix_hit": turn3.num_cached_tokens,
        "umbp_counters_after_turn2": umbp_totals,
        "dram": dram,
        "restored_from_umbp": turn2.num_cached_tokens,
        "tokens_identical": turn2.token_ids == turn3.token_ids == turn1.token_ids,
        "max_abs_logprob_diff": max_dlp,
        "logprobs_identical": max_dlp <= 1e-5,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def dram_footprint(llm, sched) -> dict:
    """What the DRAM tier holds after turn 2, beside what vLLM's own specs say a block of each group
    takes (``page_size_bytes``: the padded page vLLM allocates; ``real_page_size_bytes``: its content),
    so the padding factor can be checked without trusting umbp's sizing: ``dram_used_bytes`` (arena pages
    taken) over the content of the objects stored."""
    if sched is None:
        return {}
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    groups = []
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        layers = len(group.layer_names)
        groups.append(
            {
                "kind": type(spec).__name__,
                "layers": layers,
                "vllm_page_bytes": spec.page_size_bytes * layers,
                "content_bytes": getattr(spec, "real_page_size_bytes", spec.page_size_bytes) * layers,
                "stored_objects": sched.totals.get(f"stored_objects_g{g}", 0),
            }
        )
    data = sum(g["content_bytes"] * g["stored_objects"] for g in groups)
    index = sched.index.stats()
    used = index["used_bytes"]
    return {
        "groups": groups,
        "dram_used_bytes": used,
        "reserved_objects": index["reserved"],  # saves in flight: their slots count in used
        "content_bytes_stored": data,
        "dram_bytes_per_data_byte": round(used / data, 4) if data else None,
    }


def umbp_scheduler(llm):
    """The scheduler-side umbp state of an in-process engine (None in multiprocess mode)."""
    try:
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    except AttributeError:
        return None
    return getattr(connector, "_sched", None)


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    model_dir = model_from_arguments("umbp demo", args)  # before vLLM's import: a bad --workdir fails fast
    from umbp.tools import vllm_harness as H

    if args.restart:
        return _run_restart(args, model_dir, t0)
    if args.pd:
        return _run_pd(args, model_dir, t0)
    prompt = H.random_prompt(args.prompt_tokens, seed=0)
    rows = []
    settings = [("old (no boundary page)", False), ("umbp", True)]
    for label, boundary_page in settings:
        if args.only and (args.only == "umbp") != boundary_page:
            continue
        print(f"umbp demo: running vLLM with {label} ...", flush=True)
        rows.append((label, run_setting(args.arch, model_dir, prompt, args, boundary_page)))
    result = {
        "arch": args.arch,
        "prompt_tokens": args.prompt_tokens,
        "prefix_match_unit": args.unit,
        "rows": {label: row for label, row in rows},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_json(args.out, result)
    print_table(result, rows, args.out)
    ok = all(
        row["tokens_identical"]
        and row["logprobs_identical"]
        and (row["restored_from_umbp"] == row["gpu_prefix_hit"] if row["boundary_page"] else True)
        for _, row in rows
    )
    return 0 if ok else 1


def _run_restart(args: argparse.Namespace, model_dir: Path, t0: float) -> int:
    from umbp.tools import demo_restart

    return _run_variant(demo_restart.run(args, model_dir), demo_restart.print_table, args, t0)


def _run_pd(args: argparse.Namespace, model_dir: Path, t0: float) -> int:
    from umbp.tools import pd

    return _run_variant(pd.run_demo(args, model_dir), pd.print_demo, args, t0)


def _run_variant(outcome: tuple[dict, bool], print_table, args: argparse.Namespace, t0: float) -> int:
    """Write a variant's result (with the wall time) as JSON, print its table; exit code 1 if it failed."""
    result, ok = outcome
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out = write_json(args.out, result)
    print_table(result)
    print(f"\n(wall time {result['wall_s']} s; JSON in {out})")
    return 0 if ok else 1


def print_table(result: dict, rows: list[tuple[str, dict]], out: str = "umbp-out/demo.json") -> None:
    print()
    print(
        f"{result['arch']} (tiny, random weights), prefix_match_unit={result['prefix_match_unit']}, "
        f"{result['prompt_tokens']}-token prompt; GPU prefix cache dropped between turns 1 and 2"
    )
    header = f"{'':24} {'GPU prefix hit':>14} {'Restored from umbp':>19}  Result"
    print(header)
    print("-" * len(header) + "-" * 30)
    for label, row in rows:
        same = row["tokens_identical"] and row["logprobs_identical"]
        verdict = "outputs identical" if same else "OUTPUTS DIFFER"
        verdict += f" (max |dlogprob| {row['max_abs_logprob_diff']:.1e})"
        print(f"{label:24} {row['gpu_prefix_hit']:>14} {row['restored_from_umbp']:>19}  {verdict}")
    for label, row in rows:
        c = row["umbp_counters_after_turn2"]
        if c.get("stored_data_bytes"):
            print(
                f"{label}: DRAM {c['stored_bytes']:,} bytes for {c['stored_data_bytes']:,} bytes of state and KV "
                f"({c['stored_bytes'] / c['stored_data_bytes']:.3f} DRAM bytes per data byte; padding not stored)"
            )
    print(f"\n(wall time {result['wall_s']} s; JSON in {out})")
    sys.stdout.flush()
