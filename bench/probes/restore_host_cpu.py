"""Probe (not a test; CPU, no GPU): host microseconds per call of the kernel engine's planning for the
restores and saves `umbp bench restore` measures (Granite-4.0-H-350M layout, 8 cache groups, 8K..128K
tokens, verified loads, arena slots at random and end to end).

What runs: the real `KernelEngine.load` / `.save` on CPU tensors under TRITON_INTERPRET=1, with ONLY the
device work stubbed out: the Triton launches (`_launch_copy`, `_launch_fetch`) and the copy-engine copies
(`_copy_runs`) do nothing, and the dma staging buffers come from a two-buffer ring made once (as on CUDA)
instead of a fresh allocation per round. Everything else (validation, run sorting, round cutting,
staging layout, plan building, result buffers) is the engine's own code. Not measured here: CUDA stream
switches, events and launch costs (no device); see restore_stages_gpu.py `host` for those on the H200.

`--baseline REV` also times the engine at git revision REV (its src/ extracted to a temporary tree, the
built C extension copied in), each tree in its own subprocess, alternating, so both are measured in the
same run on the same machine:

    PYTHONPATH=$PWD/src python3 bench/probes/restore_host_cpu.py --baseline main
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOKENS = (8192, 16384, 32768, 65536, 131072)


def _engine(max_tokens: int):
    """The bench's layout and batches on CPU, with the device work stubbed (see module docstring)."""
    import math

    import numpy as np
    import torch

    from umbp.pool import Arena
    from umbp.transfer import model_layouts as L
    from umbp.transfer.kernel_engine import KernelEngine

    L._fill = lambda t: t  # untouched pages: the planning never reads them, and 1 GiB stays uncommitted
    s = L.granite_sizes()
    ngroups = 1 + s["mamba_layers"] // s["attention_layers"]
    need = math.ceil(max_tokens / s["block_size"]) + ngroups
    groups, _ = L.granite_hybrid(2 * need + 8)
    obj = s["page_bytes"] * s["attention_layers"]
    arena = Arena(2 * need * obj + (1 << 20), pinned=False, prefault=False)
    e = KernelEngine(arena, groups)
    e.dma_min_run_bytes = 256 << 10  # as on CUDA with the batch-copy call (kernel_engine.__init__)
    e._launch_copy = e._launch_fetch = lambda *a, **k: None
    e._copy_runs = lambda *a, **k: None
    ring = {d: [[torch.empty(0, dtype=torch.uint8), None] for _ in range(2)] for d in (0, 1)}
    turn = {0: 0, 1: 0}

    def take(direction: int, nbytes: int) -> list:
        turn[direction] += 1
        return ring[direction][turn[direction] % 2]

    if hasattr(e, "ring"):
        e.ring.take = take
    else:  # trees before the staging ring had its own module
        e._ring_slot = take
    rng = np.random.default_rng(0)
    blocks = [int(b) for b in rng.permutation(2 * need + 8)[:need]]
    slots = [int(x) * obj for x in rng.permutation(2 * need)[:need]]
    return e, s, ngroups, blocks, slots, obj


def _batches(n: int, runs: bool, s, ngroups, blocks, slots, obj):
    """(save batch, verified load batch) as bench_restore.Restore.batch builds them."""
    import math
    import random

    from umbp.transfer import Moves

    k = math.ceil(n / s["block_size"])
    sl = [i * obj for i in range(k + ngroups)] if runs else slots
    pad = obj if runs else None
    rnd = random.Random(n)
    save = [Moves(0, blocks[:k], sl[:k], None, pad)]
    save += [Moves(g, [blocks[k + g - 1]], [sl[k + g - 1]], None, pad) for g in range(1, ngroups)]
    load = [
        Moves(m.group, m.block_ids, m.offsets, [rnd.getrandbits(64) for _ in m.block_ids], m.slot_bytes)
        for m in save
    ]
    return save, load


def _median_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(tokens: list[int], reps: int) -> list[dict]:
    e, s, ngroups, blocks, slots, obj = _engine(max(tokens))
    rows = []
    for n in tokens:
        for runs in (False, True):
            save, load = _batches(n, runs, s, ngroups, blocks, slots, obj)
            rows.append(
                dict(
                    tokens=n,
                    slots="runs" if runs else "scattered",
                    objects=sum(len(m.block_ids) for m in save),
                    load_us=_median_us(lambda load=load: e.load(load), reps),
                    save_us=_median_us(lambda save=save: e.save(save), reps),
                )
            )
    return rows


def _tree(rev: str, repo: Path, into: Path) -> Path:
    """src/ of `rev` under `into`, with this checkout's built C extensions that `rev` has sources for."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "src"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    for so in (repo / "src").rglob("_*.so"):
        rel = so.relative_to(repo)
        source = into / rel.parent / (so.name.split(".")[0] + ".c")
        if source.exists():
            shutil.copy(so, into / rel)
    return into / "src"


def _child(src: Path, tokens: list[int], reps: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(src), TRITON_INTERPRET="1")
    args = [sys.executable, __file__, "--child", "--tokens", ",".join(map(str, tokens)), "--reps", str(reps)]
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--baseline", default=None, help="git revision to time beside this tree")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of baseline and this tree")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.child:
        print(json.dumps(measure(tokens, a.reps)))
        return
    repo = Path(__file__).resolve().parents[2]
    trees = {"this tree": repo / "src"}
    with tempfile.TemporaryDirectory() as tmp:
        if a.baseline:
            trees = {f"{a.baseline}": _tree(a.baseline, repo, Path(tmp)), **trees}
        results: dict[str, list[list[dict]]] = {k: [] for k in trees}
        for _ in range(a.rounds):
            for name, src in trees.items():
                results[name].append(_child(src, tokens, a.reps))
    print(f"host us per call (median of {a.reps}; best of {a.rounds} alternating runs), device work stubbed")
    print(f"{'tokens':>7} {'slots':<9} {'objs':>4}  " + "  ".join(f"{n[:14]:>14} load/save" for n in trees))
    first = next(iter(results.values()))[0]
    for i, row in enumerate(first):
        cells = []
        for name in trees:
            load = min(r[i]["load_us"] for r in results[name])
            save = min(r[i]["save_us"] for r in results[name])
            cells.append(f"{load:>12.0f} / {save:>6.0f}")
        print(f"{row['tokens']:>7} {row['slots']:<9} {row['objects']:>4}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
