"""Translate vLLM's KV-cache configuration into umbp's engine-agnostic terms.

Both connector roles compute this from the same `KVCacheConfig`, so the scheduler's slot sizes and the
workers' namespace agree without any handshake.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
)

from umbp.hybrid import FullAttention, RecurrentState, SlidingWindow, check_context_parallel, resolve_groups
from umbp.identity import GroupLayout, ModelIdentity, ParallelSizes, RankCoord, all_ranks
from umbp.vllm.compat import eagle_block_drop, group_tag
from umbp.vllm.config import ARENA_PAGE
from umbp.vllm.model_options import model_options


class UnsupportedLayout(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    groups: tuple  # umbp.hybrid group specs, one per KV-cache group; block sizes per rank, as vLLM's specs
    unit: int  # prefix_match_unit == vLLM hash_block_size
    eagle_groups: frozenset[int]
    identity: ModelIdentity
    namespace: str
    ranks: tuple[RankCoord, ...]
    object_bytes: tuple[int, ...]  # per group: bytes one rank's object of that group may take (no padding)
    dcp: int = 1  # decode context parallel size: a sharded attention block spans block_size * dcp tokens
    pp: int = 1  # pipeline stages: each reports its own namespace and object sizes (umbp.vllm.stages)

    @property
    def spans(self) -> tuple:
        """The groups with ``block_size`` = tokens per block of vLLM's scheduler-side block table (DCP
        scales sharded attention groups): every block index the scheduler side computes uses these."""
        return resolve_groups(self.groups, self.dcp)


def stored_page_bytes(spec) -> int:
    """The bytes of one layer's page that umbp stores: the page's content, never vLLM's padding.

    vLLM's hybrid allocator pads every state page to the attention page size so that all groups share one
    block pool (it logs "Padding mamba page size by N%"); ``page_size_bytes`` is that padded size,
    ``real_page_size_bytes`` the content (for a Mamba page: its conv and SSM states, packed from the
    page's start). Storing the padding would fill the DRAM tier with bytes no restore needs."""
    real = getattr(spec, "real_page_size_bytes", None)
    return int(real) if real else int(spec.page_size_bytes)


def slot_span(nbytes: int) -> int:
    """The DRAM bytes an object of nbytes takes: the scheduler reserves whole arena pages, pad included.
    Slots reserved together touch end to start, and the transfer engine copies such a run in one piece."""
    return -(-nbytes // ARENA_PAGE) * ARENA_PAGE


def umbp_group(spec) -> object:
    """The umbp.hybrid group for a vLLM spec; `tag` keeps groups vLLM looks up separately apart (vLLM
    merges only groups whose specs are equal)."""
    check_restorable(spec)
    tag = group_tag(spec)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindow(
            block_size=spec.block_size, window=spec.sliding_window, tag=tag, dcp_sharded=spec.dcp_sharded
        )
    if isinstance(spec, FullAttentionSpec):
        return FullAttention(block_size=spec.block_size, tag=tag, dcp_sharded=spec.dcp_sharded)
    if isinstance(spec, MambaSpec):
        if spec.mamba_cache_mode != "align":
            raise UnsupportedLayout(
                f"umbp: Mamba group uses mamba_cache_mode={spec.mamba_cache_mode!r}; umbp restores hybrid "
                "state only in 'align' mode: start vLLM with --enable-prefix-caching (align is then the default)"
            )
        return RecurrentState(block_size=spec.block_size, tag=tag)
    raise UnsupportedLayout(
        f"umbp: KV-cache spec {type(spec).__name__} is not supported yet; umbp handles full attention "
        "(incl. MLA), sliding window and Mamba-style recurrent state"
    )


def check_restorable(spec) -> None:
    """Refuse pages whose bytes at a prefix boundary are not the prefix's alone.

    * A non-causal layer (a Prefix LM) computes a prefix's KV from the tokens after it too, so two prompts
      sharing a prefix hold different pages for it. vLLM turns its own prefix caching off for such a
      model, but it still hashes blocks for a KV connector: umbp would restore one prompt's pages into
      another.
    * A page that stores one state per several tokens (compressed KV such as DeepSeek-V4's sparse MLA) or
      several per token (pooled encoders) puts a boundary inside a state; umbp has not been proven there.
    """
    name = type(spec).__name__
    if isinstance(spec, MambaSpec):
        return  # one state per request and block: its own rules (vLLM 0.34 gives it tokens_per_state -1)
    if getattr(spec, "non_causal", False):
        raise UnsupportedLayout(
            f"umbp: KV-cache spec {name} attends non-causally (a Prefix LM): a prefix's pages depend on "
            "the tokens after it, so no prefix can be restored from a store; run this model without umbp"
        )
    per_state = getattr(spec, "tokens_per_state", 1)
    if per_state != 1:
        raise UnsupportedLayout(
            f"umbp: KV-cache spec {name} stores one state per {per_state} tokens (compressed or pooled KV); "
            "umbp restores pages of one state per token only, for now"
        )


def eagle_groups_of(vllm_config, kv_cache_config: KVCacheConfig) -> frozenset[int]:
    """The drop applies to annotated groups, or to every group when none is annotated; with lookahead block
    hashes (vLLM 0.34 under a connector that opts in) vLLM drops nothing, and neither may umbp."""
    if not eagle_block_drop(vllm_config):
        return frozenset()
    flagged = {i for i, g in enumerate(kv_cache_config.kv_cache_groups) if g.is_eagle_group}
    return frozenset(flagged or range(len(kv_cache_config.kv_cache_groups)))


def parallel_sizes(vllm_config) -> ParallelSizes:
    p = vllm_config.parallel_config
    return ParallelSizes(
        tp=p.tensor_parallel_size,
        pcp=getattr(p, "prefill_context_parallel_size", 1),
        dcp=getattr(p, "decode_context_parallel_size", 1),
        pp=p.pipeline_parallel_size,
    )


def check_parallel(sizes: ParallelSizes, groups: tuple) -> None:
    """One clear start-up line for a context-parallel setting umbp cannot serve.

    DCP is served: each rank saves and loads its own shard of every attention page (vLLM shards a block's
    tokens over the DCP ranks) and its own recurrent state; a hit needs every rank's shard. PCP is not:
    vLLM 0.32 runs it only in its V2 model runner, whose KV layout under PCP umbp has not been proven on.
    """
    if sizes.pcp > 1:
        raise UnsupportedLayout(
            f"umbp: prefill_context_parallel_size={sizes.pcp} is not supported (vLLM 0.32 runs PCP only in "
            "its V2 model runner, untested with umbp); use prefill_context_parallel_size=1 "
            "(TP, decode_context_parallel_size and PP are supported)"
        )
    try:
        check_context_parallel(groups, sizes.dcp, sizes.pcp)
    except ValueError as exc:
        raise UnsupportedLayout(f"umbp: decode_context_parallel_size={sizes.dcp}: {exc}") from None


def dcp_interleave(vllm_config, kv_cache_config: KVCacheConfig) -> int:
    """How many consecutive tokens of a sharded block one DCP rank holds (vLLM's slot mapping): another
    value means other bytes under the same key, so it is part of the namespace. Read the way the workers end
    up with it: vLLM adjusts it only in the worker processes (``adjust_dcp_kv_cache_interleave_size``): a
    set (deprecated) ``dcp_kv_cache_interleave_size`` overrides ``cp_kv_cache_interleave_size``, and beside
    a NixlConnector (1P1D) it becomes the smallest per-rank block size. The scheduler applies the same rules
    so that both roles name the same namespace."""
    parallel = vllm_config.parallel_config
    interleave = getattr(parallel, "cp_kv_cache_interleave_size", 1)
    legacy = getattr(parallel, "dcp_kv_cache_interleave_size", 1) or 1
    if legacy > 1:
        interleave = legacy
    transfer = vllm_config.kv_transfer_config
    nixl = (
        transfer is not None
        and hasattr(transfer, "has_connector")
        and transfer.has_connector("NixlConnector")
    )
    if nixl and getattr(parallel, "_allow_auto_resolve_cp_interleave_size", False):
        interleave = min(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups)
    return interleave


def memory_layouts(vllm_config) -> tuple[str | None, str | None]:
    """How vLLM lays out pages in memory beyond their shapes: the attention KV-cache layout a connector
    requires (NIXL asks for LBHNC, a P/D hand-off layout) and the Mamba conv-state layout
    (``VLLM_SSM_CONV_STATE_LAYOUT``: SD by default, DS beside NIXL). The same page size and dtype can
    then hold other bytes, so a non-default layout is part of the namespace: an instance beside NIXL and
    one without must never restore each other's pages. Defaults give None, so the namespaces of existing
    deployments do not change."""
    kv_layout = None
    for config in _configs_that_choose_the_layout(vllm_config):
        try:
            from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

            kv_layout = get_kv_connector_cache_layout(config)
        except Exception:  # a vLLM without that hook, or a connector class that cannot be resolved here
            kv_layout = None
        if kv_layout is not None:
            break
    conv = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT") or "SD"  # vLLM's get_conv_state_layout(), uncached
    return (str(kv_layout) if kv_layout is not None else None), (conv if conv != "SD" else None)


def _configs_that_choose_the_layout(vllm_config) -> list:
    """Inside a MultiConnector umbp is built with a child config naming only itself, but vLLM picks the
    KV-cache layout from the outer one (NIXL beside umbp asks for LBHNC): look at the config vLLM has
    current and at every enclosing MultiConnector's (umbp.vllm.compose) as well."""
    import copy

    from umbp.vllm.compose import enclosing_transfer_configs

    configs = [vllm_config]
    try:
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
    except Exception:  # noqa: BLE001 - a vLLM without it
        current = None
    if current is not None and current is not vllm_config:
        configs.append(current)
    for outer in enclosing_transfer_configs(getattr(vllm_config, "kv_transfer_config", None)):
        config = copy.copy(vllm_config)
        object.__setattr__(config, "kv_transfer_config", outer)
        configs.append(config)
    return configs


def _layout_extra(kind: str, kv_layout: str | None, conv_layout: str | None) -> tuple[tuple[str, str], ...]:
    if kind == "RecurrentState":
        return (("conv_state_layout", conv_layout),) if conv_layout else ()
    return (("kv_layout", kv_layout),) if kv_layout else ()


def _quant_extra(spec) -> tuple[tuple[str, str], ...]:
    """A quantized KV cache's mode: two modes can share a dtype and a page size (packed 4-bit data with
    different scale formats, say) and mean other values by the same bytes. None when unquantized, so the
    namespaces of existing deployments do not change."""
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is None or not int(mode):
        return ()
    return (("kv_quant_mode", getattr(mode, "name", str(mode))),)


def describe(vllm_config, kv_cache_config: KVCacheConfig, tenant: str = "") -> Layout:
    sizes = parallel_sizes(vllm_config)
    kv_groups = kv_cache_config.kv_cache_groups
    groups = tuple(umbp_group(g.kv_cache_spec) for g in kv_groups)
    check_parallel(sizes, groups)
    interleave = dcp_interleave(vllm_config, kv_cache_config) if sizes.dcp > 1 else None
    kv_layout, conv_layout = memory_layouts(vllm_config)
    unit = kv_cache_config.hash_block_size or vllm_config.cache_config.hash_block_size
    if not unit:
        unit = vllm_config.cache_config.block_size
    layouts = tuple(
        GroupLayout(
            kind=type(groups[i]).__name__,
            block_size=g.kv_cache_spec.block_size,
            layer_names=tuple(g.layer_names),
            # the stored (unpadded) size: a padded group's namespace differs from earlier versions', which
            # sized its objects by the padded page; their objects are a clean miss, never a size mismatch
            page_shapes=((stored_page_bytes(g.kv_cache_spec),),),
            dtypes=(str(getattr(g.kv_cache_spec, "dtype", getattr(g.kv_cache_spec, "dtypes", ""))),),
            extra=((("dcp_interleave", str(interleave)),) if interleave and groups[i].dcp_sharded else ())
            + _layout_extra(type(groups[i]).__name__, kv_layout, conv_layout)
            + _quant_extra(g.kv_cache_spec),
        )
        for i, g in enumerate(kv_groups)
    )
    spec_cfg = vllm_config.speculative_config
    model_cfg = vllm_config.model_config
    identity = ModelIdentity(
        model=str(model_cfg.model),
        revision=model_cfg.revision,
        dtype=str(model_cfg.dtype),
        groups=layouts,
        parallel=sizes,
        speculative_method=getattr(spec_cfg, "method", None) if spec_cfg else None,
        draft_model=str(getattr(spec_cfg, "model", None)) if spec_cfg else None,
        draft_revision=getattr(spec_cfg, "revision", None) if spec_cfg else None,
        prefix_hash_algo=str(vllm_config.cache_config.prefix_caching_hash_algo),
        tenant=tenant,
        model_options=model_options(model_cfg),
    )
    object_bytes = tuple(stored_page_bytes(g.kv_cache_spec) * len(g.layer_names) for g in kv_groups)
    return Layout(
        groups=groups,
        unit=int(unit),
        eagle_groups=eagle_groups_of(vllm_config, kv_cache_config),
        identity=identity,
        namespace=identity.namespace(),
        ranks=tuple(all_ranks(sizes)),
        object_bytes=object_bytes,
        dcp=sizes.dcp,
        pp=sizes.pp,
    )
