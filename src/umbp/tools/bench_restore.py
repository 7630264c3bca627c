"""`umbp bench restore` (CUDA): restore and save N tokens of a hybrid model's pages at link speed.

Layout: Granite-4.0-H-350M as vLLM's hybrid allocator lays it out (400-token blocks; 4 attention layers;
28 Mamba2 layers in 7 state groups whose pages are padded to the attention page size). Restore: one
`engine.load` of the attention blocks covering N tokens plus the boundary state of every state group (one
block each), from scattered page-locked arena slots into scattered GPU blocks, checksums verified on the
GPU (a slot that does not match is never written); wall time from submit to completion, median of
`--reps` after warm-up. Save: one `engine.save` of the same objects, digests back on the host. Both are
measured again with the slots end to end ("runs": how the connector's saves reserve them while the arena
has long free runs), where one copy moves every object.

The yardstick is the link: in the same run, for every size, a plain page-locked `copy_` of the same
number of bytes (one contiguous buffer, H2D for the restore, D2H for the save), timed the same way.
`link_ratio` = restore bytes/s over that copy's bytes/s (`save_link_ratio` likewise). A second anchor is
the GEMM floor of a prefill of N tokens: the dense FLOPs of Granite-4.0-H-350M (2 per weight per token,
causal attention scores, last-token logits) at the bf16 matmul rate measured in the run: no prefill
kernel can beat it. No prefill is measured: transformers' Mamba2 without the mamba_ssm kernels is a
reference implementation no server runs, and the device this was measured on has no such kernels.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from umbp.tools.argtypes import counts, whole
from umbp.tools.benchutil import write_json
from umbp.tools.cuda_timing import device_env, interleaved, wall

TARGET = 0.9  # restore (and save) bytes/s over the pinned copy of the same bytes, every size
TOKENS = "8192,16384,32768,65536,131072"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="small fast run (smoke test; not representative)"
    )
    parser.add_argument(
        "--out", default="umbp-out/bench_restore.json", help="JSON path (default: %(default)s)"
    )
    parser.add_argument("--png", default=None, help="plot path (default: the JSON path with .png)")
    parser.add_argument(
        "--tokens",
        type=counts(1, 1 << 21),
        default=None,
        help=f"comma-separated N (default {TOKENS}; quick 8192)",
    )
    parser.add_argument("--reps", type=whole(1), default=None, help="timed repetitions (default 21, quick 3)")
    parser.add_argument(
        "--min-round-mib",
        type=whole(1),
        default=None,
        help="the engine's min_round_bytes in MiB (default: its own)",
    )


def model_flops(cfg: dict[str, Any], n: int) -> float:
    """Dense FLOPs of a prefill of n tokens of a GraniteMoeHybrid config (dense MLPs, no experts): 2 per
    weight per token for every projection, causal attention scores (QK^T and PV over half the square),
    the lm head for the last token only."""
    h, inter = cfg["hidden_size"], cfg["shared_intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    n_attn = sum(t == "attention" for t in cfg["layer_types"])
    n_mamba = len(cfg["layer_types"]) - n_attn
    inner = cfg["mamba_expand"] * h
    conv_dim = inner + 2 * cfg["mamba_n_groups"] * cfg["mamba_d_state"]
    in_proj = h * (inner + conv_dim + cfg["mamba_n_heads"])
    mamba = in_proj + inner * h  # in and out projections (the scan itself is not a GEMM)
    attn = h * (heads + 2 * kv) * hd + heads * hd * h
    mlp = 3 * h * inter
    weights = n_attn * attn + n_mamba * mamba + len(cfg["layer_types"]) * mlp
    scores = n_attn * 2 * 2 * (n * n / 2) * heads * hd
    return 2 * n * weights + scores + 2 * cfg["vocab_size"] * h


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / wall(lambda: a @ b, reps) / 1e12


def real_prefill_kernels() -> str | None:
    """The fused Mamba2 kernels a server would run (mamba_ssm), if installed; None otherwise."""
    try:
        import mamba_ssm  # noqa: F401
    except ImportError:
        return None
    return "mamba_ssm"


class Restore:
    """Granite's hybrid layout on the GPU, an arena holding every object for max N, and the engines."""

    def __init__(self, max_tokens: int, seed: int = 0, **engine_options: Any):
        import numpy as np

        from umbp.pool import Arena
        from umbp.transfer import make_engine
        from umbp.transfer import model_layouts as L

        self.sizes = L.granite_sizes()
        self.bs = self.sizes["block_size"]
        self.ngroups = 1 + self.sizes["mamba_layers"] // self.sizes["attention_layers"]
        need = math.ceil(max_tokens / self.bs) + self.ngroups
        self.groups, _ = L.granite_hybrid(2 * need + 8, device="cuda")
        obj = self.sizes["page_bytes"] * self.sizes["attention_layers"]
        # scattered slots anywhere in the first 2 * need slots; slots in runs after them, so that the runs'
        # saves, timed between the others' loads, never overwrite a slot a scattered load verifies
        self.runs_base = 2 * need * obj
        self.arena = Arena(3 * need * obj + (1 << 20), pinned=True, prefault=False)
        self.engine = make_engine(self.arena, self.groups, **engine_options)  # default ("auto") paths
        self.engines = {
            p: make_engine(self.arena, self.groups, save_path=p, load_path=p) for p in ("zero-copy", "dma")
        }
        rng = np.random.default_rng(seed)
        self.blocks = [int(b) for b in rng.permutation(2 * need + 8)[:need]]
        self.slots = [int(s) * obj for s in rng.permutation(2 * need)[:need]]

    def batch(self, n: int, runs: bool = False) -> list[Any]:
        """Moves for N tokens: the attention blocks covering them + one boundary state per state group.
        Slots at random in the arena (a fragmented arena: every object its own copy), or with `runs`
        end to end, as DramIndex.reserve_many hands them to the saves of a prompt's blocks while the arena
        has long free runs (one copy for all)."""
        from umbp.transfer import Moves

        k = math.ceil(n / self.bs)
        obj = self.sizes["page_bytes"] * self.sizes["attention_layers"]
        slots = [self.runs_base + i * obj for i in range(k + self.ngroups)] if runs else self.slots
        pad = obj if runs else None  # each slot reaches the next: state objects are shorter than a slot
        moves = [Moves(0, self.blocks[:k], slots[:k], None, pad)]
        for g in range(1, self.ngroups):
            moves.append(Moves(g, [self.blocks[k + g - 1]], [slots[k + g - 1]], None, pad))
        return moves

    def prepare(self, n: int, runs: bool = False) -> tuple[list[Any], list[Any], int]:
        """Save the objects once (so the slots hold real data and digests): (save batch, verified load
        batch, bytes)."""
        from umbp.transfer import Moves

        batch = self.batch(n, runs)
        digests = self.engine.save(batch).result()
        nbytes = sum(len(m.block_ids) * self.engine.object_bytes(m.group) for m in batch)
        verified = [Moves(m.group, m.block_ids, m.offsets, d, m.slot_bytes) for m, d in zip(batch, digests)]
        return batch, verified, nbytes

    def loaded_ok(self, batch: list[Any], engine: Any = None) -> bool:
        """Whether every object of a verified load verified and was written."""
        return all(all(r) for r in (engine or self.engine).load(batch).result())

    def saved_ok(self, batch: list[Any], loaded: list[Any]) -> bool:
        """Whether a save's digests are the ones the slots were loaded with (the same bytes go back)."""
        return self.engine.save(batch).result() == [list(m.digests) for m in loaded]


def pinned_copies(nbytes: int) -> dict[str, Any]:
    """A plain page-locked copy of nbytes each way, as calls to time."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    return {
        "h2d": lambda: dev.copy_(host, non_blocking=True),
        "d2h": lambda: host.copy_(dev, non_blocking=True),
    }


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError as exc:
        print(f"umbp bench restore: needs torch with CUDA ({exc})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("umbp bench restore: needs a CUDA device (run it on the GPU machine)", file=sys.stderr)
        return 2
    from umbp.transfer.model_layouts import GRANITE_4_0_H_350M

    tokens = args.tokens or [int(t) for t in ("8192" if args.quick else TOKENS).split(",")]
    reps = args.reps or (3 if args.quick else 21)
    res: dict[str, Any] = {
        "command": "umbp " + " ".join(sys.argv[1:]),
        "argv0": sys.argv[0],
        "env": device_env(),
        "reps": reps,
        "target_link_ratio": TARGET,
        "real_prefill_kernels": real_prefill_kernels(),
    }
    res["matmul_tflops"] = tflops = matmul_tflops()
    options = {} if args.min_round_mib is None else {"min_round_bytes": args.min_round_mib << 20}
    restore = Restore(max(tokens), **options)
    e = restore.engine
    res["engine"] = dict(
        backend=e.backend, min_round_bytes=getattr(e, "min_round_bytes", None), ctas=getattr(e, "ctas", None)
    )
    res["rows"] = [_row(restore, n, reps, tflops, GRANITE_4_0_H_350M) for n in tokens]
    _write(args, res)
    print_table(res)
    return 0


def submitted(issue: Callable[[], Any], times: list[float]) -> Callable[[], Any]:
    """A call of issue() (a transfer) to its result, appending to `times` the host seconds until issue()
    returned its handle: everything issued. Where that is close to the whole call, the host, not the
    link, sets the pace (the engine's planning, kernel launches and copy calls)."""

    def call() -> Any:
        t0 = time.perf_counter()
        handle = issue()
        times.append(time.perf_counter() - t0)
        return handle.result()

    return call


def _row(restore: Restore, n: int, reps: int, tflops: float, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every figure of one size from one interleaved set of repetitions (cuda_timing.interleaved)."""
    save_batch, batch, nbytes = restore.prepare(n)
    runs_save, runs_batch, _ = restore.prepare(n, runs=True)
    e = restore.engine
    host: dict[str, list[float]] = {"restore": [], "save": []}
    calls = pinned_copies(nbytes) | {
        "restore": submitted(lambda: e.load(batch), host["restore"]),
        "save": submitted(lambda: e.save(save_batch), host["save"]),
        "restore runs": lambda: e.load(runs_batch).result(),
        "save runs": lambda: e.save(runs_save).result(),
    }
    calls |= {f"restore {p}": (lambda x=x: x.load(batch).result()) for p, x in restore.engines.items()}
    med = {k: statistics.median(v) for k, v in interleaved(calls, reps, seed=n).items()}
    ok = restore.loaded_ok(batch) and restore.loaded_ok(runs_batch)
    ok = ok and all(restore.loaded_ok(batch, x) for x in restore.engines.values())
    saved_ok = restore.saved_ok(save_batch, batch) and restore.saved_ok(runs_save, runs_batch)
    h2d_s, d2h_s, restore_s, save_s = med["h2d"], med["d2h"], med["restore"], med["save"]
    runs_s, runs_save_s = med["restore runs"], med["save runs"]
    floor_s = model_flops(cfg, n) / (tflops * 1e12)
    return dict(
        tokens=n,
        bytes=nbytes,
        restore_ms=restore_s * 1e3,
        h2d_copy_ms=h2d_s * 1e3,
        link_ratio=h2d_s / restore_s,
        save_ms=save_s * 1e3,
        d2h_copy_ms=d2h_s * 1e3,
        save_link_ratio=d2h_s / save_s,
        restore_gbps=nbytes / restore_s / 1e9,
        save_gbps=nbytes / save_s / 1e9,
        restore_ms_runs=runs_s * 1e3,
        link_ratio_runs=h2d_s / runs_s,
        save_ms_runs=runs_save_s * 1e3,
        save_link_ratio_runs=d2h_s / runs_save_s,
        restored_ok=ok,
        saved_ok=saved_ok,
        restore_ms_by_path={p: med[f"restore {p}"] * 1e3 for p in restore.engines},
        # the timed repetitions' (interleaved() warms each call up first)
        restore_host_ms=statistics.median(host["restore"][-reps:]) * 1e3,
        save_host_ms=statistics.median(host["save"][-reps:]) * 1e3,
        prefill_floor_ms=floor_s * 1e3,
        floor_over_restore=floor_s / restore_s,
    )


def _write(args: argparse.Namespace, res: dict[str, Any]) -> None:
    out = write_json(args.out, res, indent=1)
    try:
        plot(res, Path(args.png) if args.png else out.with_suffix(".png"))
    except ImportError as exc:
        print(f"(no plot: {exc})", file=sys.stderr)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    x = [r["tokens"] // 1024 for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax.plot(x, [r["link_ratio"] for r in rows], "o-", label="restore (verified) / pinned H2D copy")
    ax.plot(x, [r["save_link_ratio"] for r in rows], "s-", label="save / pinned D2H copy")
    ax.plot(x, [r["link_ratio_runs"] for r in rows], "o:", label="restore, slots end to end")
    ax.plot(x, [r["save_link_ratio_runs"] for r in rows], "s:", label="save, slots end to end")
    ax.axhline(res["target_link_ratio"], color="gray", ls="--", lw=1, label="target")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("tokens (K)")
    ax.set_ylabel("ratio to the pinned copy of the same bytes")
    ax.set_title(f"Granite-4.0-H-350M layout on {res['env']['gpu']}")
    ax.legend(fontsize=8)
    ax2.plot(x, [r["restore_ms"] for r in rows], "o-", label="restore (verified)")
    ax2.plot(x, [r["h2d_copy_ms"] for r in rows], ":", color="gray", label="pinned H2D copy")
    ax2.plot(x, [r["save_ms"] for r in rows], "s-", label="save")
    ax2.plot(x, [r["prefill_floor_ms"] for r in rows], "^-", label="prefill GEMM floor")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("tokens (K)")
    ax2.set_ylabel("ms")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(res: dict[str, Any]) -> None:
    env = res["env"]
    print(
        f"\n{env['gpu']}  torch {env['torch']}  triton {env['triton']}  Granite-4.0-H-350M layout; "
        f"bf16 matmul {res['matmul_tflops']:.0f} TFLOP/s; median of {res['reps']}; "
        f"real prefill kernels: {res['real_prefill_kernels'] or 'none installed (no prefill measured)'}"
    )
    hdr = (
        f"{'tokens':>7} {'MB':>7} {'restore ms':>10} {'H2D ms':>7} {'link':>5} {'save ms':>8} {'D2H ms':>7} "
        f"{'link':>5} {'runs: restore':>13} {'save':>5} {'floor ms':>9} {'floor/restore':>13} ok"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in res["rows"]:
        paths = " ".join(f"{p} {v:.3f}" for p, v in r["restore_ms_by_path"].items())
        print(
            f"{r['tokens']:>7} {r['bytes'] / 1e6:>7.1f} {r['restore_ms']:>10.3f} {r['h2d_copy_ms']:>7.3f} "
            f"{r['link_ratio']:>5.2f} {r['save_ms']:>8.3f} {r['d2h_copy_ms']:>7.3f} {r['save_link_ratio']:>5.2f} "
            f"{r['link_ratio_runs']:>13.2f} {r['save_link_ratio_runs']:>5.2f} {r['prefill_floor_ms']:>9.2f} {r['floor_over_restore']:>12.1f}x "
            f"{'yes' if r['restored_ok'] and r['saved_ok'] else 'NO'}   (restore by path: {paths} ms; "
            f"host: restore {r['restore_host_ms']:.3f} save {r['save_host_ms']:.3f} ms)"
        )
    print(
        f"link = bytes/s over a pinned copy of the same bytes in this run (target >= {TARGET}); restore = "
        "default paths, checksums verified on the GPU, arena slots at random; 'runs': the same with the "
        "slots end to end (as the connector's saves reserve them); floor = dense-GEMM lower bound of any "
        "prefill; host = time until the call had issued everything (near the call's time: host-bound)."
    )
