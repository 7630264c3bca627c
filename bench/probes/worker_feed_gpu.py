"""Probe (not a test; run on the H200 device, see bench/results/archive/2026-12-01-worker-20-tier-feed.txt).

Host time of the worker's save hooks per step on CUDA, with an SSD tier, over Granite-4.0-H-350M's vLLM
layout. Each step: save() of one job per cache group, OBJS objects each (~1.5 MiB), then a 'forward' (GPU
work queued, the host sleeping 25 ms), then take_worker_meta(). Prints the hooks' median time per step.

    OBJS=2 PROBE_SRC=$PWD/src python3 bench/probes/worker_feed_gpu.py         # NOSSD=1: no SSD tier
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

STEPS, WARMUP, FORWARD_S = 40, 5, 0.025


def main() -> None:
    sys.path[:0] = [os.environ["PROBE_SRC"], "tests/unit"]
    import test_worker_cuda as T  # its stand-ins for the few vLLM classes the worker imports
    import torch

    T._stand_in_vllm()
    from umbp.identity import RankCoord
    from umbp.transfer import model_layouts as L
    from umbp.vllm.config import UMBPConfig
    from umbp.vllm.kv_layout import Layout
    from umbp.vllm.metadata import PageMove, SaveJob, UMBPConnectorMetadata
    from umbp.vllm.worker import WorkerSide

    objs = int(os.environ.get("OBJS", 8))
    groups, _ = L.granite_hybrid(24, device="cuda")
    kv, names = {}, []
    for g, layers in sorted(groups.items()):
        names.append([f"g{g}.l{i}" for i in range(len(layers))])
        kv.update({n: t for n, (t, _) in zip(names[-1], layers, strict=True)})
    cfg = SimpleNamespace(num_blocks=24, kv_cache_groups=[SimpleNamespace(layer_names=n) for n in names])
    layout = Layout(groups=(), unit=16, eagle_groups=frozenset(), identity=None, namespace=T.NS,
                    ranks=(RankCoord(),), object_bytes=tuple(T.SLOT for _ in names))
    ssd_dirs = () if os.environ.get("NOSSD") else (tempfile.mkdtemp(dir="/tmp"),)
    w = WorkerSide(UMBPConfig(dram_bytes=400 * T.SLOT, ssd_dirs=ssd_dirs, ssd_bytes=16 << 30), layout, cfg,
                   rank=RankCoord())
    w.register(kv)
    hook, confirmed, slot, job = [], 0, 0, 0
    for step in range(STEPS):
        jobs = []
        for g in sorted(groups):
            nbytes = w.groups[g].object_bytes
            moves = []
            for b in range(1, 1 + objs):
                key = bytes([g, b]) + step.to_bytes(4, "little") + job.to_bytes(4, "little") + bytes(22)
                moves.append(PageMove(b, (slot % 400) * T.SLOT, nbytes, key))
                slot += 1
            job += 1
            jobs.append(SaveJob(job, g, moves, ssd=True))
        t0 = time.perf_counter()
        w.save(UMBPConnectorMetadata(saves=jobs))
        t1 = time.perf_counter()
        torch.cuda._sleep(20_000_000)  # the forward: GPU work, the host waiting with the GIL free
        time.sleep(FORWARD_S)
        t2 = time.perf_counter()
        meta = w.take_worker_meta()
        t3 = time.perf_counter()
        if step >= WARMUP:
            hook.append((t1 - t0) + (t3 - t2))
        confirmed += len(meta.saved) if meta else 0
    per_step = sum(w.groups[g].object_bytes for g in groups) * objs
    p90 = sorted(hook)[int(0.9 * len(hook))]
    print(f"{per_step / 2**20:.1f} MiB saved per step; hook host time per step: median "
          f"{1e3 * statistics.median(hook):.2f} ms, p90 {1e3 * p90:.2f}, max {1e3 * max(hook):.2f}; "
          f"confirmed {confirmed} of {job} jobs; ssd_dropped {w.totals['ssd_saves_dropped']}")
    w.close()


if __name__ == "__main__":
    main()
