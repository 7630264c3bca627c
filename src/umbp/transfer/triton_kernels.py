"""The Triton copy kernel: every piece of every object of a batch, run by a persistent grid.

Why a kernel instead of cudaMemcpy: the arena slots of a batch are scattered, and one DMA per 16 KiB page
runs at ~2.4 GB/s on an H200 (launch-bound). Page-locked host memory is mapped into the device's address
space (UVA), so SM loads/stores reach it directly over PCIe: one launch moves every page of a batch, in
either direction, with no device staging and no host memcpy. The same pass computes the psum64 of each
object (umbp.pool.checksum) because the data is already in registers: a checksumming launch walks each piece
as tiles of CROWS rows x 64 lanes, and for each of a row's 8 steps loads, stores and folds one word per
(row, lane) into that lane's Horner chain (acc * x**64 + w: six shifts and some xors, since the field's
polynomial is sparse); after the 8 steps each chain is multiplied once by its weight K[64*row + lane]
(64 shift-and-xor steps for 8 words) and the tile's results are xored into the object's digest word
(atomic xor: pieces of one object run in different programs). Launches without a checksum keep the
plain contiguous loop.

The kernel also serves the DMA path (kernel_engine.py): there it only moves pages between the KV tensors and a
contiguous device staging buffer, at HBM speed, and the copy engines move staging <-> arena.

Where each piece goes is worked out on the device, from two tables:
* `tmpl`, int64 [4, ntmpl], made once per engine: for each piece k of each group's objects, its KV
  address for block 0, bytes per block, offset inside the object, length (bytes). Group g's pieces start
  at column toff[g].
* `plan`, int64 words per call: a segment table [4, nseg] (one segment per group share of the batch:
  first piece, first object, pieces per object, template column), then per object its block id and its
  rows (offsets of its bytes from a base the launch passes: the arena, or its round's staging buffer),
  for a verified load the digest it expects, then one word per object for its checksum
  (umbp.transfer.plans). Each launch runs a range of the plan's pieces: one round of the call. It is
  built on the host in page-locked memory and brought to the device by `fetch_words` (SM loads and
  stores, not a copy-engine copy: see kernel_engine.py), once per call. Per object, not per piece: a
  call of 16 KiB pages has 8x fewer words to build than a table of pieces; one per call, not per round:
  each plan's build, buffer and fetch launch was ~0.1 ms of a slow host's time per round.

This module imports Triton, so only the kernel path imports it. With TRITON_INTERPRET=1 set before Triton
is first imported, the kernel runs on CPU tensors (Triton's interpreter; the tests use it).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class Launcher:
    """Launches one Triton kernel, skipping Triton's per-launch argument binding once a variant is
    compiled. A launch through `kernel[grid](...)` binds and specializes every argument in Python before
    the driver call: 31 us of host time per launch on the H200 host against 11 us for the direct call
    (bench/results/archive/2026-12-04-restore-link-speed-33/4-host-costs.txt), three or four launches
    per round of a transfer, which a restore (host planning in front of and between its copies) waits for.
    Here the first launch of each variant (its constexprs and warp count: every other argument is
    `do_not_specialize` or a buffer the engine allocates, so nothing else selects a variant) goes through
    Triton and returns the compiled kernel; later ones call its launcher directly. Any failure of the
    direct call (another Triton's internals) falls back to Triton's path for good; so does the
    interpreter."""

    def __init__(self, kernel: triton.JITFunction, device_index: int | None):
        self.kernel, self.device_index = kernel, device_index
        self.compiled: dict[tuple, object] = {}
        self.direct = device_index is not None and not interpreting()

    def __call__(self, grid: int, args: tuple, constexprs: tuple, names: tuple[str, ...], num_warps: int):
        key = (constexprs, num_warps)
        k = self.compiled.get(key) if self.direct else None
        if k is not None:
            try:
                stream = _raw_stream(self.device_index)
                k.run(grid, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args, *constexprs)
                return
            except (AttributeError, TypeError):
                self.direct = False  # this Triton's compiled kernels take other arguments: its own path
        k = self.kernel[(grid,)](*args, **dict(zip(names, constexprs)), num_warps=num_warps)
        if self.direct and k is not None:
            self.compiled[key] = k


def _raw_stream(device_index: int) -> int:
    import torch

    return torch._C._cuda_getCurrentRawStream(device_index)


@triton.jit
def mulx64(a):
    """a * x**64 in GF(2)[x] / (x**64 + x**4 + x**3 + x + 1), a uint64 (umbp.pool.checksum.gf64.mulx64)."""
    o = (a >> 60) ^ (a >> 61) ^ (a >> 63)
    return a ^ (a << 1) ^ (a << 3) ^ (a << 4) ^ o ^ (o << 1) ^ (o << 3) ^ (o << 4)


@triton.jit
def _bmul32(x, y):
    """Carry-less product of two values < 2**32 (uint64 tensors) by integer multiplies: each operand's
    bits are split into 4 classes by position mod 4, so every partial product has its set bits 4 apart
    and at most 8 terms meet at a position, whose carries stay inside the 3 bits of the other classes
    that the final masks drop."""
    m0 = 0x1111111111111111
    m1 = 0x2222222222222222
    m2 = 0x4444444444444444
    m3 = 0x8888888888888888
    x0, x1, x2, x3 = x & m0, x & m1, x & m2, x & m3
    y0, y1, y2, y3 = y & m0, y & m1, y & m2, y & m3
    z0 = (x0 * y0) ^ (x1 * y3) ^ (x2 * y2) ^ (x3 * y1)
    z1 = (x0 * y1) ^ (x1 * y0) ^ (x2 * y3) ^ (x3 * y2)
    z2 = (x0 * y2) ^ (x1 * y1) ^ (x2 * y0) ^ (x3 * y3)
    z3 = (x0 * y3) ^ (x1 * y2) ^ (x2 * y1) ^ (x3 * y0)
    return (z0 & m0) | (z1 & m1) | (z2 & m2) | (z3 & m3)


@triton.jit
def gf_mul(a, b):
    """a * b in the same field (uint64 tensors): a 64 x 64 carry-less product from three 32 x 32 ones
    (Karatsuba), then one fold of the high half."""
    a0 = a & 0xFFFFFFFF
    a1 = a >> 32
    b0 = b & 0xFFFFFFFF
    b1 = b >> 32
    lo = _bmul32(a0, b0)
    hi = _bmul32(a1, b1)
    mid = _bmul32(a0 ^ a1, b0 ^ b1) ^ lo ^ hi
    return lo ^ (mid << 32) ^ mulx64(hi ^ (mid >> 32))


@triton.jit
def _piece_checksum(src, dst, objw, nw, ktab, STORE: tl.constexpr, CROWS: tl.constexpr):
    """Copy (STORE) and checksum the piece's nw words, which are words [objw, objw + nw) of its object:
    the xor of its words' terms of the object's psum64 (less the length term)."""
    rows0 = tl.arange(0, CROWS)[:, None]
    lanes = tl.arange(0, 64)[None, :]
    part = tl.zeros([CROWS, 64], dtype=tl.uint64)
    r_end = (objw + nw + 511) // 512
    for rb in range(objw // 512, r_end, CROWS):
        rows = rb + rows0
        acc = tl.zeros([CROWS, 64], dtype=tl.uint64)
        base = rows * 512 + lanes - objw
        for m in tl.static_range(8):
            i = base + m * 64  # the word's index inside the piece
            msk = (i >= 0) & (i < nw)
            x = tl.load(src + i, mask=msk, other=0)
            if STORE:
                tl.store(dst + i, x, mask=msk)
            acc = mulx64(acc) ^ x.to(tl.uint64, bitcast=True)
        k = tl.load(ktab + rows * 64 + lanes, mask=rows < r_end, other=0).to(tl.uint64, bitcast=True)
        part ^= gf_mul(acc, k)
    return tl.xor_sum(tl.xor_sum(part, axis=1), axis=0)


@triton.jit(
    do_not_specialize=[
        "nseg",
        "first",
        "n",
        "ntmpl",
        "ids_at",
        "src_at",
        "src_base",
        "dst_at",
        "dst_base",
        "sums_at",
        "want_at",
        "out",
    ]
)
def copy_objects(
    plan,
    nseg,
    first,
    n,
    tmpl,
    ntmpl,
    ids_at,
    src_at,
    src_base: tl.int64,
    dst_at,
    dst_base: tl.int64,
    sums_at,
    want_at,
    ktab,
    out,
    BLOCK: tl.constexpr,
    SRC_KV: tl.constexpr,
    DST_KV: tl.constexpr,
    CHECKSUM: tl.constexpr,
    GUARD: tl.constexpr,
    ALIGN16: tl.constexpr,
    STORE: tl.constexpr = True,
    CROWS: tl.constexpr = 16,
    SPLIT: tl.constexpr = 1,
):
    """Pieces first..n-1 of the plan (a round of a call: one plan serves all of a call's launches).
    `*_at`: word offsets in `plan` of the block ids, the source and destination rows (unused on a KV
    side), the checksums (xored into atomically: several pieces make one object's digest) and the
    expected digests (pairs: digest less its length term, skip flag). A row is an offset from the
    launch's `src_base` / `dst_base` (the arena, or the round's staging buffer: a call's later rounds
    get their staging only when they are issued, after the plan was built). The bases are typed int64
    whatever their value, so that one compiled variant serves every launch. `ktab`: psum64's lane weights K
    (umbp.pool.checksum.gf64.lane_table), enough for the largest object. GUARD: an object whose checksum (made by
    an earlier launch over the same plan) is not the one expected moves nothing, and `out[obj]` (int64,
    page-locked host memory: the caller's result, no copy back needed) says whether it was written.
    SPLIT: each piece is run as that many parts (multiples of 512 bytes, the last shorter or empty),
    each by its own program: launches between KV pages and device staging run at HBM speed,
    where a 64 KiB piece per program leaves a small round (a restore's last verify and scatter) with
    too few programs to hide the memory's latency; launches that cross PCIe keep whole pieces."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    for pp in range(first * SPLIT + pid, n * SPLIT, tl.num_programs(0)):
        p = pp // SPLIT
        s = p * 0
        for j in range(1, nseg):  # piece p's segment: the last starting at or before it (a scan: a batch
            # has one segment per group share, a handful; cached loads, negligible beside an 8 KiB piece)
            s = tl.where(p >= tl.load(plan + j), j, s)
        q = p - tl.load(plan + s)
        per = tl.load(plan + 2 * nseg + s)
        o = q // per
        t = tl.load(plan + 3 * nseg + s) + q - o * per  # template column
        obj = tl.load(plan + nseg + s) + o  # object index within the call
        at = tl.load(tmpl + 2 * ntmpl + t)
        nw = tl.load(tmpl + 3 * ntmpl + t) // 8
        if SPLIT > 1:  # this program's part of the piece: words [lo, lo + nw) of it
            part = ((nw + SPLIT - 1) // SPLIT + 63) // 64 * 64
            lo = tl.minimum((pp - p * SPLIT) * part, nw)
            nw = tl.minimum(nw - lo, part)
            at += lo * 8
        else:
            lo = 0
        if SRC_KV:
            src_a = tl.load(tmpl + t) + tl.load(plan + ids_at + obj) * tl.load(tmpl + ntmpl + t) + lo * 8
        else:
            src_a = src_base + tl.load(plan + src_at + obj) + at
        if DST_KV:
            dst_a = tl.load(tmpl + t) + tl.load(plan + ids_at + obj) * tl.load(tmpl + ntmpl + t) + lo * 8
        else:
            dst_a = dst_base + tl.load(plan + dst_at + obj) + at
        if ALIGN16:
            src_a = tl.multiple_of(src_a, 16)
            dst_a = tl.multiple_of(dst_a, 16)
            nw = tl.multiple_of(nw, 2)
        src = src_a.to(tl.pointer_type(tl.int64))
        dst = dst_a.to(tl.pointer_type(tl.int64))
        if GUARD:  # a piece of an object that failed verification moves nothing
            good = (tl.load(plan + sums_at + obj) == tl.load(plan + want_at + 2 * obj)) | (
                tl.load(plan + want_at + 2 * obj + 1) != 0
            )
            nw = tl.where(good, nw, 0)
            first_part = (q == o * per) & (pp == p * SPLIT)
            tl.store(out + obj, good.to(tl.int64), mask=first_part)  # once per object: its first part
        if CHECKSUM:  # STORE=False: checksum only (verifying bytes a DMA copy brought in)
            h = _piece_checksum(src, dst, at // 8, nw, ktab, STORE, CROWS)
            tl.atomic_xor(plan + sums_at + obj, h.to(tl.int64, bitcast=True), sem="relaxed")
        else:
            for w in range(0, nw, BLOCK):
                i = w + offs
                m = i < nw
                x = tl.load(src + i, mask=m, other=0)
                if STORE:
                    tl.store(dst + i, x, mask=m)


@triton.jit(do_not_specialize=["src", "dst", "n"])
def fetch_words(src, dst, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n] (elements of the pointers' type), one block per program, by SM loads and stores:
    how a plan in page-locked host memory reaches the device, and a save's digests
    reach page-locked host memory, without queueing on a copy engine behind bulk transfers."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst + i, tl.load(src + i, mask=m), mask=m)
