"""Probe (not a test; CUDA): where a restore's and a save's host time goes, function by function.
Runs many calls of the `umbp bench restore` layout under cProfile and prints the functions with the
most own time per call (C calls included: launches, event records, numpy), and each function's call
count per call. cProfile slows Python-level calls, so read shares and counts, not absolute times.

    PYTHONPATH=$PWD/src python3 bench/probes/restore_cprofile_gpu.py [tokens] [calls]
"""

from __future__ import annotations

import cProfile
import pstats
import sys


def main(tokens: int, calls: int) -> None:
    import torch

    from umbp.tools import bench_restore as B

    r = B.Restore(tokens)
    save_batch, batch, nbytes = r.prepare(tokens)
    for what, fn in (
        ("verified load", lambda: r.engine.load(batch)),
        ("save", lambda: r.engine.save(save_batch)),
    ):
        for _ in range(5):
            fn().result()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        for _ in range(calls):
            prof.enable()
            h = fn()
            prof.disable()
            h.result()
        st = pstats.Stats(prof)
        rows = []
        for (file, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():
            rows.append(
                (tt / calls * 1e6, ct / calls * 1e6, nc / calls, f"{file.split('/')[-1]}:{line}:{name}")
            )
        total = sum(r_[0] for r_ in rows)
        print(
            f"\n== {what}, {tokens} tokens, {nbytes / 1e6:.1f} MB: {total:.0f} us own time per call (profiled)"
        )
        print(f"  {'own us':>8} {'cum us':>8} {'calls':>6}  function")
        for tt, ct, nc, name in sorted(rows, reverse=True)[:45]:
            print(f"  {tt:8.1f} {ct:8.1f} {nc:6.1f}  {name[:100]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8192, int(sys.argv[2]) if len(sys.argv) > 2 else 200)
