"""Probe (not a test; CUDA): where an idle save's (and load's) wall time goes, on the device's own clock, with no
profiler (which slows the host steps several-fold). Timing events are recorded on the caller's stream just
before the call (the device is idle, so it runs it at once: the call's start), on the save stream just
before the head's copies and before each round's copy call (on the load stream before a restore's first
early copy and each round's copy call), and after the call's last work. An event on
the save stream runs when everything queued there before it is done, or when the host queues it, whichever
is later; so each figure shows whether the copy engine was waiting for the host or the host for it.

    PYTHONPATH=$PWD/src python3 bench/probes/save_events_gpu.py [tokens,...] [reps]

Prints, per size, the medians (us) of: the start to the head (host time in front of the first copy), the
head to each round's copy call, the last round's call to the end, the device span (start to end), the
wall time around the call and its result, and the pinned copy of the same bytes timed the same way; for a
load, its copy calls into staging instead of the head and rounds.
"""

from __future__ import annotations

import statistics
import sys
import time


def main(tokens: list[int], reps: int) -> None:
    import torch

    from umbp.tools import bench_restore as B
    from umbp.transfer.rounds import SAVE

    r = B.Restore(max(tokens))
    e = r.engine
    marks: list[tuple[str, torch.cuda.Event]] = []

    def mark(name: str, stream) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        marks.append((name, ev))

    real_head, real_runs, real_early = e._head, e._copy_runs, e._early_copy

    def head(batch, count, save, queued):
        mark("head", save)
        return real_head(batch, count, save, queued)

    def copy_runs(runs, stg, to_arena, stream, lead=False):
        kind = "round" if to_arena else "copy in"
        mark(f"{kind} {sum(1 for n, _ in marks if n.startswith(kind))}", stream)
        return real_runs(runs, stg, to_arena, stream, lead)

    def early_copy(*args):  # a restore's early copies (early.py), on the copy stream
        mark("early copy", e._main(1))
        return real_early(*args)

    e._head, e._copy_runs, e._early_copy = head, copy_runs, early_copy
    print(torch.cuda.get_device_name())
    for n in tokens:
        save_batch, load_batch, nbytes = r.prepare(n)
        copies = B.pinned_copies(nbytes)
        rows: dict[str, list[float]] = {}
        for rep in range(reps + 3):
            for what in ("save", "d2h", "load", "h2d"):
                marks.clear()
                torch.cuda.synchronize()
                caller = torch.cuda.current_stream()
                mark("start", caller)
                t0 = time.perf_counter()
                if what == "save":
                    h = e.save(save_batch)
                    mark("end", e._main(SAVE))
                    h.result()
                elif what == "load":
                    h = e.load(load_batch)
                    caller.wait_event(h._event)  # (recorded after the load's last work)
                    mark("end", caller)
                    h.result()
                else:
                    copies[what]()
                    mark("end", caller)
                    caller.synchronize()
                wall = time.perf_counter() - t0
                torch.cuda.synchronize()
                if rep < 3:
                    continue
                start = marks[0][1]
                prev = start
                for name, ev in marks[1:]:
                    rows.setdefault(f"{what}: {name} after previous", []).append(prev.elapsed_time(ev) * 1e3)
                    prev = ev
                rows.setdefault(f"{what}: device span", []).append(start.elapsed_time(marks[-1][1]) * 1e3)
                rows.setdefault(f"{what}: wall", []).append(wall * 1e6)
        print(f"\n== {n} tokens, {nbytes / 1e6:.1f} MB: medians of {reps} (us)")
        for name, v in rows.items():
            print(f"  {name:<36} {statistics.median(v):9.1f}")


if __name__ == "__main__":
    toks = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "8192,131072").split(",")]
    main(toks, int(sys.argv[2]) if len(sys.argv) > 2 else 31)
