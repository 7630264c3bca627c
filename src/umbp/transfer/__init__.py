"""The GPU data path: move KV pages and hybrid state pages between vLLM's paged KV tensors and umbp's
page-locked DRAM arena in bulk (see docs/transfer.md).

    from umbp.transfer import Moves, make_engine
    engine = make_engine(arena, {group: [(kv_tensor, block_dim), ...]})
    h = engine.save([Moves(group, block_ids, slot_offsets)])     # returns at once on CUDA
    digests = h.result()[0]                                        # psum64 per object
    h = engine.load([Moves(group, block_ids, slot_offsets, digests)])
    written = h.result()[0]                                        # False: slot bytes did not match

Backends: "kernel" (Triton; one launch per batch, writes/reads page-locked memory directly, async on the
engine's streams) and "staged" (index_select/index_copy_ per layer + a host copy per object; the CPU
path, exact and synchronous). Same API and same bytes: an object is every layer's page of one block,
concatenated in layer order, each page in row-major order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from umbp.pool import Arena
from umbp.transfer.api import Handle, Moves, TransferEngine
from umbp.transfer.geometry import GroupGeometry, LayerGeometry, layer_geometry

__all__ = [
    "GroupGeometry",
    "Handle",
    "LayerGeometry",
    "Moves",
    "TransferEngine",
    "layer_geometry",
    "make_engine",
    "triton_available",
]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def make_engine(
    arena: Arena,
    groups: Mapping[int, Sequence[tuple[torch.Tensor, int]]],
    backend: str = "auto",
    **options: Any,
) -> TransferEngine:
    """'auto': the kernel path when the pages are on CUDA, Triton imports and the arena is page-locked;
    else the staged path. `options` go to the kernel engine (ctas, block, num_warps, max_staging_bytes)."""
    devices = {t.device.type for layers in groups.values() for t, _ in layers}
    if backend == "auto":
        cuda = devices == {"cuda"}
        backend = "kernel" if cuda and arena.pinned and triton_available() else "staged"
    if backend == "kernel":
        from umbp.transfer.kernel_engine import KernelEngine

        return KernelEngine(arena, groups, **options)
    if backend == "staged":
        from umbp.transfer.staged import StagedEngine

        return StagedEngine(arena, groups)
    raise ValueError(f"umbp: unknown transfer backend {backend!r}; use 'auto', 'kernel' or 'staged'")
