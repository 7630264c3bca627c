"""Probe (not a test; CUDA): where the time of a verified restore (and of a save) goes, and what the
engine's knobs do to it. For each size: the pinned copy of the same bytes, the dma runs alone on one and
on two copy streams, the engine's verified load and save with knobs varied (wall time, the host's share
of it, and the same call queued behind GPU work: the device's share alone), and a device timeline of one
verified load. `both` mode: the Granite layout with slots in runs, both ways, batch copies from 1 vs 3
runs. Results of the runs behind docs/transfer.md: bench/results/archive/.

    PYTHONPATH=$PWD/src python3 bench/probes/restore_stages_gpu.py stages [tokens,...]
    PYTHONPATH=$PWD/src python3 bench/probes/restore_stages_gpu.py both
"""

from __future__ import annotations

import statistics
import sys
import time


def _submit_and_wall(fn, reps: int) -> tuple[float, float]:
    """Median seconds until fn() returns (host) and until its handle's result is in (wall), device idle
    at the start."""
    import torch

    for _ in range(2):
        fn().result()
    sub, wall = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = fn()
        t1 = time.perf_counter()
        h.result()
        t2 = time.perf_counter()
        sub.append(t1 - t0)
        wall.append(t2 - t0)
    return statistics.median(sub), statistics.median(wall)


def stages(tokens: list[int]) -> None:
    import torch

    from umbp.tools import bench_restore as B
    from umbp.tools.cuda_timing import engine_streams, queued as _queued, wall as _wall
    from umbp.transfer import make_engine
    from umbp.transfer import plans as P

    reps = 15
    r = B.Restore(max(tokens))
    knobs = {
        "default": {},
        "min_round=8M": {"min_round_bytes": 8 << 20},
        "min_round=32M": {"min_round_bytes": 32 << 20},
        "min_round=1G (one round)": {"min_round_bytes": 1 << 30},
    }
    engines = {k: make_engine(r.arena, r.groups, **v) for k, v in knobs.items()}
    for n in tokens:
        save_batch, batch, nbytes = r.prepare(n)
        h2d, d2h = B.copy_seconds(nbytes, reps)
        print(
            f"\n== {n} tokens, {nbytes / 1e6:.1f} MB; pinned copy H2D {h2d * 1e3:.3f} ms  D2H {d2h * 1e3:.3f} ms"
        )
        for name, e in engines.items():
            for what, fn, ref in (
                ("load", lambda e=e: e.load(batch), h2d),
                ("save", lambda e=e: e.save(save_batch), d2h),
            ):
                sub, wall = _submit_and_wall(fn, reps)
                q, _ahead = _queued(lambda fn=fn: [fn()], reps, hold=engine_streams(e))
                print(
                    f"{what} {name:<26} wall {wall * 1e3:7.3f} ms (link {ref / wall:.3f})  host {sub * 1e3:6.3f} ms  "
                    f"queued {q * 1e3:7.3f} ms (link {ref / q:.3f})"
                )
        print("plan-buffer allocations so far:", {k: e._tables.allocations for k, e in engines.items()})
        e = engines["default"]
        checked = e._checked(batch, load=True)
        _pos, runs, total = P.plan_runs(P.sorted_runs(checked))
        stg = torch.empty(total, dtype=torch.uint8, device="cuda")
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]

        def runs_on(k: int) -> None:
            a, s, size = runs
            for j in range(k):
                part = slice(j, None, k)
                with torch.cuda.stream(streams[j]):
                    e._batch_copy(
                        stg.data_ptr() + s[part], e.arena_base + a[part], size[part], streams[j].cuda_stream
                    )
            for j in range(k):
                streams[j].synchronize()

        one, two = _wall(lambda: runs_on(1), reps), _wall(lambda: runs_on(2), reps)
        print(
            f"dma runs alone ({runs[0].size} runs): one stream {one * 1e3:.3f} ms (link {h2d / one:.3f}), "
            f"two streams {two * 1e3:.3f} ms (link {h2d / two:.3f})"
        )
        if n in tokens[:1]:
            timeline(e, batch)


def timeline(engine, batch) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine.load(batch).result()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.load(batch).result()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    if not ev:
        print("(no device events)")
        return
    t0 = min(e.time_range.start for e in prof.events())
    print("device timeline of one verified default load, profiled (us from the first host event):")
    for e in sorted(ev, key=lambda e: e.time_range.start):
        print(f"  {e.time_range.start - t0:9.1f} +{e.time_range.elapsed_us():8.1f}  {e.name[:60]}")


def host_costs() -> None:
    """Host microseconds of the pieces a transfer round is made of (median of 200, device idle)."""
    import numpy as np
    import torch

    from umbp.tools import bench_restore as B
    from umbp.transfer import plans as P

    r = B.Restore(8192)
    _s, batch, _n = r.prepare(8192)
    e = r.engine
    checked = e._checked(batch, load=True)
    s1 = torch.cuda.Stream()
    ev = torch.cuda.Event()
    ev.record()
    host = e._tables.take(4096)
    dev = torch.empty(4096, dtype=torch.int64, device="cuda")
    _pos, runs, total = P.plan_runs(P.sorted_runs(checked))
    stg = torch.empty(total, dtype=torch.uint8, device="cuda")
    shape, ids, _offs = e.flat(checked)
    rows = np.arange(shape.nobj, dtype=np.int64) * 16 + stg.data_ptr()
    plan = e._plan(checked, [rows], sums=True, stream=None)
    e._copy(plan, 0, None, True, hbm=True)
    torch.cuda.synchronize()

    def event_record() -> None:
        torch.cuda.Event().record(s1)

    def stream_ctx() -> None:
        with torch.cuda.stream(s1):
            pass

    def launch_copy_direct() -> None:
        e._copy(plan, 0, None, True, hbm=True)

    def launch_copy_triton() -> None:
        e._launch_copy.direct = False
        e._copy(plan, 0, None, True, hbm=True)
        e._launch_copy.direct = True

    items = {
        "Event() + record": event_record,
        "stream.wait_event": lambda: s1.wait_event(ev),
        "with torch.cuda.stream": stream_ctx,
        "current_stream()": torch.cuda.current_stream,
        "torch.empty_like(host -> cuda)": lambda: torch.empty_like(host, device="cuda"),
        "fetch_words launch (direct)": lambda: e._sm_copy(host, dev),
        "copy_objects launch (direct)": launch_copy_direct,
        "copy_objects launch (Triton's path)": launch_copy_triton,
        "batch copy call, 27 runs": lambda: e._copy_runs(runs, stg, to_arena=False, stream=s1),
        "_checked, 8 Moves": lambda: e._checked(batch, load=True),
        "sorted_runs + plan_runs": lambda: P.plan_runs(P.sorted_runs(checked)),
        "plan_rounds (one round)": lambda: P.plan_rounds(_offs, shape.size, shape.reach, [0, shape.nobj]),
        "build_plan, verified": lambda: P.build_plan(shape, checked, ids, [rows], True, e._tables.take),
        "pool take + give": lambda: e._tables.give(e._tables.take(4096), None),
        "pinned torch.empty 1 MiB": lambda: torch.empty(1 << 17, dtype=torch.int64, pin_memory=True),
        "event.query": ev.query,
    }
    for name, fn in items.items():
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        print(f"host {name:<38} {statistics.median(times) * 1e6:8.1f} us")


def both() -> None:
    import torch

    from umbp.pool import Arena
    from umbp.tools import bench_transfer as T
    from umbp.transfer import make_engine
    from umbp.transfer import model_layouts as L

    payload = 1 << 30
    s = L.granite_sizes()
    nobj = payload // (s["page_bytes"] * s["attention_layers"])
    groups, _ = L.granite_hybrid(2 * nobj + 16, device="cuda")
    arena = Arena(2 * payload + (64 << 20), pinned=True, prefault=False)
    print("baseline", {k: round(v, 1) for k, v in T.baseline(7).items()})
    for slots in ("runs", "scattered"):
        case = T.Case("granite " + slots, groups, arena, payload, 4, seed=7, slots=slots)
        for label, opts in (
            ("dma, batch copy from 3 runs", {"save_path": "dma", "load_path": "dma"}),
            (
                "dma, batch copy from 1 run",
                {"save_path": "dma", "load_path": "dma", "batch_copy_min_runs": 1},
            ),
            ("auto", {}),
            ("auto, batch copy from 1 run", {"batch_copy_min_runs": 1}),
        ):
            eng = make_engine(arena, groups, backend="kernel", **opts)
            m = T.measure(eng, case, 7, ("both",))
            print(
                f"{slots:<9} {label:<30}", {k: round(v, 1) for k, v in m.items() if not k.endswith("ahead")}
            )
            del eng
            torch.cuda.empty_cache()


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "stages"
    if mode == "both":
        both()
    elif mode == "host":
        host_costs()
    else:
        stages([int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "8192,32768,131072").split(",")])
