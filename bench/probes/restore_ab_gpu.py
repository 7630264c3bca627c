"""Probe (not a test; CUDA): engine settings side by side on `umbp bench restore`'s layout, interleaved
call by call in one process, so that the host's speed, which drifts by a third between runs on the
H200's host, is the same for every setting. Per size: the pinned copy of the same bytes and each
setting's verified restore and save, each repetition visiting them in a fresh random order; median
wall time and the link ratio (pinned copy / setting), and how often each setting beat the first one
in the same repetition.

    PYTHONPATH=$PWD/src python3 bench/probes/restore_ab_gpu.py [tokens,...] [reps] [name=knob:value,...]...

Settings are engine options (`make_engine` keywords, integers, sizes in bytes), e.g.
`tail0=tail_round_bytes:0 tail8=tail_round_bytes:8388608` (`.name:value`: an attribute set on the engine
once made, e.g. `noearly=.early_bytes:0`), or `name=@package`: the default engine of
another copy of the package importable under that name (an older tree, its imports renamed), to compare
code rather than knobs; the engine's defaults always run first as `default`.
"""

from __future__ import annotations

import importlib
import statistics
import sys


def main(tokens: list[int], reps: int, settings: dict[str, dict | str]) -> None:
    import torch

    from umbp.tools import bench_restore as B
    from umbp.tools.cuda_timing import interleaved
    from umbp.transfer import make_engine

    r = B.Restore(max(tokens))
    engines, kinds = {"default": r.engine}, {"default": None}
    for name, kw in settings.items():
        if isinstance(kw, str):  # another tree's engine; batches in its own Moves type
            mod = importlib.import_module(kw + ".transfer")
            engines[name], kinds[name] = mod.make_engine(r.arena, r.groups), mod.Moves
        else:  # a knob that starts with '.' is an engine attribute set after it is made
            e = make_engine(r.arena, r.groups, **{k: v for k, v in kw.items() if k[0] != "."})
            for k, v in kw.items():
                if k[0] == ".":
                    assert hasattr(e, k[1:]), k
                    setattr(e, k[1:], v)
            engines[name], kinds[name] = e, None
    print(f"{torch.cuda.get_device_name()}; settings: {settings}; {reps} interleaved repetitions")
    for n in tokens:
        save_batch, batch, nbytes = r.prepare(n)
        copies = B.pinned_copies(nbytes)
        calls = {"H2D copy": copies["h2d"], "D2H copy": copies["d2h"]}
        for name, e in engines.items():
            lb, sb = (_as(kinds[name], b) for b in (batch, save_batch))
            assert all(all(v) for v in e.load(lb).result()), name
            calls[f"load {name}"] = lambda e=e, b=lb: e.load(b).result()
            calls[f"save {name}"] = lambda e=e, b=sb: e.save(b).result()
        times = interleaved(calls, reps, seed=n)  # warms each call up first: compiles, staging rings
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"\n== {n} tokens, {nbytes / 1e6:.1f} MB: pinned H2D {med['H2D copy'] * 1e3:.3f} ms, "
            f"D2H {med['D2H copy'] * 1e3:.3f} ms"
        )
        for what, ref in (("load", "H2D copy"), ("save", "D2H copy")):
            base = times[f"{what} default"]
            for name in engines:
                t = times[f"{what} {name}"]
                wins = sum(a < b for a, b in zip(t, base, strict=True))
                print(
                    f"  {what} {name:<12} {med[f'{what} {name}'] * 1e3:7.3f} ms  link {med[ref] / med[f'{what} {name}']:.3f}"
                    f"  faster than default in {wins}/{reps}"
                )


def _as(moves_type, batch: list) -> list:
    if moves_type is None:
        return batch
    return [moves_type(m.group, m.block_ids, m.offsets, m.digests, m.slot_bytes) for m in batch]


def _settings(args: list[str]) -> dict[str, dict | str]:
    out: dict[str, dict | str] = {}
    for arg in args:
        name, _, spec = arg.partition("=")
        if spec.startswith("@"):
            out[name] = spec[1:]
            continue
        out[name] = {}
        for item in spec.split(","):
            knob, _, value = item.partition(":")
            out[name][knob] = int(value)
    return out


if __name__ == "__main__":
    argv = sys.argv[1:]
    main(
        [int(t) for t in (argv[0] if argv else "8192,16384,32768").split(",")],
        int(argv[1]) if len(argv) > 1 else 41,
        _settings(argv[2:]),
    )
