"""Build vLLM 0.32's real Scheduler for a replay layout, with umbp's connector on the scheduler side.

What EngineCore does before its first step (resolve block sizes, hash block size, hit alignment, the
request block hasher), done here by hand on CPU with a config-only model directory: no weights, no
tokenizer, no GPU (the recipe in the project's vLLM notes, §6). Nothing here allocates KV-cache memory:
the specs only carry sizes, and the workers are simulated.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from umbp.replay.connector import ReplayConnector  # noqa: E402
from umbp.replay.deployments import GroupConfig, ReplayLayout  # noqa: E402
from umbp.vllm.compat import hash_lookahead_tokens, request_block_hasher  # noqa: E402

BF16 = 2


@dataclass
class Engine:
    sched: Scheduler
    connector: object | None  # the connector under test (ReplayConnector, or a peer's); None: no connector
    hasher: object
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig

    @property
    def umbp(self):
        """umbp's SchedulerSide (totals, restored, explain, index)."""
        return self.connector._sched


def model_dir(root: Path, max_model_len: int, eagle: bool = False, tp: int = 1) -> Path:
    """A config-only Llama directory (vLLM's ModelConfig needs one; nothing else is read). Under DCP, vLLM
    wants more TP ranks than KV heads and heads divisible by TP: then ``tp`` heads and one KV head (MQA,
    like MLA)."""
    heads, kv_heads = (tp, 1) if tp > 1 else (4, 2)
    suffix = f"-tp{tp}" if tp > 1 else ""
    d = root / ((f"eagle-{max_model_len}" if eagle else f"model-{max_model_len}") + suffix)
    d.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["EagleLlamaForCausalLM" if eagle else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1 if eagle else 2,
        "vocab_size": 1 << 17,
        "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }
    path = d / "config.json"
    if not path.exists() or json.loads(path.read_text()) != cfg:
        path.write_text(json.dumps(cfg))
    return d


def group_spec(g: GroupConfig, eagle_drop: bool):
    """A vLLM spec whose page_size_bytes is ``g.page_bytes`` (the only size the connector reads)."""
    if g.kind == "state":
        return MambaSpec(
            block_size=g.block_size,
            shapes=((g.page_bytes,),),
            dtypes=(torch.uint8,),
            mamba_cache_mode="align",
            num_prefill_checkpoint_blocks=int(g.checkpoint_alignment is not None),
            prefill_checkpoint_alignment=g.checkpoint_alignment,
        )
    if g.kind == "mla":
        if g.page_bytes % (g.block_size * BF16):
            raise ValueError(f"mla page_bytes {g.page_bytes} must be a multiple of 2 x block_size")
        return MLAAttentionSpec(
            block_size=g.block_size,
            num_kv_heads=1,
            head_size=g.page_bytes // (g.block_size * BF16),
            dtype=torch.bfloat16,
            non_causal_multi_token_decode=g.eagle and eagle_drop,
        )
    if g.page_bytes % (g.block_size * 2 * BF16):
        raise ValueError(f"attention page_bytes {g.page_bytes} must be a multiple of 4 x block_size")
    return FullAttentionSpec(
        block_size=g.block_size,
        num_kv_heads=1,
        head_size=g.page_bytes // (g.block_size * 2 * BF16),
        dtype=torch.bfloat16,
    )


def kv_cache_config(layout: ReplayLayout, retention: int, sized: bool = False) -> KVCacheConfig:
    """The layout's KV-cache config. ``sized``: tensors carry the byte sizes vLLM 0.32 gives them (every
    tensor spans the whole backing allocation: the largest group's bytes per block x blocks). umbp's
    connector reads only spec page sizes; vLLM's OffloadingConnector sizes its CPU chunks from the tensors,
    so its peer run needs them as vLLM would set them."""
    groups = []
    for i, g in enumerate(layout.groups):
        names = [f"g{i}.l{j}" for j in range(g.layers)]
        flagged = layout.eagle_drop and g.eagle
        groups.append(KVCacheGroupSpec(names, group_spec(g, layout.eagle_drop), is_eagle_group=flagged))
    size = max(g.object_bytes for g in layout.groups) * layout.num_gpu_blocks if sized else 1
    tensors = [
        KVCacheTensor(size=size, layers=list(grp.layer_names), layer_stride=0, block_stride=0)
        for grp in groups
    ]
    return KVCacheConfig(
        num_blocks=layout.num_gpu_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention,
    )


def make_scheduler(vllm_config: VllmConfig, kv_config: KVCacheConfig) -> tuple[Scheduler, object]:
    """vLLM's real Scheduler plus the request block hasher, resolved the way EngineCore does it."""
    with set_current_vllm_config(vllm_config):
        sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_config, vllm_config)
        kv_config.hash_block_size = hash_bs
        kv_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            kv_config, vllm_config, sched_bs, hash_bs
        )
        sched = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=sched_bs,
            hash_block_size=hash_bs,
            log_stats=True,
        )
        fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(fn)
        return sched, request_block_hasher(hash_bs, fn, hash_lookahead_tokens(vllm_config))


def build_engine(
    layout: ReplayLayout,
    *,
    boundary_page: bool,
    retention: int,
    workdir: Path,
    decode_saves: bool = False,
    connector: bool = True,
) -> Engine:
    """A fresh Scheduler + ReplayConnector (scheduler role) for one replay setting; `connector=False`:
    the same scheduler with no KV connector at all (`umbp bench sched` compares the two)."""
    extra = {
        "dram_bytes": int(layout.dram_gb_per_rank * 1e9),
        "boundary_page": boundary_page,
        "decode_saves": decode_saves,
    }
    transfer = KVTransferConfig(
        kv_connector="ReplayConnector",
        kv_connector_module_path="umbp.replay.connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    vllm_config = make_vllm_config(layout, retention, workdir, transfer if connector else None)
    kv_config = kv_cache_config(layout, retention)
    sched, hasher = make_scheduler(vllm_config, kv_config)
    if not connector:
        return Engine(sched, None, hasher, vllm_config, kv_config)
    built = sched.connector
    if not isinstance(built, ReplayConnector):
        raise RuntimeError(f"expected the ReplayConnector, vLLM built {type(built).__name__}")
    return Engine(sched, built, hasher, vllm_config, kv_config)


def make_vllm_config(
    layout: ReplayLayout, retention: int, workdir: Path, transfer: KVTransferConfig | None
) -> VllmConfig:
    """The VllmConfig of a replay: config-only model, the layout's scheduler limits, DCP and EAGLE, and
    ``transfer`` (the connector under test, or None)."""
    workdir.mkdir(parents=True, exist_ok=True)
    tp = layout.dcp  # DCP reuses the TP ranks: the smallest TP vLLM accepts for it
    model = ModelConfig(
        model=str(model_dir(workdir, layout.max_model_len, tp=tp)),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=layout.max_model_len,
    )
    parallel = ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=layout.dcp)
    sched_cfg = SchedulerConfig(
        max_num_seqs=layout.max_num_seqs,
        max_num_batched_tokens=layout.max_num_batched_tokens,
        max_model_len=layout.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(
        block_size=layout.groups[0].block_size,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        prefix_match_unit=layout.unit,
        prefix_cache_retention_interval=retention,
    )
    spec = None
    if layout.eagle_drop:
        spec = SpeculativeConfig(
            method="eagle",
            model=str(model_dir(workdir, layout.max_model_len, eagle=True, tp=tp)),
            num_speculative_tokens=1,
            target_model_config=model,
            target_parallel_config=ParallelConfig(
                tensor_parallel_size=tp, decode_context_parallel_size=layout.dcp
            ),
        )
    vllm_config = VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched_cfg,
        kv_transfer_config=transfer,
        speculative_config=spec,
        parallel_config=parallel,
    )
    vllm_config.cache_config.num_gpu_blocks = layout.num_gpu_blocks
    return vllm_config
