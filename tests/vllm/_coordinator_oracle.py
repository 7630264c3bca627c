"""vLLM's real KV-cache coordinator (0.32, 0.33, 0.34) as an oracle for ``umbp.hybrid.longest_hit``.

The coordinator is built exactly as the engine builds it (``get_kv_cache_coordinator``), over a
``KVCacheConfig`` whose groups mirror the umbp groups. Its block pool's prefix-cache map is filled with one
fake ``KVCacheBlock`` per present object, so vLLM's own ``BlockPool.get_cached_block`` answers from the
present sets; a block's id encodes ``(group, token end)`` and turns the returned block lists back into load
sets. Nothing is allocated and no model, tokenizer or VllmConfig is needed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Sequence

import torch
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    make_block_hash_with_group_id,
    resolve_dcp_kv_block_size,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from umbp.hybrid import CacheGroup, FullAttention, RecurrentState, SlidingWindow
from umbp.vllm.compat import block_hash_map, coordinator_kwargs

_END = 10**9  # block id = group * _END + token end (ids > 0: 0 is vLLM's null block)


def vllm_spec(group: CacheGroup) -> KVCacheSpec:
    """The vLLM spec of a umbp group; ``tag`` picks the head size / state shape, so groups equal in umbp
    (same geometry and tag) are equal specs in vLLM, which looks them up jointly."""
    variant = 8 + int(group.tag or 0)
    if isinstance(group, FullAttention):
        return FullAttentionSpec(
            block_size=group.block_size,
            num_kv_heads=1,
            head_size=variant,
            dtype=torch.float32,
            dcp_sharded=group.dcp_sharded,
        )
    if isinstance(group, SlidingWindow):
        return SlidingWindowSpec(
            block_size=group.block_size,
            num_kv_heads=1,
            head_size=variant,
            dtype=torch.float32,
            sliding_window=group.window,
            dcp_sharded=group.dcp_sharded,
        )
    if isinstance(group, RecurrentState):
        return MambaSpec(
            block_size=group.block_size,
            shapes=((variant,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
        )
    raise TypeError(group)


def vllm_longest_hit(
    groups: Sequence[CacheGroup],
    unit: int,
    present: Sequence[Collection[int]],
    max_tokens: int,
    hashed_tokens: int,
    use_eagle: bool,
    flagged: Iterable[int] = (),
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
    lookahead: int = 0,
    draft: Iterable[int] = (),
) -> tuple[int, tuple[tuple[int, ...], ...], int]:
    """``(hit tokens, per-group load ends, hit alignment)`` from vLLM's coordinator.

    ``use_eagle``: EAGLE is on (``use_eagle_block_drop`` before lookahead); ``flagged``: groups annotated
    ``is_eagle_group`` (vLLM flags all when EAGLE is on and none is annotated). Group block sizes are per
    rank; the scheduler block size is the lcm of the DCP-resolved sizes, as ``resolve_kv_cache_block_sizes``
    computes it. Whatever vLLM refuses (an assertion in the coordinator or a manager) propagates.
    ``lookahead``: the coordinator's ``num_hash_lookahead_tokens``, which turns the drop off as vLLM's
    scheduler does; ``draft``: groups whose spec is a draft model's (``is_draft``, where vLLM has it).
    """
    flagged, draft = set(flagged), set(draft)
    kv_groups = [
        KVCacheGroupSpec([f"layer{g}"], _as_draft(vllm_spec(spec), g in draft), is_eagle_group=g in flagged)
        for g, spec in enumerate(groups)
    ]
    config = KVCacheConfig(
        num_blocks=2, kv_cache_tensors=[], kv_cache_groups=kv_groups, prefix_cache_retention_interval=None
    )
    sizes = [resolve_dcp_kv_block_size(g.kv_cache_spec, dcp_world_size) for g in kv_groups]
    coordinator = get_kv_cache_coordinator(
        config,
        max_model_len=1 << 20,
        max_in_flight_tokens=1 << 12,
        use_eagle=use_eagle and not lookahead,
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=dcp_world_size,
        pcp_world_size=pcp_world_size,
        scheduler_block_size=math.lcm(*sizes) if len(sizes) > 1 else sizes[0],
        hash_block_size=unit,
        **coordinator_kwargs(lookahead),
    )
    hashes = [BlockHash(t.to_bytes(8, "big")) for t in range(unit, hashed_tokens + 1, unit)]
    # the fake blocks live in a dict: where the map stores block ids, it resolves them through it
    fake_blocks: dict[int, KVCacheBlock] = {}
    cache = block_hash_map(blocks=fake_blocks)
    coordinator.block_pool.cached_block_hash_to_block = cache
    for g, ends in enumerate(present):
        for t in ends:
            if t <= hashed_tokens:
                key = make_block_hash_with_group_id(hashes[t // unit - 1], g)
                block = fake_blocks[g * _END + t] = KVCacheBlock(block_id=g * _END + t)
                cache.insert(key, block)
    blocks, tokens, _ = coordinator.find_longest_cache_hit(hashes, max_tokens)
    loads = []
    for g, group_blocks in enumerate(blocks):
        ends = [b.block_id for b in group_blocks if not b.is_null]
        assert all(i // _END == g for i in ends), f"group {g} got another group's block: {ends}"
        loads.append(tuple(i % _END for i in ends))
    alignment = getattr(coordinator, "_cache_hit_alignment_tokens", coordinator.scheduler_block_size)
    return tokens, tuple(loads), alignment


def _as_draft(spec: KVCacheSpec, draft: bool) -> KVCacheSpec:
    """``spec`` marked as a draft model's, where vLLM's specs carry ``is_draft``."""
    if not draft:
        return spec
    if "is_draft" not in {f.name for f in dataclasses.fields(spec)}:
        raise ValueError("this vLLM's KV-cache specs have no is_draft field")
    return dataclasses.replace(spec, is_draft=True)
