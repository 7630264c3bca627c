"""The Triton copy kernel: every piece of every object of a batch, run by a persistent grid.

Why a kernel instead of cudaMemcpy: the arena slots of a batch are scattered, and one DMA per 16 KiB page
runs at ~2.4 GB/s on an H200 (launch-bound). Page-locked host memory is mapped into the device's address
space (UVA), so SM loads/stores reach it directly over PCIe: one launch moves every page of a batch, in
either direction, with no device staging and no host memcpy. The same pass computes the psum64 of each
object (sum over 8-byte words of word * W[object row], see umbp.pool.psum) because the data is already in
registers.

The kernel also serves the DMA path (kernel.py): there it only moves pages between the KV tensors and a
contiguous device staging buffer, at HBM speed, and the copy engines move staging <-> arena.

Where each piece goes is worked out on the device, from two tables:
* `tmpl`, int64 [4, ntmpl], made once per engine: for each piece k of each group's objects, its KV
  address for block 0, bytes per block, offset inside the object, length (bytes). Group g's pieces start
  at column toff[g].
* `plan`, int64 words per launch: a segment table [4, nseg] (one segment per group share of the batch:
  first piece, first object, pieces per object, template column), then per object of the launch its
  block id and its rows (flat addresses of its bytes in the arena or in staging), then one word per
  object for its checksum. It is built on the host in page-locked memory and brought to the device by
  `fetch_words` (SM loads and stores, not a copy-engine copy: see kernel.py). Per object, not per piece: a round of
  16 KiB pages has 8x fewer words to build than a table of pieces (the host's main cost per call).

This module imports Triton, so only the kernel path imports it. With TRITON_INTERPRET=1 set before Triton
is first imported, the kernel runs on CPU tensors (Triton's interpreter; the tests use it).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit(do_not_specialize=["nseg", "n", "ids_at", "src_at", "dst_at", "sums_at"])
def copy_objects(plan, nseg, n, tmpl, ntmpl, ids_at, src_at, dst_at, sums_at, wtab, ok, BLOCK: tl.constexpr,
                 SRC_KV: tl.constexpr, DST_KV: tl.constexpr, CHECKSUM: tl.constexpr, GUARD: tl.constexpr,
                 ALIGN16: tl.constexpr, STORE: tl.constexpr = True):
    """n pieces. `*_at`: word offsets in `plan` of the block ids, the source and destination rows (unused
    on a KV side) and the checksums (added to atomically: several pieces make one object's sum)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    for p in range(pid, n, tl.num_programs(0)):
        s = p * 0
        for j in range(1, nseg):  # piece p's segment: the last starting at or before it (a scan: a batch
            # has one segment per group share, a handful; cached loads, negligible beside an 8 KiB piece)
            s = tl.where(p >= tl.load(plan + j), j, s)
        q = p - tl.load(plan + s)
        per = tl.load(plan + 2 * nseg + s)
        o = q // per
        t = tl.load(plan + 3 * nseg + s) + q - o * per  # template column
        obj = tl.load(plan + nseg + s) + o  # object index within the launch
        at = tl.load(tmpl + 2 * ntmpl + t)
        nw = tl.load(tmpl + 3 * ntmpl + t) // 8
        if SRC_KV:
            src_a = tl.load(tmpl + t) + tl.load(plan + ids_at + obj) * tl.load(tmpl + ntmpl + t)
        else:
            src_a = tl.load(plan + src_at + obj) + at
        if DST_KV:
            dst_a = tl.load(tmpl + t) + tl.load(plan + ids_at + obj) * tl.load(tmpl + ntmpl + t)
        else:
            dst_a = tl.load(plan + dst_at + obj) + at
        if ALIGN16:
            src_a = tl.multiple_of(src_a, 16)
            dst_a = tl.multiple_of(dst_a, 16)
            nw = tl.multiple_of(nw, 2)
        src = src_a.to(tl.pointer_type(tl.int64))
        dst = dst_a.to(tl.pointer_type(tl.int64))
        if GUARD:  # a piece of an object that failed verification moves nothing
            nw = tl.where(tl.load(ok + obj) != 0, nw, 0)
        objw = at // 8
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
            tl.atomic_add(plan + sums_at + obj, tl.sum(acc, axis=0), sem="relaxed")


@triton.jit(do_not_specialize=["n"])
def fetch_words(src, dst, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n] (elements of the pointers' type), one block per program, by SM loads and stores:
    how a plan in page-locked host memory reaches the device, and a call's results (digests, ok flags)
    reach page-locked host memory, without queueing on a copy engine behind bulk transfers."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst + i, tl.load(src + i, mask=m), mask=m)
