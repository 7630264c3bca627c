"""The Triton copy kernel: a flat table of (src, dst, words) pieces, run by a persistent grid.

Why a kernel instead of cudaMemcpy: the arena slots of a batch are scattered, and one DMA per 16 KiB page
runs at ~2.4 GB/s on an H200 (launch-bound). Page-locked host memory is mapped into the device's address
space (UVA), so SM loads/stores reach it directly over PCIe: one launch moves every page of a batch, in
either direction, with no device staging and no host memcpy. The same pass computes the psum64 of each
piece (sum over 8-byte words of word * W[object row], see umbp.pool.psum) because the data is already in
registers.

The kernel also serves the DMA path (kernel.py): there it only moves pages between the KV tensors and a
contiguous device staging buffer, at HBM speed, and the copy engines move staging <-> arena.

Descriptor table `desc`: int64 [5, n] rows = src address, dst address, length in 8-byte words, offset of
the piece inside its object in words, object index. On CUDA the table is built in page-locked host
memory and brought to the device by `fetch_words` (SM loads, not a copy-engine copy: see kernel.py). This module imports Triton, so only the kernel path
imports it. With TRITON_INTERPRET=1 set before Triton is first imported, the kernel runs on CPU tensors
(Triton's interpreter; the tests use it).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def copy_pieces(desc, n, wtab, partial, ok, BLOCK: tl.constexpr, CHECKSUM: tl.constexpr,
                GUARD: tl.constexpr, ALIGN16: tl.constexpr, STORE: tl.constexpr = True):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    for p in range(pid, n, tl.num_programs(0)):
        src_a = tl.load(desc + p)
        dst_a = tl.load(desc + n + p)
        nw = tl.load(desc + 2 * n + p)
        objw = tl.load(desc + 3 * n + p)
        if ALIGN16:
            src_a = tl.multiple_of(src_a, 16)
            dst_a = tl.multiple_of(dst_a, 16)
            nw = tl.multiple_of(nw, 2)
        src = src_a.to(tl.pointer_type(tl.int64))
        dst = dst_a.to(tl.pointer_type(tl.int64))
        if GUARD:  # a piece of an object that failed verification moves nothing
            nw = tl.where(tl.load(ok + tl.load(desc + 4 * n + p)) != 0, nw, 0)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for w in range(0, nw, BLOCK):
            i = w + offs
            m = i < nw
            x = tl.load(src + i, mask=m, other=0)
            if STORE:  # STORE=False: checksum only (verifying bytes a DMA copy brought in)
                tl.store(dst + i, x, mask=m)
            if CHECKSUM:
                wt = tl.load(wtab + ((objw + i) >> 9), mask=m, other=0)
                acc += x * wt
        if CHECKSUM:
            tl.store(partial + p, tl.sum(acc, axis=0))


@triton.jit
def fetch_words(src, dst, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n] for int64 words, one block per program: how a piece table in page-locked host
    memory reaches the device without queueing on a copy engine behind bulk transfers."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst + i, tl.load(src + i, mask=m), mask=m)
