"""`umbp demo --restart ssd|redis`: a prefix computed by one vLLM process, restored by the next.

Engine 1 (a fresh process) computes the prompt and exits; umbp wrote its pages and states through to the
SSD tier (or the shared Redis tier). Engine 2 (another fresh process: empty GPU cache, empty DRAM tier)
sends the same prompt: umbp restores it from the tier, and the outputs must be identical. This is a
restarted engine (SSD) or a second instance reusing the first one's work (Redis, the 1P1D pattern).

Each turn runs as `python -m umbp.tools.demo_restart TURN_SPEC_JSON` and prints one `RESULT {json}` line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from umbp.tools.local_redis import LocalRedis


def one_turn(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine, one prompt, in this process: tokens, logprobs, vLLM's cached-token count, umbp counters."""
    from umbp.tools import vllm_harness as H
    from umbp.tools.demo import umbp_scheduler

    transfer = H.umbp_transfer(spec["extra"])
    llm = H.make_llm_for_arch(
        spec["arch"], spec["model_dir"], kv_transfer_config=transfer, prefix_match_unit=spec.get("unit", 16)
    )
    try:
        turn = H.run_prompt(
            llm,
            H.random_prompt(spec["prompt_tokens"], seed=spec.get("seed", 0)),
            max_tokens=spec.get("max_tokens", 8),
        )
        sched = umbp_scheduler(llm)
        totals = dict(sched.totals) if sched is not None else {}
    finally:
        H.shutdown_llm(llm)
    return {
        "tokens": turn.token_ids,
        "logprobs": turn.logprobs,
        "cached": turn.num_cached_tokens,
        "totals": totals,
    }


def run_turn_process(spec: dict[str, Any], timeout_s: float = 600) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "umbp.tools.demo_restart", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"umbp demo: an engine process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def run(args, model_dir: Path) -> tuple[dict[str, Any], bool]:
    """Both engines, one after the other; returns (result for the JSON and table, success)."""
    scratch = Path(tempfile.mkdtemp(prefix="umbp-demo-"))
    server = None
    try:
        if args.restart == "ssd":
            where = str(scratch / "ssd")
            extra: dict[str, Any] = {"dram_gb": 0.0625, "ssd_dirs": [where], "ssd_gb": 0.25}
        else:
            url = args.redis_url
            if url is None:
                try:
                    server = LocalRedis("umbp demo --restart redis", "--redis-url redis://host:port/db")
                except RuntimeError as exc:
                    raise SystemExit(str(exc)) from None
                url = server.url
            where = url
            extra = {"dram_gb": 0.0625, "remote": {"url": url}}
        spec = {
            "arch": args.arch,
            "model_dir": str(model_dir),
            "extra": extra,
            "unit": args.unit,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "seed": 0,
        }
        print("umbp demo: engine 1 (new process) computes the prompt ...", flush=True)
        first = run_turn_process(spec)
        print(f"umbp demo: engine 2 (new process, empty DRAM) restores from {args.restart} ...", flush=True)
        second = run_turn_process(spec)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    dlp = max((abs(a - b) for a, b in zip(first["logprobs"], second["logprobs"])), default=0.0)
    result = {
        "arch": args.arch,
        "prompt_tokens": args.prompt_tokens,
        "prefix_match_unit": args.unit,
        "restart_from": args.restart,
        "where": where,
        "engine1": _row(first),
        "engine2": _row(second),
        "tokens_identical": first["tokens"] == second["tokens"],
        "max_abs_logprob_diff": dlp,
    }
    ok = result["tokens_identical"] and dlp <= 1e-5 and second["cached"] > 0
    return result, ok


def _row(turn: dict[str, Any]) -> dict[str, Any]:
    t = turn["totals"]
    return {
        "cached_tokens": turn["cached"],
        "restored_tokens": t.get("restored_tokens", 0),
        "stored_objects": t.get("stored_objects", 0),
    }


def print_table(result: dict[str, Any]) -> None:
    tier = {"ssd": "the SSD tier", "redis": "the shared Redis tier"}[result["restart_from"]]
    print()
    print(
        f"{result['arch']} (tiny, random weights), prefix_match_unit={result['prefix_match_unit']}, "
        f"{result['prompt_tokens']}-token prompt; two vLLM processes, one after the other, sharing {tier}"
    )
    header = f"{'':36} {'cached tokens':>13}  what happened"
    print(header)
    print("-" * (len(header) + 40))
    e1, e2 = result["engine1"], result["engine2"]
    print(
        f"{'engine 1 (new process)':36} {e1['cached_tokens']:>13}  computed the prompt; "
        f"{e1['stored_objects']} objects written through to {result['where']}"
    )
    same = result["tokens_identical"] and result["max_abs_logprob_diff"] <= 1e-5
    verdict = "outputs identical" if same else "OUTPUTS DIFFER"
    print(
        f"{'engine 2 (new process, empty DRAM)':36} {e2['cached_tokens']:>13}  restored {e2['restored_tokens']} "
        f"tokens from {tier}; {verdict} (max |dlogprob| {result['max_abs_logprob_diff']:.1e})"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    print("RESULT " + json.dumps(one_turn(json.loads(sys.argv[1]))))
