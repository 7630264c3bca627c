"""Probe: do TMA (tensor-descriptor) stores/loads to page-locked host memory cross PCIe faster than plain
SM stores/loads? 1 GiB of 16 KiB tiles gathered from scattered device rows -> contiguous pinned host
(D2H), and the reverse (H2D), against one 1 GiB copy-engine copy. Median of 5 after warm-up."""
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

print("triton", triton.__version__, flush=True)
GiB = 1 << 30
ROWS, COLS = 16, 256  # one tile: 16 x 256 int32 = 16 KiB
TILE = ROWS * COLS
n = GiB // (4 * TILE)
src = torch.randint(-2**31, 2**31 - 1, (2 * n * TILE,), dtype=torch.int32, device="cuda")
perm = torch.randperm(2 * n, device="cuda")[:n].to(torch.int32)
host = torch.empty(n * TILE, dtype=torch.int32, pin_memory=True)
dev_out = torch.empty(2 * n * TILE, dtype=torch.int32, device="cuda")


def alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


triton.set_allocator(alloc)


@triton.jit
def d2h_plain(src, perm, dst, n, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    for j in range(tl.program_id(0), n, tl.num_programs(0)):
        p = tl.load(perm + j).to(tl.int64)
        tile = tl.load(src + p * ROWS * COLS + r)
        tl.store(dst + tl.cast(j, tl.int64) * ROWS * COLS + r, tile)


@triton.jit
def d2h_tma(src, perm, dst, n, ROWS: tl.constexpr, COLS: tl.constexpr):
    desc = tl.make_tensor_descriptor(dst, shape=[n * ROWS, COLS], strides=[COLS, 1], block_shape=[ROWS, COLS])
    r = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    for j in range(tl.program_id(0), n, tl.num_programs(0)):
        p = tl.load(perm + j).to(tl.int64)
        tile = tl.load(src + p * ROWS * COLS + r)
        desc.store([j * ROWS, 0], tile)


@triton.jit
def d2h_tma_arg(src, perm, desc, n, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    for j in range(tl.program_id(0), n, tl.num_programs(0)):
        p = tl.load(perm + j).to(tl.int64)
        tile = tl.load(src + p * ROWS * COLS + r)
        desc.store([j * ROWS, 0], tile)


@triton.jit
def h2d_tma_arg(desc, perm, dst, n, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    for j in range(tl.program_id(0), n, tl.num_programs(0)):
        p = tl.load(perm + j).to(tl.int64)
        tile = desc.load([j * ROWS, 0])
        tl.store(dst + p * ROWS * COLS + r, tile)


@triton.jit
def h2d_plain(src, perm, dst, n, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    for j in range(tl.program_id(0), n, tl.num_programs(0)):
        p = tl.load(perm + j).to(tl.int64)
        tile = tl.load(src + tl.cast(j, tl.int64) * ROWS * COLS + r)
        tl.store(dst + p * ROWS * COLS + r, tile)


@triton.jit
def h2d_tma(src, perm, dst, n, ROWS: tl.constexpr, COLS: tl.constexpr):
    desc = tl.make_tensor_descriptor(src, shape=[n * ROWS, COLS], strides=[COLS, 1], block_shape=[ROWS, COLS])
    r = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    for j in range(tl.program_id(0), n, tl.num_programs(0)):
        p = tl.load(perm + j).to(tl.int64)
        tile = desc.load([j * ROWS, 0])
        tl.store(dst + p * ROWS * COLS + r, tile)


class HostPtr:
    """The pinned buffer as a kernel pointer argument (its UVA address)."""

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


hv = host.view(-1)
dv = dev_out[: n * TILE]
base_d2h = GiB / wall(lambda: hv.copy_(dv, non_blocking=True)) / 1e9
base_h2d = GiB / wall(lambda: dv.copy_(hv, non_blocking=True)) / 1e9
print(f"copy engine 1 GiB: d2h {base_d2h:.1f}  h2d {base_h2d:.1f}", flush=True)
hp = HostPtr(host)
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
    hdesc = TensorDescriptor(hp, [n * ROWS, COLS], [COLS, 1], [ROWS, COLS])
except Exception as exc:  # noqa: BLE001
    print("host TensorDescriptor:", type(exc).__name__, exc, flush=True)
    hdesc = None
sms = torch.cuda.get_device_properties(0).multi_processor_count
for name, k, d2h in (("plain", d2h_plain, True), ("tma", d2h_tma, True), ("targ", d2h_tma_arg, True),
                     ("plain", h2d_plain, False), ("tma", h2d_tma, False), ("targ", h2d_tma_arg, False)):
    for grid in (sms, 2 * sms, 4 * sms):
        for warps in (4, 8):
            try:
                h = hdesc if name == "targ" else hp
                if d2h:
                    fn = lambda: k[(grid,)](src, perm, h, n, ROWS, COLS, num_warps=warps)  # noqa: E731
                else:
                    fn = lambda: k[(grid,)](h, perm, dev_out, n, ROWS, COLS, num_warps=warps)  # noqa: E731
                host.zero_() if d2h else dev_out.zero_()
                fn()
                torch.cuda.synchronize()
                if d2h:
                    idx = torch.randint(0, n, (8,))
                    ok = all(torch.equal(host[int(j) * TILE:(int(j) + 1) * TILE].cuda(),
                                         src[int(perm[j]) * TILE:(int(perm[j]) + 1) * TILE]) for j in idx)
                else:
                    idx = torch.randint(0, n, (8,))
                    ok = all(torch.equal(dev_out[int(perm[j]) * TILE:(int(perm[j]) + 1) * TILE].cpu(),
                                         host[int(j) * TILE:(int(j) + 1) * TILE]) for j in idx)
                gbs = GiB / wall(fn) / 1e9
                ratio = gbs / (base_d2h if d2h else base_h2d)
                print(f"{'d2h' if d2h else 'h2d'} {name:5s} grid {grid:4d} warps {warps}: {gbs:5.1f} GB/s ({ratio:.3f})  ok {ok}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"{'d2h' if d2h else 'h2d'} {name} grid {grid} warps {warps}: FAILED {type(exc).__name__}: {str(exc)[:300]}",
                      flush=True)
sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
host2 = torch.empty(n * TILE, dtype=torch.int32, pin_memory=True)
hp2 = HostPtr(host2)
both_base_fn = None
for name, kd, kh in (("plain", d2h_plain, h2d_plain), ("tma", d2h_tma, h2d_tma)):
    for grid in (sms, 2 * sms):
        def both():
            cur = torch.cuda.current_stream()
            sa.wait_stream(cur)
            sb.wait_stream(cur)
            with torch.cuda.stream(sa):
                kd[(grid,)](src, perm, hp, n, ROWS, COLS, num_warps=4)
            with torch.cuda.stream(sb):
                kh[(grid,)](hp2, perm, dev_out, n, ROWS, COLS, num_warps=4)
            cur.wait_stream(sa)
            cur.wait_stream(sb)
        try:
            print(f"both ways {name} grid {grid} each: {2 * GiB / wall(both) / 1e9:.1f} GB/s", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"both ways {name}: FAILED {exc}", flush=True)
def both_copy():
    cur = torch.cuda.current_stream()
    sa.wait_stream(cur)
    sb.wait_stream(cur)
    with torch.cuda.stream(sa):
        hv.copy_(dv, non_blocking=True)
    with torch.cuda.stream(sb):
        dev_out[n * TILE:].copy_(host2, non_blocking=True)
    cur.wait_stream(sa)
    cur.wait_stream(sb)
print(f"both ways copy engines: {2 * GiB / wall(both_copy) / 1e9:.1f} GB/s", flush=True)
sys.exit(0)
