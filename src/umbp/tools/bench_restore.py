"""`umbp bench restore` (CUDA): prefill of N tokens versus restoring the same N tokens' pages from the arena.

Model: transformers' GraniteMoeHybridForCausalLM built from the public Granite-4.0-H-350M config with random
weights, bf16, on the GPU (no hub access). Prefill: one forward of N random tokens, no cache, logits for
the last token only (what a serving engine computes), median of `--reps` after a warm-up. Restore: one
`engine.load` of the attention pages covering N tokens (ceil(N / 400) blocks of the 4 attention layers)
plus the boundary state of the 28 Mamba2 layers (one block of each of the 7 state groups), in vLLM's
hybrid layout (400-token blocks, state pages padded to 409600 bytes), from scattered page-locked arena
slots into scattered GPU blocks, checksums verified on the GPU; wall time from submit to completion.

The prefill figure depends on the Mamba2 implementation transformers picks (fused mamba_ssm kernels, or
its pure-torch fallback when they are not installed); the JSON records which, and a GEMM lower bound for
the prefill (FLOPs of the dense layers at the measured bf16 matmul rate) is reported beside it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from umbp.tools.bench_transfer import _env, _wall
from umbp.tools.benchutil import write_json

TARGET = 20.0  # prefill / restore at 8K tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="small fast run (smoke test; not representative)"
    )
    parser.add_argument(
        "--out", default="umbp-out/bench_restore.json", help="JSON path (default: %(default)s)"
    )
    parser.add_argument("--png", default=None, help="plot path (default: the JSON path with .png)")
    parser.add_argument(
        "--tokens", default=None, help="comma-separated N (default 1024,8192,16384,32768; quick 1024)"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5, quick 2)")


def build_model(device: str = "cuda") -> tuple[Any, dict[str, Any]]:
    """GraniteMoeHybrid from the Granite-4.0-H-350M config, random weights, bf16 on the device."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from umbp.transfer.model_layouts import GRANITE_4_0_H_350M

    kw = dict(GRANITE_4_0_H_350M)
    # transformers 5 names the Mamba layers "linear_attention" (anything else is attention)
    kw["layer_types"] = ["linear_attention" if t == "mamba" else "full_attention" for t in kw["layer_types"]]
    cfg = GraniteMoeHybridConfig(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: seconds instead of a minute on the CPU
        model = GraniteMoeHybridForCausalLM(cfg)
    model = model.to(dtype=torch.bfloat16).eval()
    layers = model.model.layers
    n_attn = sum(layer.self_attn is not None for layer in layers)
    params = sum(p.numel() for p in model.parameters())
    info = {
        "params": params,
        "attention_layers": n_attn,
        "mamba_layers": len(layers) - n_attn,
        "mamba_impl": _mamba_impl(),
        "attn_impl": cfg._attn_implementation,
    }
    return model, info


def _mamba_impl() -> str:
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as m

    fn = getattr(m, "mamba2_chunk_scan", None) or getattr(m, "mamba_chunk_scan_combined", None)
    mod = getattr(fn, "__module__", "?") if fn is not None else "?"
    return f"{getattr(fn, '__name__', '?')} from {mod}"


def prefill_seconds(model: Any, n: int, reps: int) -> float:
    import torch

    ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda")

    def fwd() -> None:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    return _wall(fwd, reps, warmup=1)


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / _wall(lambda: a @ b, reps) / 1e12


def prefill_floor_seconds(model: Any, n: int, tflops: float) -> float:
    """Dense-layer FLOPs (2 per weight per token, last-token logits, causal attention scores) at the
    measured matmul rate: no prefill implementation can beat this."""
    cfg = model.config
    embed = cfg.vocab_size * cfg.hidden_size
    dense = sum(p.numel() for p in model.parameters()) - embed
    n_attn = sum(layer.self_attn is not None for layer in model.model.layers)
    attn = n_attn * 2 * 2 * (n * n / 2) * cfg.hidden_size
    flops = 2 * n * dense + attn + 2 * embed
    return flops / (tflops * 1e12)


class Restore:
    """Granite's hybrid layout on the GPU, an arena holding every object for max N, and the engine."""

    def __init__(self, max_tokens: int, seed: int = 0):
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
        self.arena = Arena(2 * need * obj + (1 << 20), pinned=True, prefault=False)
        self.engine = make_engine(self.arena, self.groups)  # the default ("auto") paths
        self.engines = {
            p: make_engine(self.arena, self.groups, save_path=p, load_path=p) for p in ("zero-copy", "dma")
        }
        rng = np.random.default_rng(seed)
        self.blocks = [int(b) for b in rng.permutation(2 * need + 8)[:need]]
        self.slots = [int(s) * obj for s in rng.permutation(2 * need)[:need]]

    def batch(self, n: int) -> list[Any]:
        """Moves for N tokens: the attention blocks covering them + one boundary state per state group."""
        from umbp.transfer import Moves

        k = math.ceil(n / self.bs)
        moves = [Moves(0, self.blocks[:k], self.slots[:k])]
        for g in range(1, self.ngroups):
            moves.append(Moves(g, [self.blocks[k + g - 1]], [self.slots[k + g - 1]]))
        return moves

    def prepare(self, n: int) -> tuple[list[Any], int]:
        """Save the objects once (so the slots hold real data and digests), return the verified batch."""
        from umbp.transfer import Moves

        batch = self.batch(n)
        digests = self.engine.save(batch).result()
        nbytes = sum(len(m.block_ids) * self.engine.object_bytes(m.group) for m in batch)
        return [Moves(m.group, m.block_ids, m.offsets, d) for m, d in zip(batch, digests)], nbytes

    def seconds(self, batch: list[Any], reps: int, engine: Any = None) -> tuple[float, bool]:
        engine = engine or self.engine
        ok = all(all(r) for r in engine.load(batch).result())
        return _wall(lambda: engine.load(batch).wait(), reps), ok


def run(args: argparse.Namespace) -> int:
    try:
        import torch
        import transformers
    except ImportError as exc:
        print(f"umbp bench restore: needs torch with CUDA and transformers ({exc})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("umbp bench restore: needs a CUDA device (run it on the GPU machine)", file=sys.stderr)
        return 2
    tokens = [int(t) for t in (args.tokens or ("1024" if args.quick else "1024,8192,16384,32768")).split(",")]
    reps = args.reps or (2 if args.quick else 5)
    res: dict[str, Any] = {
        "command": "umbp " + " ".join(sys.argv[1:]),
        "argv0": sys.argv[0],
        "env": dict(_env(), transformers=transformers.__version__),
        "reps": reps,
    }
    model, res["model"] = build_model()
    res["matmul_tflops"] = tflops = matmul_tflops()
    restore = Restore(max(tokens))
    res["rows"] = [_row(model, restore, n, reps, tflops) for n in tokens]
    _write(args, res)
    print_table(res)
    return 0


def _row(model: Any, restore: Restore, n: int, reps: int, tflops: float) -> dict[str, Any]:
    import torch

    batch, nbytes = restore.prepare(n)
    restore_s, ok = restore.seconds(batch, reps)
    by_path = {p: restore.seconds(batch, reps, e) for p, e in restore.engines.items()}
    floor_s = prefill_floor_seconds(model, n, tflops)
    row = dict(
        tokens=n,
        restore_ms=restore_s * 1e3,
        restore_bytes=nbytes,
        restore_gbps=nbytes / restore_s / 1e9,
        restored_ok=ok and all(v[1] for v in by_path.values()),
        restore_ms_by_path={p: v[0] * 1e3 for p, v in by_path.items()},
        prefill_floor_ms=floor_s * 1e3,
        ratio_vs_floor=floor_s / restore_s,
    )
    try:
        prefill_s = prefill_seconds(model, n, reps)
    except torch.OutOfMemoryError as exc:  # transformers' torch Mamba2 fallback is quadratic in chunks
        torch.cuda.empty_cache()
        row.update(prefill_ms=None, ratio=None, prefill_error=str(exc).split(".")[0])
        return row
    row.update(prefill_ms=prefill_s * 1e3, ratio=prefill_s / restore_s)
    return row


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
    x = range(len(rows))
    nan = float("nan")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    w = 0.27
    ax.bar(
        [i - w for i in x],
        [r["prefill_ms"] or nan for r in rows],
        w,
        label="prefill (transformers, measured)",
    )
    ax.bar(list(x), [r["prefill_floor_ms"] for r in rows], w, label="prefill GEMM lower bound")
    ax.bar([i + w for i in x], [r["restore_ms"] for r in rows], w, label="umbp restore (verified)")
    for i, r in enumerate(rows):
        if r["prefill_ms"] is None:
            ax.annotate("OOM", (i - w, r["prefill_floor_ms"]), ha="center", va="bottom", fontsize=8)
        else:
            ax.annotate(f"{r['ratio']:.0f}x", (i - w, r["prefill_ms"]), ha="center", va="bottom", fontsize=8)
        ax.annotate(
            f"{r['ratio_vs_floor']:.1f}x", (i, r["prefill_floor_ms"]), ha="center", va="bottom", fontsize=8
        )
    ax.set_xticks(list(x), [f"{r['tokens'] // 1024}K tokens" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title(f"Granite-4.0-H-350M (random weights) on {res['env']['gpu']}: prefill vs restore")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(res: dict[str, Any]) -> None:
    m = res["model"]
    print(
        f"\n{res['env']['gpu']}  torch {res['env']['torch']}  transformers {res['env']['transformers']}  "
        f"model {m['params'] / 1e6:.0f}M params ({m['attention_layers']} attn + {m['mamba_layers']} Mamba2), "
        f"mamba: {m['mamba_impl']}; bf16 matmul {res['matmul_tflops']:.0f} TFLOP/s"
    )
    hdr = (
        f"{'tokens':>7} {'prefill ms':>11} {'restore ms':>11} {'restore MB':>11} {'GB/s':>6} "
        f"{'ratio':>7} {'floor ms':>9} {'ratio/floor':>12} ok"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in res["rows"]:
        pre = "OOM" if r["prefill_ms"] is None else f"{r['prefill_ms']:.2f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        paths = " ".join(f"{p} {v:.3f}" for p, v in r["restore_ms_by_path"].items())
        print(
            f"{r['tokens']:>7} {pre:>11} {r['restore_ms']:>11.3f} {r['restore_bytes'] / 1e6:>11.1f} "
            f"{r['restore_gbps']:>6.1f} {ratio:>7} {r['prefill_floor_ms']:>9.2f} "
            f"{r['ratio_vs_floor']:>11.1f}x {'yes' if r['restored_ok'] else 'NO'}   ({paths} ms)"
        )
    print(
        f"ratio = measured prefill / restore (target >= {TARGET:.0f}x at 8K); floor = dense-GEMM lower bound "
        "of any prefill at the measured matmul rate; restore = default paths, verified; by path in brackets."
    )
