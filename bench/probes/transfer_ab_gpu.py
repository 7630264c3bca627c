"""Probe (not a test; CUDA): `umbp bench transfer`'s Granite "both ways" cells for two engines side by side
in one process, so that the host's and the link's drift between processes is the same for both. Per
repetition, each engine in a fresh random order runs bench_transfer.measure(..., ("both",)) on the same
case (both, both x4 and both queued); printed: the median GB/s per engine and cell, and how often each
engine beat the first.

    PYTHONPATH=$PWD/src:/tmp/ab python3 bench/probes/transfer_ab_gpu.py [reps] [runs|scattered] [path] [name=@package]...

`name=@package`: the default engine of another copy of the package importable under that name (an older
tree, its imports renamed, as for restore_ab_gpu.py); the engine of this tree runs as `now`.
"""

from __future__ import annotations

import importlib
import random
import statistics
import sys


class Converted:
    """An engine of another package, given this package's Moves (converted per call)."""

    def __init__(self, engine, moves_type):
        self.engine, self.moves = engine, moves_type

    def _as(self, batch):
        return [self.moves(m.group, m.block_ids, m.offsets, m.digests, m.slot_bytes) for m in batch]

    def save(self, batch):
        return self.engine.save(self._as(batch))

    def load(self, batch):
        return self.engine.load(self._as(batch))


def main(reps: int, slots: str, path: str, others: dict[str, str]) -> None:
    import torch

    from umbp.pool import Arena
    from umbp.tools import bench_transfer as bt
    from umbp.transfer import model_layouts as L

    payload = 1024 << 20
    arena = Arena(2 * payload + (64 << 20), pinned=True, prefault=False)
    s = L.granite_sizes()
    nobj = max(1, payload // (s["page_bytes"] * s["attention_layers"]))
    groups, _ = L.granite_hybrid(2 * nobj + 16, device="cuda")
    case = bt.Case(f"granite {slots}", groups, arena, payload, 4, seed=7, slots=slots)
    _backend, save_path, load_path = bt.PATHS[path]
    engines = {"now": bt._engine(arena, groups, path, None)}
    for name, package in others.items():
        mod = importlib.import_module(package + ".transfer")
        e = mod.make_engine(arena, groups, backend="kernel", save_path=save_path, load_path=load_path)
        engines[name] = Converted(e, mod.Moves)
    base = bt.baseline(5)
    print(f"{torch.cuda.get_device_name()}; granite, slots {slots}, path {path}; {reps} repetitions; {base}")
    cells: dict[str, dict[str, list[float]]] = {n: {} for n in engines}
    order = list(engines)
    rng = random.Random(1)
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            r = bt.measure(engines[name], case, 3, ("both",))
            assert r["sample_ok"] == 1.0, name
            for cell in ("both", "both_queued", "both_sustained"):
                cells[name].setdefault(cell, []).append(r[cell])
    first = next(iter(engines))
    for cell in ("both", "both_queued", "both_sustained"):
        ref = cells[first][cell]
        for name in engines:
            v = cells[name][cell]
            wins = sum(a > b for a, b in zip(v, ref, strict=True))
            print(
                f"  {cell:<15} {name:<6} {statistics.median(v):6.1f} GB/s  (min {min(v):5.1f}, max {max(v):5.1f})  above {first} in {wins}/{reps}"
            )


if __name__ == "__main__":
    argv = sys.argv[1:]
    named = dict(a.split("=@", 1) for a in argv[3:])
    main(
        int(argv[0]) if argv else 9,
        argv[1] if len(argv) > 1 else "runs",
        argv[2] if len(argv) > 2 else "dma",
        named,
    )
