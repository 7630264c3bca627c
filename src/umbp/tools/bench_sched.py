"""`umbp bench sched`: what umbp's connector costs vLLM's scheduler, per step, beside the step itself.

vLLM's scheduler runs on the engine's critical path: every microsecond a connector spends in its hooks
is added to every step of every request, hit or not. Method: two real vLLM 0.32 Schedulers (no model,
the replay's recipe) hold the same N requests with the same prompts, one with umbp's connector
(scheduler role, simulated workers that acknowledge its jobs) and one without any connector; they are
stepped alternately, step by step, so both see the same machine load. For each step of the umbp
scheduler the time inside umbp's hooks is measured too. Reported per phase (prefill, then decode):
median step time of both schedulers, umbp's hook time, and the hook time as a share of the umbp
scheduler's step. Target: hooks <= 10% of a decode step (most decode steps store nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from umbp.tools.argtypes import counts, whole
from umbp.tools.benchutil import write_json

TARGET_SHARE = 0.10  # umbp hooks / umbp scheduler's decode step
LONG_SHARE, LONG_LOOKUP_MS = 0.05, 1.0  # --long: 128K-token prompts, 256 running requests
RELOOKUPS = 8  # stored prompts looked up again after the decode phase
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "get_kv_connector_stats",
    "take_events",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="small fast run (smoke test; not representative)"
    )
    parser.add_argument("--out", default="umbp-out/bench_sched.json", help="JSON path (default: %(default)s)")
    parser.add_argument("--layout", default="granite-4.0-h", help="replay layout (default: %(default)s)")
    parser.add_argument(
        "--requests",
        type=counts(1),
        default=None,
        help="running requests, comma list (default 32,128; quick 8)",
    )
    parser.add_argument(
        "--prompt", type=whole(1), default=None, help="prompt tokens per request (default 2000; quick 500)"
    )
    parser.add_argument(
        "--steps", type=whole(1), default=None, help="decode steps timed (default 300; quick 20)"
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help="long context, high concurrency: 131072-token prompts (8,192 units at 16 tokens), "
        "256 requests, 30 decode steps; targets: lookup <= 1 ms, hooks <= 5%% of a decode step",
    )


class _GcClock:
    """Garbage collections during the run (gc.callbacks): a hook's longest call can be a collection the
    interpreter happened to start inside it. With 256 x 131,072 prompt tokens the process holds 33.5 M
    token ints in vLLM's requests, and a full collection walks all of them."""

    def __init__(self) -> None:
        self.t0, self.worst_s, self.full = 0.0, 0.0, 0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
            return
        self.worst_s = max(self.worst_s, time.perf_counter() - self.t0)
        self.full += info.get("generation") == 2

    def close(self) -> dict[str, Any]:
        gc.callbacks.remove(self._cb)
        return {"longest_ms": self.worst_s * 1e3, "full_collections": self.full}


class _HookClock:
    """Wraps a connector instance's hooks; `spent` accumulates the seconds spent inside them."""

    def __init__(self, connector: Any) -> None:
        self.spent = 0.0
        self.lookups: list[float] = []  # seconds of each get_num_new_matched_tokens call (the lookup)
        for name in HOOKS:
            fn = getattr(connector, name, None)
            if fn is not None:
                setattr(connector, name, self._wrap(fn))

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.spent += dt
                if fn.__name__ == "get_num_new_matched_tokens":
                    self.lookups.append(dt)

        return timed


class _Side:
    """One scheduler with its requests, stepped with fake model outputs (one token per finished prefill)."""

    def __init__(self, layout: Any, with_umbp: bool, workdir: Path, prompts: list[list[int]]) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        from umbp.replay import engine as E
        from umbp.replay.simworker import SimWorkers

        eng = E.build_engine(layout, boundary_page=True, retention=0, workdir=workdir, connector=with_umbp)
        self.sched, self.now, self.eng, self.prompts = eng.sched, 0.0, eng, []
        self.clock = _HookClock(eng.connector) if with_umbp else None
        self.workers = SimWorkers(layout.timing, frozenset(eng.umbp.rank_tags)) if with_umbp else None
        # the prompts stored last: the LRU tier evicts the oldest first (a 256 x 128K run fills it)
        self.prompts, self.count = prompts[-RELOOKUPS:], len(prompts)
        for i, tokens in enumerate(prompts):
            self.sched.add_request(
                Request(
                    request_id=f"r{i}",
                    prompt_token_ids=tokens,
                    pooling_params=None,
                    block_hasher=eng.hasher,
                    sampling_params=SamplingParams(max_tokens=1 << 20, ignore_eos=True),
                )
            )

    def states(self) -> dict[str, int]:
        """Requests by vLLM status (finished ones are no longer held): what a failed check reports."""
        held = Counter(str(r.status) for r in self.sched.requests.values())
        return {**held, "finished": self.count - len(self.sched.requests)}

    def prefilling(self) -> bool:
        return any(r.num_computed_tokens < r.num_prompt_tokens for r in self.sched.requests.values())

    def step(self) -> tuple[float, float, int]:
        """(seconds in the scheduler's schedule() + update_from_output(), seconds inside umbp's hooks,
        requests scheduled). The simulated workers and the fake model output are not timed: in vLLM they
        are other processes' work."""
        from umbp.vllm.compat import runner_output

        before = self.clock.spent if self.clock else 0.0
        t0 = time.perf_counter()
        so = self.sched.schedule()
        spent = time.perf_counter() - t0
        out = None
        if self.workers is not None:
            self.workers.dispatch(so.kv_connector_metadata, self.now, self.now + 0.01)
            self.now += 0.01
            out = self.workers.collect(self.now)
        ids, reqs = list(so.num_scheduled_tokens), self.sched.requests
        sampled = [[1] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
        output = runner_output(ids, sampled, out)
        t0 = time.perf_counter()
        self.sched.update_from_output(so, output)
        spent += time.perf_counter() - t0
        return spent, (self.clock.spent if self.clock else 0.0) - before, len(ids)


def relookup(side: _Side) -> dict[str, Any]:
    """The connector's lookup of whole prompts it has stored (a returning conversation): a fresh request
    with the same tokens per call, asked from token 0, as vLLM asks when its GPU cache holds none of it."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    times, matched = [], []
    for i, tokens in enumerate(side.prompts):
        req = Request(
            request_id=f"again{i}",
            prompt_token_ids=tokens,
            pooling_params=None,
            block_hasher=side.eng.hasher,
            sampling_params=SamplingParams(max_tokens=1),
        )
        t0 = time.perf_counter()
        hit, _ = side.eng.connector.get_num_new_matched_tokens(req, 0)
        times.append(time.perf_counter() - t0)
        matched.append(hit or 0)
    return {
        "calls": len(times),
        "median_ms": statistics.median(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "median_matched_tokens": statistics.median(matched),
    }


def make_prompts(requests: int, prompt: int) -> list[list[int]]:
    """Random prompts, one list per request, shared by both sides (each Request copies only the list's
    references): 256 x 131,072 tokens are 33.5 M ints, so one copy instead of two, drawn by numpy
    instead of random.randrange (which alone took minutes at that size)."""
    rng = np.random.default_rng(1)
    return [rng.integers(1, 100_000, size=prompt).tolist() for _ in range(requests)]


def sized_layout(layout: Any, requests: int, prompt: int, steps: int) -> Any:
    """The layout with room for every request to run at once: vLLM's block pool is shared by all cache
    groups (each group takes its own blocks from it), and max_model_len must leave room for the decode
    steps (a prompt as long as max_model_len could never produce a token: the run would stall). A request
    decodes from the step its prefill ends, while the others still prefill: up to one token per prefill
    step of the run, which must not reach max_model_len either (it would end the request). The decoding
    requests take budget from the prefills too, and a prefill may end inside a step: at most this many."""
    budget = max(layout.max_num_batched_tokens - requests, 1)
    prefill_steps = -(-requests * prompt // budget) + requests
    tokens = prompt + prefill_steps + steps + 64
    per_request = sum(-(-tokens // layout.span(g)) + 1 for g in layout.groups)
    return dataclasses.replace(
        layout,
        max_num_seqs=max(requests, layout.max_num_seqs),
        num_gpu_blocks=max(requests * per_request + 16, layout.num_gpu_blocks),
        max_model_len=max(layout.max_model_len, tokens),
    )


def measure(layout: Any, requests: int, prompt: int, steps: int, workdir: Path) -> dict[str, Any]:
    gc_clock = _GcClock()
    prompts = make_prompts(requests, prompt)
    plain = _Side(layout, False, workdir, prompts)
    umbp = _Side(layout, True, workdir, prompts)
    del prompts
    phases: dict[str, list[tuple[float, float, float]]] = {"prefill": [], "decode": []}
    # bounded: every step schedules some prefill tokens, so the phase ends within this many steps
    limit = 2 * -(-requests * prompt // layout.max_num_batched_tokens) + 64
    while plain.prefilling() or umbp.prefilling():
        p, u = plain.step(), umbp.step()
        phases["prefill"].append((p[0], u[0], u[1]))
        if len(phases["prefill"]) > limit:
            raise RuntimeError(
                f"umbp bench sched: the prefill phase did not end in {limit} steps "
                f"(scheduled {p[2]} / {u[2]} requests in the last one)"
            )
    for _ in range(5):  # every request decoding on both sides
        plain.step(), umbp.step()
    for _ in range(steps):
        p, u = plain.step(), umbp.step()
        if not (p[2] == u[2] == requests):
            raise RuntimeError(
                f"umbp bench sched: expected {requests} decoding requests, got {p[2]} / {u[2]} "
                f"(states: {plain.states()} / {umbp.states()})"
            )
        phases["decode"].append((p[0], u[0], u[1]))
    looks = umbp.clock.lookups
    out: dict[str, Any] = {
        "requests": requests,
        "prompt_tokens": prompt,
        "lookup_first": {
            "calls": len(looks),
            "median_ms": statistics.median(looks) * 1e3,
            "max_ms": max(looks) * 1e3,
        },
        "lookup_stored": relookup(umbp),
        "gc": gc_clock.close(),
        "connector_totals": {k: umbp.eng.umbp.totals[k] for k in ("stored_objects", "evictions", "lookups")},
    }
    for name, rows in phases.items():
        plain_s, umbp_s, hooks_s = (statistics.median(col) for col in zip(*rows))
        out[name] = {
            "steps": len(rows),
            "plain_step_ms": plain_s * 1e3,
            "umbp_step_ms": umbp_s * 1e3,
            "hooks_ms": hooks_s * 1e3,
            "hooks_us_per_request": hooks_s * 1e6 / requests,
            # per step, then the median: robust to a step that a noisy neighbour slowed down
            "hooks_share": statistics.median(h / u for _p, u, h in rows),
        }
    return out


def run(args: argparse.Namespace) -> int:
    try:
        from umbp.replay.deployments import LayoutError, load_layout
    except ImportError as exc:
        print(f"umbp bench sched: needs vLLM ({exc})", file=sys.stderr)
        return 2
    try:
        layout = load_layout(args.layout)
    except LayoutError as exc:
        print(f"umbp bench sched: {exc}", file=sys.stderr)
        return 2
    running = args.requests or ([256] if args.long else [8] if args.quick else [32, 128])
    prompt = args.prompt or (131072 if args.long else 500 if args.quick else 2000)
    steps = args.steps or (30 if args.long else 20 if args.quick else 300)
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="umbp-bench-sched-") as tmp:
        for n in running:
            rows.append(measure(sized_layout(layout, n, prompt, steps), n, prompt, steps, Path(tmp)))
    decode_share = max(r["decode"]["hooks_share"] for r in rows)
    share = LONG_SHARE if args.long else TARGET_SHARE
    lookup_ok = all(lookup_met(r, LONG_LOOKUP_MS) for r in rows)
    report = {
        "command": "umbp " + " ".join(sys.argv[1:]),
        "layout": layout.name,
        "steps": steps,
        "target_decode_hooks_share": share,
        "target_lookup_ms": LONG_LOOKUP_MS if args.long else None,
        "rows": rows,
        "all_targets_met": decode_share <= share and (not args.long or lookup_ok),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_start_end": [load0, os.getloadavg()[0]],
        },
    }
    print(f"JSON: {write_json(args.out, report)}")
    print_table(report)  # the table comes last
    return 0


def print_table(report: dict[str, Any]) -> None:
    load = report["machine"]["loadavg_start_end"]
    print(
        f"umbp bench sched: vLLM's scheduler with and without umbp's connector, layout {report['layout']}, "
        f"stepped alternately, medians; load average {load[0]:.1f} on {report['machine']['cpus']} CPUs"
    )
    print(
        f"{'requests':>8} {'phase':>8} {'steps':>6} {'no connector ms':>16} {'umbp ms':>8} "
        f"{'umbp hooks ms':>14} {'us/request':>10} {'hooks share':>12} {'target':>7} result"
    )
    for r in report["rows"]:
        for phase in ("prefill", "decode"):
            p = r[phase]
            target = f"<={report['target_decode_hooks_share']:.0%}" if phase == "decode" else "-"
            verdict = (
                ("PASS" if p["hooks_share"] <= report["target_decode_hooks_share"] else "MISS")
                if phase == "decode"
                else "info"
            )
            print(
                f"{r['requests']:>8} {phase:>8} {p['steps']:>6} {p['plain_step_ms']:>16.3f} {p['umbp_step_ms']:>8.3f} "
                f"{p['hooks_ms']:>14.3f} {p['hooks_us_per_request']:>10.2f} {p['hooks_share']:>12.1%} "
                f"{target:>7} {verdict}"
            )
    target_ms = report.get("target_lookup_ms")
    for r in report["rows"]:
        first, stored = r["lookup_first"], r["lookup_stored"]
        verdict = "info" if target_ms is None else ("PASS" if lookup_met(r, target_ms) else "MISS")
        print(
            f"lookup, {r['requests']} requests of {r['prompt_tokens']} tokens: first ask median "
            f"{first['median_ms']:.3f} ms (max {first['max_ms']:.3f}); stored prompt asked again median "
            f"{stored['median_ms']:.3f} ms (max {stored['max_ms']:.3f}, {stored['median_matched_tokens']:.0f} "
            f"tokens matched) target {'-' if target_ms is None else f'both medians <= {target_ms} ms'} {verdict}"
        )
        print(
            f"garbage collection during the run: longest {r['gc']['longest_ms']:.1f} ms, "
            f"{r['gc']['full_collections']} full; connector: {r['connector_totals']}"
        )


def lookup_met(row: dict[str, Any], target_ms: float) -> bool:
    """Both medians (first ask, stored prompt asked again) within the target, and the stored prompts
    really found (a prompt the tier no longer holds is looked up as cheaply as a cold one)."""
    first, stored = row["lookup_first"], row["lookup_stored"]
    return max(first["median_ms"], stored["median_ms"]) <= target_ms and stored["median_matched_tokens"] > 0
