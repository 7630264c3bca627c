"""Probe (not a test; H200, see bench/results/archive/2026-12-01-transfer-21-kernel-variants.txt): how many compiled variants
of the copy kernel a worker accumulates over 60 steps of random save jobs (groups, object counts, slots,
fence kinds). Each new variant is a compile (unless Triton's disk cache has it) and a module load, which
waits for the GPU's queued work: a stall in the middle of serving.

    PROBE_SRC=$PWD/src python3 bench/probes/kernel_variants_gpu.py
"""

from __future__ import annotations

import os
import random
import sys


def main() -> None:
    sys.path[:0] = [os.environ.get("PROBE_SRC", os.path.abspath("src")), "tests/unit"]
    import test_worker_cuda as T  # its stand-ins for the few vLLM classes the worker imports

    T._stand_in_vllm()
    from umbp.transfer import triton_kernels as kernels
    from umbp.vllm.metadata import PageMove, SaveJob, UMBPConnectorMetadata

    def variants() -> int:
        caches = getattr(kernels.copy_objects, "device_caches", {})
        return sum(len(v[0]) for v in caches.values())

    w, groups = T.make_worker()
    rng, job, seen = random.Random(0), 0, []
    for _step in range(60):
        jobs = []
        for g in rng.sample(sorted(groups), rng.randint(1, len(groups))):
            k = rng.randint(1, 6)
            job += 1
            moves = [PageMove(b, o * T.SLOT, w.groups[g].object_bytes, bytes([g, b]) + job.to_bytes(4, "little")
                              + bytes(26)) for b, o in zip(rng.sample(range(1, 24), k), rng.sample(range(80), k),
                                                           strict=True)]
            jobs.append(SaveJob(job, g, moves, fence=rng.random() < 0.5))
        w.save(UMBPConnectorMetadata(saves=jobs))
        w.take_worker_meta()
        w.take_worker_meta()
        seen.append(variants())
    print("variants after steps 1,5,10,20,40,60:", [seen[i] for i in (0, 4, 9, 19, 39, 59)])
    w.close()


if __name__ == "__main__":
    main()
