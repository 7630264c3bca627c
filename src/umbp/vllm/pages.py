"""A group's layers on this rank, and the scatter of object bytes back into vLLM's paged KV tensors.

Saves and arena loads go through umbp.transfer; `scatter` serves objects read from a tier that had no
DRAM slot to promote them into.

One object = the concatenation, over the group's layers on this rank, of that layer's page for one block.
A page is only its content: vLLM pads state pages (Mamba, GDN, short conv) to the attention page size, and
that padding is never stored nor written back (`stored_view` narrows a raw padded page to its states).
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
    kv_caches: dict[str, torch.Tensor],
    layer_names: list[str],
    num_blocks: int,
    page_bytes: int | None = None,
) -> GroupPages | None:
    """The group's layers on this rank. ``page_bytes`` is the content of one layer's page (vLLM's
    ``real_page_size_bytes``): a layer handed over as its raw padded page is narrowed to it, and a layer
    handed over as a list of state tensors (conv, SSM) becomes one view per state, in order, so its
    object holds the states packed as vLLM packs them in a page."""
    layers = []
    for name in layer_names:
        tensor = kv_caches.get(name)
        if tensor is None:  # e.g. a layer that lives on another pipeline stage
            continue
        parts = list(tensor) if isinstance(tensor, list | tuple) else [tensor]
        views = []
        for i, part in enumerate(parts):
            view, dim = block_view(part, num_blocks)
            views.append(LayerView(name if len(parts) == 1 else f"{name}[{i}]", view, dim))
        if page_bytes is not None and len(views) == 1 and views[0].page_bytes > page_bytes:
            views = [stored_view(views[0], page_bytes)]
        got = sum(v.page_bytes for v in views)
        if page_bytes is not None and got != page_bytes:
            raise ValueError(
                f"umbp: layer {name!r} registers {got} bytes per block but vLLM's spec says its page holds "
                f"{page_bytes}; this KV-cache layout is not supported yet"
            )
        layers += views
    return GroupPages(layers) if layers else None


def stored_view(layer: LayerView, page_bytes: int) -> LayerView:
    """The first ``page_bytes`` of each block's page, as bytes: vLLM packs a state page's states from the
    page's start and pads after them. Only a page that is one run of memory can be narrowed like this."""
    t = layer.tensor.movedim(layer.block_dim, 0)
    page = t[0]
    if not page.is_contiguous():
        raise ValueError(
            f"umbp: layer {layer.name!r}'s padded page (shape {tuple(t.shape[1:])}) is not contiguous; "
            "cannot separate its states from the padding"
        )
    flat = torch.as_strided(
        t, size=(t.shape[0], page.numel()), stride=(t.stride(0), 1), storage_offset=t.storage_offset()
    )
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    return LayerView(layer.name, raw[:, :page_bytes], 0)
