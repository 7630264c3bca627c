"""Probe (not a test; CUDA): does Python's garbage collector explain why, in `umbp bench transfer`, the
row measured last reads lowest over four passes? Runs the bench's Granite rows with paths repeated
(e.g. dma,auto,dma,auto) as `umbp bench transfer` does, and with `freeze` collects and freezes the heap
(gc.freeze: a full collection then skips every object alive so far) before each row, as vLLM does once
its engine is up; also prints the time one full collection takes before each row.

    PYTHONPATH=$PWD/src python3 bench/probes/transfer_gc_gpu.py [freeze] -- <umbp bench transfer args>
"""

from __future__ import annotations

import argparse
import gc
import sys
import time


def main() -> int:
    from umbp.tools import bench_transfer as T

    argv = sys.argv[1:]
    freeze = "freeze" in argv[: argv.index("--")] if "--" in argv else False
    rest = argv[argv.index("--") + 1 :] if "--" in argv else argv
    real = T.measure

    def measured(*a, **k):
        t = time.perf_counter()
        gc.collect()
        print(f"[gc] full collection {1e3 * (time.perf_counter() - t):.1f} ms, "
              f"{len(gc.get_objects())} tracked objects{'; frozen' if freeze else ''}", flush=True)
        if freeze:
            gc.freeze()
        return real(*a, **k)

    T.measure = measured
    parser = argparse.ArgumentParser()
    T.add_arguments(parser)
    return T.run(parser.parse_args(rest))


if __name__ == "__main__":
    sys.exit(main())
