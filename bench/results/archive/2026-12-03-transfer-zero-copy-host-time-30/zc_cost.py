"""Probe: where the engine's zero-copy save loses against a bare copy kernel. Same process:
standalone kernels (2D int32 16 KiB tiles; 1D int64 8 KiB chunks; + psum-style checksum) writing 1 GiB
from scattered 16 KiB device rows to pinned host, and the engine's zero-copy save (16 KiB pages, slots in
runs) with and without its checksum. 3 rounds alternated, median of 5 each."""
import statistics
import time

import numpy as np
import torch
import triton
import triton.language as tl

from umbp.pool import Arena
from umbp.tools import bench_transfer as bt
from umbp.transfer import kernel as K

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
ROWS, COLS = 16, 256
TILE = ROWS * COLS  # int32 words: 16 KiB
n = GiB // (4 * TILE)
src = torch.randint(-2**31, 2**31 - 1, (2 * n * TILE,), dtype=torch.int32, device="cuda")
perm = torch.randperm(2 * n, device="cuda")[:n].to(torch.int32)
host = torch.empty(n * TILE, dtype=torch.int32, pin_memory=True)
wtab = torch.randint(0, 2**62, (4096,), dtype=torch.int64, device="cuda")
sums = torch.zeros(n, dtype=torch.int64, device="cuda")


@triton.jit
def plain2d(src, perm, dst, n, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    for j in range(tl.program_id(0), n, tl.num_programs(0)):
        p = tl.load(perm + j).to(tl.int64)
        tile = tl.load(src + p * ROWS * COLS + r)
        tl.store(dst + tl.cast(j, tl.int64) * ROWS * COLS + r, tile)


@triton.jit
def chunks1d(src, perm, dst, n, wtab, sums, W: tl.constexpr, BLOCK: tl.constexpr, CHECKSUM: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for j in range(tl.program_id(0), n, tl.num_programs(0)):
        p = tl.load(perm + j).to(tl.int64)
        s = (src + p * W).to(tl.pointer_type(tl.int64))
        d = (dst + tl.cast(j, tl.int64) * W).to(tl.pointer_type(tl.int64))
        s = tl.multiple_of(s, 16)
        d = tl.multiple_of(d, 16)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for w in range(0, W // 2, BLOCK):
            i = w + offs
            m = i < W // 2
            x = tl.load(s + i, mask=m, other=0)
            tl.store(d + i, x, mask=m)
            if CHECKSUM:
                acc += x * tl.load(wtab + (i >> 9), mask=m, other=0)
        if CHECKSUM:
            tl.atomic_add(sums + j, tl.sum(acc, axis=0), sem="relaxed")


class HostPtr:
    def __init__(self, t):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self):
        return self.t.data_ptr()


def wall(fn, reps=5):
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


base = bt.baseline(5)
print("baseline", {k: round(v, 1) for k, v in base.items()}, flush=True)
hp = HostPtr(host)
sms = torch.cuda.get_device_properties(0).multi_processor_count
fns = {
    "plain2d int32 16K tile": lambda: plain2d[(sms,)](src, perm, hp, n, ROWS, COLS, num_warps=4),
    "1d int64 1024 nochk": lambda: chunks1d[(sms,)](src, perm, hp, n, wtab, sums, TILE, 1024, False, num_warps=4),
    "1d int64 1024 chk": lambda: chunks1d[(sms,)](src, perm, hp, n, wtab, sums, TILE, 1024, True, num_warps=4),
    "1d int64 2048 nochk": lambda: chunks1d[(sms,)](src, perm, hp, n, wtab, sums, TILE, 2048, False, num_warps=4),
}
arena = Arena(2 * GiB + 64 * MiB, pinned=True, prefault=False)
page = 16 * KiB
groups = bt._layouts(page, 2 * (GiB // (4 * page)) + 8, "cuda")
case = bt.Case("16 KiB runs", groups, arena, GiB, 4, seed=page, slots="runs")
eng = bt._engine(arena, groups, "zero-copy", None)
saves = case.sets[0]


def engine_save():
    hs = [eng.save(b) for b in saves]
    for h in hs:
        h.wait()


orig = K.KernelEngine._save_zero_copy


def nochk(self, batch, keep):
    arena_rows = [self.arena_base + offs for _g, _m, _i, offs in batch]
    plan = self._plan(batch, [arena_rows], sums=True, stream=self._main(K.SAVE))
    self._copy(plan, None, 0, self._align16(batch, arena_rows), checksum=False)
    keep.append(plan.buf)
    return plan.sums()


def engine_save_nochk():
    K.KernelEngine._save_zero_copy = nochk
    try:
        engine_save()
    finally:
        K.KernelEngine._save_zero_copy = orig


fns["engine zero-copy save"] = engine_save
fns["engine zero-copy save, no checksum"] = engine_save_nochk
res = {k: [] for k in fns}
for _ in range(3):
    for k, fn in fns.items():
        res[k].append(GiB / wall(fn) / 1e9)
for k, v in res.items():
    m = statistics.median(v)
    print(f"{k:36s} {m:5.1f} GB/s ({m / base['d2h']:.3f})  [{min(v):.1f}-{max(v):.1f}]", flush=True)
