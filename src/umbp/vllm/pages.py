"""A group's layers on this rank, and the scatter of object bytes back into vLLM's paged KV tensors.

Saves and arena loads go through umbp.transfer; `scatter` serves objects read from a tier that had no
DRAM slot to promote them into.

One object = the concatenation, over the group's layers on this rank, of that layer's page for one block.
Every layer is written with one `index_copy_` over all requested blocks (never one copy
per page), whatever the tensor layout: the block dimension is found from the tensor's shape (CPU
attention and Mamba page views put blocks first; GPU FlashAttention puts K/V first, blocks second).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerView:
    name: str
    tensor: torch.Tensor
    block_dim: int

    @property
    def page_bytes(self) -> int:
        return self.tensor.numel() // self.tensor.shape[self.block_dim] * self.tensor.element_size()


def block_view(tensor: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, int]:
    """Return (view, dim) where view.shape[dim] == num_blocks.

    Attention kernels may split each scheduler block into k kernel blocks (the tensor then has
    num_blocks * k rows); those k rows together are one umbp page, so the dim is unflattened.
    """
    for dim in (0, 1):
        if tensor.dim() > dim and tensor.shape[dim] >= num_blocks and tensor.shape[dim] % num_blocks == 0:
            k = tensor.shape[dim] // num_blocks
            return (tensor if k == 1 else tensor.unflatten(dim, (num_blocks, k))), dim
    raise ValueError(
        f"umbp: cannot find the block dimension ({num_blocks} blocks) in a KV tensor of shape "
        f"{tuple(tensor.shape)}; this KV-cache layout is not supported yet"
    )


class GroupPages:
    """The layers of one KV-cache group on this rank."""

    def __init__(self, layers: list[LayerView]):
        self.layers = layers
        self.object_bytes = sum(layer.page_bytes for layer in layers)
        self.offsets = []
        off = 0
        for layer in layers:
            self.offsets.append(off)
            off += layer.page_bytes

    def scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write a [n, object_bytes] uint8 tensor (any device) into the given blocks of every layer."""
        device = self.layers[0].tensor.device
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        data = data.to(device, non_blocking=True)
        n = len(block_ids)
        for layer, off in zip(self.layers, self.offsets):
            t = layer.tensor
            chunk = data[:, off : off + layer.page_bytes].contiguous().view(t.dtype)
            page_shape = list(t.shape)
            del page_shape[layer.block_dim]
            pages = chunk.view(n, *page_shape).movedim(0, layer.block_dim)
            t.index_copy_(layer.block_dim, ids, pages)


def group_pages(
    kv_caches: dict[str, torch.Tensor], layer_names: list[str], num_blocks: int
) -> GroupPages | None:
    layers = []
    for name in layer_names:
        tensor = kv_caches.get(name)
        if tensor is None:  # e.g. a layer that lives on another pipeline stage
            continue
        if isinstance(tensor, list | tuple):
            raise ValueError(
                f"umbp: layer {name!r} registers a list of KV tensors; umbp supports one tensor per layer"
            )
        view, dim = block_view(tensor, num_blocks)
        layers.append(LayerView(name, view, dim))
    return GroupPages(layers) if layers else None
