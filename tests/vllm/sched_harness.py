"""Drive vLLM 0.32's real Scheduler with the real UMBPConnector on both sides and no model.

The "GPU" is a set of CPU tensors laid out per vLLM's KV-cache config; a fake forward writes values that
depend only on the prompt and the position (attention: one value per token slot; recurrent state: one
value for "state after t tokens" filling the page). A restore is correct iff the restored request's
blocks hold exactly the values a recompute would have written.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from umbp.identity import ParallelSizes, RankCoord, dcp_rank
from umbp.replay.engine import make_scheduler
from umbp.vllm.compat import runner_output, speculative_lookahead_kwargs
from umbp.vllm.connector import UMBPConnector

HEADS, HEAD = 2, 8


def fake_model_dir(root: Path, eagle: bool = False, heads: int = 4, kv_heads: int = 2) -> Path:
    """A config-only Llama. DCP needs more TP ranks than KV heads and heads divisible by TP: the DCP tests
    use 8 heads and one KV head (MQA, like MLA)."""
    d = root / (
        ("fake_eagle" if eagle else "fake_model")
        + ("" if (heads, kv_heads) == (4, 2) else f"_h{heads}kv{kv_heads}")
    )
    d.mkdir(parents=True, exist_ok=True)
    arch = "EagleLlamaForCausalLM" if eagle else "LlamaForCausalLM"
    cfg = {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1 if eagle else 2,
        "vocab_size": 512,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@dataclass
class GroupDef:
    kind: str  # "fa" | "swa" | "mamba"
    block_size: int
    window: int = 0


def _spec(g: GroupDef):
    if g.kind == "fa":
        return FullAttentionSpec(
            block_size=g.block_size, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
        )
    if g.kind == "swa":
        return SlidingWindowSpec(
            block_size=g.block_size,
            num_kv_heads=HEADS,
            head_size=HEAD,
            dtype=torch.float32,
            sliding_window=g.window,
        )
    return MambaSpec(
        block_size=g.block_size, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )


@dataclass
class Harness:
    sched: Scheduler
    workers: list[UMBPConnector]
    caches: list[dict[str, torch.Tensor]]
    kv_cache_config: KVCacheConfig
    vllm_config: VllmConfig
    hasher: object
    groups: list[GroupDef]
    aggregator: KVOutputAggregator
    fail_next_load: bool = False
    failing_save_ranks: set[int] = field(default_factory=set)
    log: list[str] = field(default_factory=list)
    dcp: int = 1  # decode context parallel size: attention blocks span block_size * dcp tokens
    interleave: int = 1  # vLLM cp_kv_cache_interleave_size: consecutive tokens one DCP rank holds
    # per worker, per group: the layers it holds (pipeline parallel: each stage its own, maybe none)
    layers: list[list[list[str]]] = field(default_factory=list)

    # ---------------------------------------------------------------- requests
    def add(self, req_id: str, prompt: list[int], max_tokens: int = 3) -> Request:
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            pooling_params=None,
            block_hasher=self.hasher,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        self.sched.add_request(req)
        return req

    def run(self, max_steps: int = 200, max_idle_s: float = 30.0) -> None:
        """Step until every request is done. Steps that schedule nothing (requests waiting for a load on
        an I/O thread) do not count against max_steps, but may not go on for more than max_idle_s."""
        steps, idle_since = 0, None
        while self.sched.has_requests():
            so = self.step()
            if so.total_num_scheduled_tokens == 0:
                idle_since = idle_since or time.monotonic()
                assert time.monotonic() - idle_since < max_idle_s, "a load never finished"
                time.sleep(0.001)
                continue
            idle_since = None
            steps += 1
            assert steps < max_steps, "scheduler did not drain"

    def admit(self, req_id: str, max_idle_s: float = 30.0) -> None:
        """Step once (the lookup and, on a hit, the load starts), then until the load was reported:
        loads from the SSD or shared tier finish on an I/O thread, a step or more later."""
        self.step()
        t0 = time.monotonic()
        while req_id in self.umbp.loads:
            assert time.monotonic() - t0 < max_idle_s, "a load never finished"
            time.sleep(0.001)
            self.step()

    def step(self):
        so = self.sched.schedule()
        self.sched.update_from_output(so, self.execute(so))
        return so

    def execute(self, so) -> ModelRunnerOutput:
        """What the workers do for one SchedulerOutput: CoW copies, forward, loads, saves, reports."""
        ids = list(so.num_scheduled_tokens)
        outputs = []
        for rank, (worker, cache) in enumerate(zip(self.workers, self.caches)):
            self._apply_copies(cache, so)
            self._fake_forward(cache, so, rank)
            if rank in self.failing_save_ranks:
                worker._worker._start_save = _raise
            worker.bind_connector_metadata(so.kv_connector_metadata)
            if self.fail_next_load and so.kv_connector_metadata.loads and rank == len(self.workers) - 1:
                self._corrupt_arena(worker, so.kv_connector_metadata)
                self.fail_next_load = False
            worker.start_load_kv(None)
            worker.wait_for_save()
            res = worker.get_transfer_results(so.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
                kv_connector_stats=worker.get_kv_connector_stats(),
            )
            worker.clear_connector_metadata()
            sampled = [
                [7] if self.sched.requests[r].num_computed_tokens >= self.sched.requests[r].num_tokens else []
                for r in ids
            ]
            outputs.append(runner_output(ids, sampled, kv_out))
        return self.aggregator.aggregate(outputs)

    # ---------------------------------------------------------------- probes
    def local_hit(self, prompt: list[int]) -> int:
        """vLLM's own local prefix-cache hit for `prompt` right now (the number umbp must match)."""
        probe = Request(
            request_id="__probe__",
            prompt_token_ids=list(prompt),
            pooling_params=None,
            block_hasher=self.hasher,
            sampling_params=SamplingParams(max_tokens=1),
        )
        return self.sched.kv_cache_manager.get_computed_blocks(probe)[1]

    @property
    def umbp(self):
        return self.sched.connector._sched

    def leaks(self) -> dict:
        """Pins and held GPU blocks left behind once every request is done (all must be zero)."""
        pool = self.sched.kv_cache_manager.block_pool
        return {
            "index_pinned": self.umbp.index.stats()["pinned"],
            "pending_saves": len(self.umbp.saves),
            "pending_loads": len(self.umbp.loads),
            "gpu_blocks_held": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
        }

    # ---------------------------------------------------------------- fake GPU
    def _apply_copies(self, cache, so) -> None:
        for src, dst in so.kv_cache_block_copies or ():
            for t in cache.values():
                t[dst] = t[src]

    def _slot(self, p: int, block_size: int, rank: int) -> tuple[int, int] | None:
        """(block index in vLLM's table, offset in this rank's page) of token p, or None when another DCP
        rank holds it: vLLM's slot mapping interleaves a block's tokens over the DCP ranks."""
        dcp_rank = self.workers[rank]._worker.rank.dcp
        return shard_slot(p, block_size, self.dcp, dcp_rank, self.interleave)

    def _layers(self, rank: int, g: int) -> list[tuple[str, str | None]]:
        """(layer name, value salt) of each layer of group g on this worker: a layer other than the
        default one per group gets values of its own, so a restore into the wrong layer is caught."""
        names = self.layers[rank][g] if self.layers else [f"g{g}"]  # a harness built without build()
        return [(name, None if name == f"g{g}" else name) for name in names]

    def _fake_forward(self, cache, so, rank: int = 0) -> None:
        salt = self.workers[rank]._worker.rank.dcp if self.dcp > 1 else 0
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            end = req.num_computed_tokens  # already advanced by schedule()
            start = end - n
            block_ids = self.sched.kv_cache_manager.get_block_ids(req_id)
            for g, gdef in enumerate(self.groups):
                table = block_ids[g]
                for name, layer in self._layers(rank, g):
                    t = cache[name]
                    if gdef.kind == "mamba":
                        idx = (end - 1) // gdef.block_size
                        if idx < len(table) and table[idx]:
                            t[table[idx]] = state_value(req.all_token_ids, end, salt, layer)
                        continue
                    for p in range(start, end):
                        slot = self._slot(p, gdef.block_size, rank)
                        if slot is None:
                            continue
                        b = table[slot[0]]
                        if b:
                            t[b, slot[1]] = token_value(req.all_token_ids, p, layer)

    def _corrupt_arena(self, worker, meta) -> None:
        for job in meta.loads:
            for moves in job.moves.values():
                m = moves[0]
                worker._worker.arena.tensor_view(m.offset, 8).add_(1)
                return

    # ---------------------------------------------------------------- checks
    def held_values(self, req_id: str, tokens: int, rank: int = 0) -> list[str]:
        """Mismatches between what request `req_id`'s blocks hold and a recompute of [0, tokens)."""
        req = self.sched.requests[req_id]
        block_ids = self.sched.kv_cache_manager.get_block_ids(req_id)
        cache = self.caches[rank]
        salt = self.workers[rank]._worker.rank.dcp if self.dcp > 1 else 0
        bad = []
        for g, gdef in enumerate(self.groups):
            table = block_ids[g]
            for name, layer in self._layers(rank, g):
                t = cache[name]
                if gdef.kind == "mamba":
                    idx = (tokens - 1) // gdef.block_size
                    got = t[table[idx]].flatten()[0].item()
                    if got != state_value(req.all_token_ids, tokens, salt, layer):
                        bad.append(f"{name} state at {tokens}")
                    continue
                lo = 0 if gdef.kind == "fa" else max(0, tokens - gdef.window)
                for p in range(lo, tokens):
                    slot = self._slot(p, gdef.block_size, rank)
                    if slot is None:
                        continue  # another DCP rank's shard
                    b = table[slot[0]]
                    got = t[b, slot[1]].flatten()[0].item()
                    if got != token_value(req.all_token_ids, p, layer):
                        bad.append(f"{name} token {p}")
                        break
        return bad


def _raise(*args, **kwargs):
    raise OSError("injected save failure")


def _digest(tokens: list[int]) -> float:
    return float(int.from_bytes(hashlib.blake2b(repr(tokens).encode(), digest_size=3).digest(), "big"))


def token_value(tokens: list[int], p: int, layer: str | None = None) -> float:
    return _digest(list(tokens[: p + 1]) + ([("layer", layer)] if layer else []))


def state_value(tokens: list[int], t: int, salt: int = 0, layer: str | None = None) -> float:
    """The state after t tokens; ``salt`` (a DCP rank) makes each rank's copy distinct, so a rank that
    loaded another rank's state page would be caught; ``layer`` does the same for layers."""
    extra = ([("rank", salt)] if salt else []) + ([("layer", layer)] if layer else [])
    return -_digest(list(tokens[:t]) + extra) - 1.0


def shard_slot(
    p: int, block_size: int, dcp: int, dcp_rank: int, interleave: int = 1
) -> tuple[int, int] | None:
    """vLLM 0.32's DCP slot mapping (v1/worker/block_table.py): token p lies in block p // (B * dcp) of
    the request's table; within it, runs of ``interleave`` tokens go round-robin to the DCP ranks, and a
    rank packs its runs densely into its own B-token page. None: another rank holds p."""
    span = block_size * dcp
    offset = p % span
    if (offset // interleave) % dcp != dcp_rank:
        return None
    return p // span, offset // (dcp * interleave) * interleave + offset % interleave


def build(
    tmp_path: Path,
    groups: list[GroupDef],
    unit: int = 16,
    *,
    eagle: bool = False,
    tp: int = 1,
    num_blocks: int = 64,
    extra: dict | None = None,
    retention: int | None = 0,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 4096,
    dcp: int = 1,
    interleave: int = 1,
    eagle_groups: frozenset[int] = frozenset(),
    lookahead: bool = True,
    stage_layers: list[list[int]] | None = None,
    model_options: dict | None = None,
) -> Harness:
    """``stage_layers``: pipeline parallelism, one entry per stage with its number of layers of each group
    (0: none); vLLM's scheduler gets stage 0's KV-cache config, each stage's workers their own.
    ``dcp > 1``: vLLM's decode context parallelism over the ``tp`` ranks (tp >= dcp); block sizes in
    ``groups`` are per rank, as in vLLM's specs. ``eagle_groups``: groups annotated ``is_eagle_group``
    (DSpark confines the drop to its MLA group this way; none annotated: vLLM drops on every group).
    ``lookahead=False``: EAGLE with vLLM's plain block hashes where it has lookahead ones (0.34).
    ``model_options``: more ModelConfig arguments (e.g. ``hf_overrides``)."""
    heads = {"heads": 8, "kv_heads": 1} if dcp > 1 else {}
    model = ModelConfig(
        model=str(fake_model_dir(tmp_path, **heads)),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max_model_len,
        **(model_options or {}),
    )
    sched_cfg = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    block = groups[0].block_size
    cache = CacheConfig(
        block_size=block,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        prefix_match_unit=unit,
        prefix_cache_retention_interval=retention,
    )
    transfer = KVTransferConfig(
        kv_connector="UMBPConnector",
        kv_connector_module_path="umbp.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra or {"dram_bytes": 64 << 20},
    )
    spec = None
    if eagle:
        target = (
            ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)
            if dcp > 1
            else ParallelConfig()
        )
        spec = SpeculativeConfig(
            method="eagle",
            model=str(fake_model_dir(tmp_path, eagle=True, **heads)),
            num_speculative_tokens=1,
            target_model_config=model,
            target_parallel_config=target,
            **speculative_lookahead_kwargs(lookahead),
        )
    vllm_config = VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched_cfg,
        kv_transfer_config=transfer,
        speculative_config=spec,
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            cp_kv_cache_interleave_size=interleave,
            pipeline_parallel_size=len(stage_layers or [None]),
        ),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    stages = (
        [[[f"g{g}"] for g in range(len(groups))]]
        if stage_layers is None
        else [
            [[f"pp{st}.g{g}.{j}" for j in range(n)] for g, n in enumerate(counts)]
            for st, counts in enumerate(stage_layers)
        ]
    )
    configs = [_kv_cache_config(groups, names, num_blocks, retention, eagle_groups) for names in stages]
    kv_cache_config = configs[0]  # what vLLM hands the scheduler (generate_scheduler_kv_cache_config)
    sched, hasher = make_scheduler(vllm_config, kv_cache_config)
    with set_current_vllm_config(vllm_config):
        workers, caches, layers = [], [], []
        for st, (names, config) in enumerate(zip(stages, configs)):
            for r in range(tp):
                w = UMBPConnector(vllm_config, KVConnectorRole.WORKER, config)
                w._worker.rank = RankCoord(tp=r, dcp=dcp_rank(r, 0, ParallelSizes(tp=tp, dcp=dcp)), pp=st)
                cache_t = {}
                for g, gd in enumerate(groups):
                    for name in names[g]:
                        if gd.kind == "mamba":
                            cache_t[name] = torch.zeros(num_blocks, 4, 8)
                        else:
                            cache_t[name] = torch.zeros(num_blocks, gd.block_size, 2, HEADS, HEAD)
                w.register_kv_caches(cache_t)
                workers.append(w)
                caches.append(cache_t)
                layers.append(names)
    return Harness(
        sched,
        workers,
        caches,
        kv_cache_config,
        vllm_config,
        hasher,
        groups,
        KVOutputAggregator(len(workers)),
        dcp=dcp,
        interleave=interleave,
        layers=layers,
    )


def _kv_cache_config(groups, names, num_blocks, retention, eagle_groups) -> KVCacheConfig:
    """One stage's KV-cache config: ``names[g]`` are its layers of group g (perhaps none)."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=1, layers=[name], layer_stride=0, block_stride=0)
            for layer in names
            for name in layer
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(list(names[g]), _spec(gd), is_eagle_group=g in eagle_groups)
            for g, gd in enumerate(groups)
        ],
        prefix_cache_retention_interval=retention,
    )
