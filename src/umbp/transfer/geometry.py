"""Where one block's page of each layer lies in memory, as byte runs, and the object it maps to.

An umbp object for (group, block) is the concatenation, over the group's layers in order, of that layer's
page in logical row-major order (exactly what `index_select(block_dim, ids).movedim(block_dim, 0)
.contiguous()` yields, so objects are byte-identical to umbp.vllm.pages.GroupPages.gather). A page is
rarely one run of bytes: FlashAttention's [2, blocks, ...] layout splits it into a K half and a V half;
kernel-block splitting and padded Mamba page views add strides. So each layer's page is reduced once, at
registration, to a list of contiguous *segments* (offset from the block's base, length), and each segment
to *pieces* of at most `piece_bytes`, so one batch becomes a flat table of (src, dst, length) copies that
a single kernel can run with no per-page launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PIECE_BYTES = 64 * 1024  # a piece is one unit of work of the copy kernel; a multiple of 16


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's page: segments at `base + block * block_stride + seg_offsets[j]`, each `seg_bytes`."""

    base: int  # address of block 0's page (tensor.data_ptr(), includes the storage offset)
    block_stride: int  # bytes between consecutive blocks' pages
    num_blocks: int
    seg_offsets: np.ndarray  # int64 byte offsets from the block's base, in object (row-major) order
    seg_bytes: int  # every segment of a page has the same length

    @property
    def page_bytes(self) -> int:
        return int(self.seg_offsets.size) * self.seg_bytes

    def span(self) -> tuple[int, int]:
        """[first, last) address any block's page of this layer touches."""
        if not self.num_blocks or not self.seg_offsets.size:
            return self.base, self.base
        page_end = int(self.seg_offsets.max()) + self.seg_bytes
        return self.base, self.base + (self.num_blocks - 1) * self.block_stride + page_end


def _page_dims(tensor: torch.Tensor, block_dim: int) -> list[tuple[int, int]]:
    """(size, stride in elements) of every page dim larger than 1, in logical order."""
    dims = [(tensor.shape[d], tensor.stride(d)) for d in range(tensor.dim()) if d != block_dim]
    dims = [(size, stride) for size, stride in dims if size > 1]
    for _size, stride in dims:
        if stride <= 0:
            raise ValueError(
                f"umbp: a KV page dim has stride {stride}; overlapping/broadcast views are not pages"
            )
    return dims


def _check_pages_disjoint(tensor: torch.Tensor, block_dim: int) -> None:
    """Refuse a view in which two blocks' pages (or two bytes of one page) share memory: a block stride
    of 0 (an expanded view) or pages closer together than their extent. A load would write one page's
    bytes from two objects and verify both. The test: every dim larger than 1, by stride, must step
    past all the elements the smaller-stride dims reach (enough for every layout vLLM hands out; an
    interleaving it cannot prove disjoint is refused too)."""
    dims = sorted((tensor.stride(d), tensor.shape[d]) for d in range(tensor.dim()) if tensor.shape[d] > 1)
    reach = 1  # elements spanned by the dims seen so far
    for stride, size in dims:
        if stride < reach:
            raise ValueError(
                f"umbp: the pages of a KV tensor of shape {tuple(tensor.shape)}, strides {tensor.stride()} "
                f"(block dim {block_dim}) share memory: a block stride of 0 or pages closer than their "
                "extent; each block's page must be memory of its own"
            )
        reach += (size - 1) * stride


def layer_geometry(tensor: torch.Tensor, block_dim: int) -> LayerGeometry:
    """Reduce a KV/state tensor with its block dimension to contiguous segments (see module docstring)."""
    if not 0 <= block_dim < tensor.dim():
        raise ValueError(f"umbp: block dim {block_dim} is outside a tensor of shape {tuple(tensor.shape)}")
    if any(size == 0 for d, size in enumerate(tensor.shape) if d != block_dim):
        raise ValueError(f"umbp: a KV tensor of shape {tuple(tensor.shape)} has pages of zero bytes")
    elem = tensor.element_size()
    _check_pages_disjoint(tensor, block_dim)
    dims = _page_dims(tensor, block_dim)
    run = 1  # elements in the innermost contiguous run
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in dims:  # the remaining (outer) dims enumerate the segments, row-major
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
    return LayerGeometry(
        base=tensor.data_ptr(),
        block_stride=tensor.stride(block_dim) * elem,
        num_blocks=tensor.shape[block_dim],
        seg_offsets=offsets * elem,
        seg_bytes=run * elem,
    )


@dataclass(frozen=True)
class Template:
    """The pieces of one object, per layer segment cut into <= piece_bytes, as parallel int64 arrays:
    the copy of piece j for block b reads/writes `src[j] + b * stride[j]` and object bytes
    `[obj[j], obj[j] + nbytes[j])`."""

    src: np.ndarray
    stride: np.ndarray
    obj: np.ndarray
    nbytes: np.ndarray


class GroupGeometry:
    """The layers of one KV-cache group on this rank, and the piece template of its objects."""

    def __init__(self, layers: list[tuple[torch.Tensor, int]], piece_bytes: int = PIECE_BYTES):
        if not layers:
            raise ValueError("umbp: a transfer group needs at least one layer")
        self.tensors = [t for t, _ in layers]
        self.block_dims = [d for _, d in layers]
        self.layers = [layer_geometry(t, d) for t, d in layers]
        self.device = self.tensors[0].device
        if any(t.device != self.device for t in self.tensors):
            raise ValueError("umbp: the layers of one group must live on one device")
        self.num_blocks = min(layer.num_blocks for layer in self.layers)
        self.object_bytes = sum(layer.page_bytes for layer in self.layers)
        self.template = self._template(piece_bytes)

    def _template(self, piece_bytes: int) -> Template:
        src, stride, obj, nbytes = [], [], [], []
        off = 0
        for layer in self.layers:
            cuts = np.arange(0, layer.seg_bytes, piece_bytes, dtype=np.int64)
            lens = np.minimum(piece_bytes, layer.seg_bytes - cuts)
            seg_src = (layer.base + layer.seg_offsets)[:, None] + cuts[None, :]
            seg_obj = (
                off + (np.arange(layer.seg_offsets.size, dtype=np.int64) * layer.seg_bytes)[:, None] + cuts
            )
            src.append(seg_src.ravel())
            obj.append(seg_obj.ravel())
            nbytes.append(np.broadcast_to(lens, seg_src.shape).ravel())
            stride.append(np.full(seg_src.size, layer.block_stride, dtype=np.int64))
            off += layer.page_bytes
        return Template(*(np.ascontiguousarray(np.concatenate(a)) for a in (src, stride, obj, nbytes)))

    def alignment(self) -> int:
        """Largest of 16/8/1 dividing every piece's address, stride, object offset and length."""
        t = self.template
        acc = np.bitwise_or.reduce(np.concatenate([t.src, t.stride, t.obj, t.nbytes]))
        for align in (16, 8):
            if int(acc) % align == 0:
                return align
        return 1

    def check_blocks(self, block_ids: np.ndarray) -> None:
        if block_ids.size and (block_ids.min() < 0 or block_ids.max() >= self.num_blocks):
            raise ValueError(f"umbp: block id outside [0, {self.num_blocks}) in a transfer batch")
