"""Probe: scattered copies (device staging <-> pinned host slots) via cudaMemcpyBatchAsync split across k
streams (k copy engines?), D2H and H2D, 64 KiB and 256 KiB objects. 1 GiB per direction, median of 5."""
import statistics
import time

import numpy as np
import torch

from umbp.transfer import batchcopy

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
copy = batchcopy.load()
dev = torch.empty(GiB, dtype=torch.uint8, device="cuda")
dev2 = torch.empty(GiB, dtype=torch.uint8, device="cuda")
host = torch.empty(2 * GiB, dtype=torch.uint8, pin_memory=True)
host.fill_(1)
dev.random_(0, 255)
streams = [torch.cuda.Stream() for _ in range(4)]


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


hb = host[:GiB]
base_d2h = GiB / wall(lambda: hb.copy_(dev, non_blocking=True)) / 1e9
base_h2d = GiB / wall(lambda: dev.copy_(hb, non_blocking=True)) / 1e9
print(f"baseline d2h {base_d2h:.1f} h2d {base_h2d:.1f}", flush=True)
rng = np.random.default_rng(1)
for obj in (64 * KiB, 256 * KiB):
    n = GiB // obj
    slots = rng.permutation(2 * n)[:n].astype(np.uint64) * obj + host.data_ptr()
    devs = np.arange(n, dtype=np.uint64) * obj + dev.data_ptr()
    sizes = np.full(n, obj, dtype=np.uint64)
    chunk = 256 * MiB // obj

    def make(k, d2h, mode):
        def go():
            cur = torch.cuda.current_stream()
            for s in streams[:k]:
                s.wait_stream(cur)
            for c in range(0, n, chunk):
                sl = slice(c, c + chunk)
                d, s_, z = (slots[sl], devs[sl], sizes[sl]) if d2h else (devs[sl], slots[sl], sizes[sl])
                for j in range(k):
                    part = slice(j, None, k) if mode == "interleave" else slice(j * len(d) // k, (j + 1) * len(d) // k)
                    copy(d[part], s_[part], z[part], streams[j].cuda_stream)
            for s in streams[:k]:
                cur.wait_stream(s)
        return go

    for d2h in (True, False):
        line = []
        for k, mode in ((1, "chunk"), (2, "chunk"), (2, "interleave"), (3, "chunk"), (4, "chunk")):
            vals = [GiB / wall(make(k, d2h, mode)) / 1e9 for _ in range(3)]
            v = statistics.median(vals)
            line.append(f"k={k}{mode[0]}: {v:.1f} ({v / (base_d2h if d2h else base_h2d):.3f})")
        print(f"{obj // KiB} KiB {'d2h' if d2h else 'h2d'} " + "  ".join(line), flush=True)
    # correctness of the 2-stream d2h split
    host.zero_()
    make(2, True, "interleave")()
    torch.cuda.synchronize()
    idx = rng.integers(0, n, 16)
    ok = all(torch.equal(host[int(slots[i]) - host.data_ptr():][:obj], dev[int(devs[i]) - dev.data_ptr():][:obj].cpu())
             for i in idx)
    print("check", ok, flush=True)
    # both ways with 2 streams per direction
    both_streams = streams
    def both(k):
        def go():
            cur = torch.cuda.current_stream()
            for s in streams:
                s.wait_stream(cur)
            for c in range(0, n, chunk):
                sl = slice(c, c + chunk)
                for j in range(k):
                    part = slice(j, None, k)
                    copy(slots[sl][part], devs[sl][part], sizes[sl][part], streams[j].cuda_stream)
                    copy((devs[sl] - dev.data_ptr() + dev2.data_ptr())[part], slots[sl][part],
                         sizes[sl][part], streams[2 + j].cuda_stream)
            for s in streams:
                cur.wait_stream(s)
        return go
    for k in (1, 2):
        v = statistics.median([2 * GiB / wall(both(k)) / 1e9 for _ in range(3)])
        print(f"{obj // KiB} KiB both k={k} per direction: {v:.1f} GB/s", flush=True)
