"""`umbp bench transfer` (CUDA): page moves between GPU KV pages and the page-locked arena, as a ratio to a
plain 1 GiB page-locked copy measured in the same run.

Method: every figure is bytes of page payload over the wall time from the first submit to the last
completion (host-side planning included), median of `--reps` after warm-up. The "queued" columns time
the same calls issued while the GPU is still busy (a sleep kernel queued first, as a serving step's
forward would be): from the moment the device could start on them to their completion, so the host's
per-call planning hides behind that work, as it does in a serving engine; they measure the data path
itself, and the gap between a cold column and its queued one is the host time in front of the copies. A direction's payload
(`--total-mib`) is cut into `--batches` batches submitted back to back, as the connector submits one
batch per step while earlier ones still run. Blocks are drawn at random from a KV cache twice the
payload; arena slots either at random from an arena twice the payload ("scattered") or adjacent per
batch ("slots in runs", what the scheduler's DramIndex.reserve_many hands out while the arena has long
free runs). Data is random.
The baseline is one `copy_` of a 1 GiB page-locked buffer per direction, and one per direction on two
streams at once. A sample of objects is checked byte-for-byte and by digest on every layout.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from umbp.tools import cuda_timing
from umbp.tools.argtypes import counts, whole
from umbp.tools.benchutil import write_json
from umbp.tools.cuda_timing import baseline, device_env, wall

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGES = (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB)
TARGET_RATIO, TARGET_BOTH = 0.94, 95.0  # per direction for 16-64 KiB pages; GB/s both ways
SUSTAIN = 4  # passes of the both-ways row back to back for its sustained figure (see measure)


def _block_shapes(text: str) -> list[tuple[int, int]]:
    """--sweep-blocks: a comma list of BLOCKxWARPS (powers of two: Triton's BLOCK and num_warps)."""
    shapes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            block, warps = (int(v) for v in part.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not BLOCKxWARPS (e.g. 1024x4)") from None
        if not (
            64 <= block <= 65536 and 1 <= warps <= 32 and not block & (block - 1) and not warps & (warps - 1)
        ):
            raise argparse.ArgumentTypeError(
                f"{part!r}: BLOCK a power of two from 64 to 65536, WARPS from 1 to 32"
            )
        shapes.append((block, warps))
    return shapes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="small fast run (smoke test; not representative)"
    )
    parser.add_argument(
        "--out", default="umbp-out/bench_transfer.json", help="JSON path (default: %(default)s)"
    )
    parser.add_argument("--png", default=None, help="plot path (default: the JSON path with .png)")
    parser.add_argument("--reps", type=whole(1), default=None, help="timed repetitions (default 7, quick 2)")
    parser.add_argument(
        "--total-mib", type=whole(1), default=None, help="payload per direction (default 1024, quick 64)"
    )
    parser.add_argument(
        "--paths",
        type=lambda text: [p for p in text.split(",") if p],
        default=[],
        help="measure only these paths, in this order (comma-separated row labels, e.g. 'auto,dma'; "
        "default: every path, auto last)",
    )
    parser.add_argument(
        "--batches", type=whole(1), default=4, help="batches the payload is cut into (default 4)"
    )
    parser.add_argument("--ctas", type=whole(1), default=None, help="kernel grid size (default: one per SM)")
    parser.add_argument(
        "--sweep-ctas",
        type=counts(1, 1 << 16, empty=True),
        default="16,33,66,132",
        help="grid sizes tried at 16 KiB pages",
    )
    parser.add_argument(
        "--sweep-blocks",
        type=_block_shapes,
        default="512x4,1024x4,2048x4,2048x8,4096x8",
        help="kernel BLOCKxnum_warps tried at 16 KiB pages",
    )
    parser.add_argument("--no-staged", action="store_true", help="skip the staged-path comparison rows")
    parser.add_argument(
        "--only",
        default="",
        help="measure only the layouts whose name contains one of these comma-separated words (e.g. 'granite')",
    )


# ---- one layout ---------------------------------------------------------------------------------------


class Case:
    """A layout with two disjoint random (blocks, slots) sets: one saved, one loaded, per run."""

    def __init__(
        self,
        name: str,
        groups: dict,
        arena: Any,
        payload: int,
        batches: int,
        seed: int,
        slots: str = "scattered",
    ):
        import numpy as np

        self.name, self.groups, self.arena = name, groups, arena
        rng = np.random.default_rng(seed)
        sizes = {g: _object_bytes(layers) for g, layers in groups.items()}
        per_group = max(1, payload // sum(sizes.values()))
        nblocks = min(t.shape[d] for layers in groups.values() for t, d in layers)
        blocks = rng.permutation(nblocks)
        slot = max(sizes.values()) + 4095 & ~4095
        nslots = arena.capacity_bytes // slot
        # "runs": each batch's objects in adjacent slots, as DramIndex.reserve_many hands them out
        self.slot_bytes = None if slots == "scattered" else slot  # runs: each slot's pad is its own
        slots = (rng.permutation(nslots) if slots == "scattered" else np.arange(nslots)) * slot
        self.sets: list[list[list[Any]]] = []  # [save|load][batch] -> list of Moves
        need = 2 * per_group * len(groups)
        if need > min(blocks.size, slots.size):
            raise ValueError(f"{name}: needs {need} blocks and slots, has {blocks.size} / {slots.size}")
        self.payload = per_group * sum(sizes.values())
        self._cut(blocks[:need], slots[:need], per_group, batches)

    def _cut(self, blocks: Any, slots: Any, per_group: int, batches: int) -> None:
        from umbp.transfer import Moves

        i = 0
        for _ in range(2):
            cur: list[list[Any]] = [[] for _ in range(batches)]
            for g in self.groups:
                b, s = blocks[i : i + per_group], slots[i : i + per_group]
                i += per_group
                for k, (bb, ss) in enumerate(zip(_split(b, batches), _split(s, batches))):
                    if len(bb):
                        cur[k].append(
                            Moves(g, [int(x) for x in bb], [int(x) for x in ss], None, self.slot_bytes)
                        )
            self.sets.append([c for c in cur if c])


def _split(a: Any, k: int) -> list[Any]:
    n = len(a)
    return [a[n * j // k : n * (j + 1) // k] for j in range(k)]


def _object_bytes(layers: list) -> int:
    return sum(t.numel() // t.shape[d] * t.element_size() for t, d in layers)


def _with_digests(batches: list[list[Any]], digests: list[list[list[int]]]) -> list[list[Any]]:
    from umbp.transfer import Moves

    return [
        [Moves(m.group, m.block_ids, m.offsets, ds, m.slot_bytes) for m, ds in zip(batch, dig)]
        for batch, dig in zip(batches, digests)
    ]


QUEUED = ("save", "load", "both")  # modes also timed queued behind GPU work (see cuda_timing.queued)


def measure(
    engine: Any, case: Case, reps: int, modes: tuple[str, ...], queued: bool = True
) -> dict[str, float]:
    """GB/s per mode: save, load, load_verified, both (save + load at once: batches of the two sets
    issued alternately, 1 x payload each way), and with both also both_sustained (SUSTAIN such passes
    back to back: the second direction's first copy can start only once the first call's host planning
    is done, a fixed cost the single pass pays in full and a steady stream of transfers amortizes).
    With `queued`, save, load and both are also timed queued behind GPU work (`<mode>_queued`, see
    cuda_timing.queued)."""
    saves, loads = case.sets
    digests = [engine.save(b).result() for b in loads]  # the load set's slots hold real objects
    verified = _with_digests(loads, digests)

    def issuer(*sets: list[list[Any]], passes: int = 1) -> Callable[[], list]:
        def issue() -> list:
            handles = []
            for _ in range(passes):
                for k in range(max(len(s) for s in sets)):
                    handles += [
                        (engine.save if s is saves else engine.load)(s[k]) for s in sets if k < len(s)
                    ]
            return handles

        return issue

    def waited(issue: Callable[[], list]) -> Callable[[], None]:
        def go() -> None:
            for h in issue():
                h.wait()

        return go

    issues = {
        "save": issuer(saves),
        "load": issuer(loads),
        "load_verified": issuer(verified),
        "both": issuer(saves, loads),
        "both_sustained": issuer(saves, loads, passes=SUSTAIN),
    }
    out = {}
    for mode in modes + (("both_sustained",) if "both" in modes else ()):
        nbytes = case.payload * {"both": 2, "both_sustained": 2 * SUSTAIN}.get(mode, 1)
        out[mode] = nbytes / wall(waited(issues[mode]), reps) / 1e9
        if queued and mode in QUEUED:
            seconds, ahead = cuda_timing.queued(issues[mode], reps, hold=cuda_timing.engine_streams(engine))
            out[mode + "_queued"], out[mode + "_queued_ahead"] = nbytes / seconds / 1e9, ahead
    out["sample_ok"] = float(check_sample(engine, case, verified))
    return out


def check_sample(engine: Any, case: Case, verified: list[list[Any]]) -> bool:
    """Every byte and digest of up to 8 objects per group, after the timed runs (slots hold the saves)."""
    import numpy as np
    import torch

    from umbp.pool.checksum import checksum_u8

    ok = True
    for m in (m for batch in verified for m in batch):
        layers = case.groups[m.group]
        for b, o, d in list(zip(m.block_ids, m.offsets, m.digests))[:8]:
            ref = np.concatenate(
                [t.select(dim, b).contiguous().view(-1).view(torch.uint8).cpu().numpy() for t, dim in layers]
            )
            ok &= bool(np.array_equal(case.arena.view(o, ref.size), ref)) and checksum_u8(ref) == d
    return ok


# ---- the run ------------------------------------------------------------------------------------------


def _layouts(page: int, nblocks: int, device: str) -> dict:
    from umbp.transfer import model_layouts as L

    return {0: L.attention(4, nblocks, page // 1024, 4, 64, device=device)}  # Granite attention: 1 KiB/token


def run(args: argparse.Namespace) -> int:
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown:
        print(
            f"umbp bench transfer: unknown path {unknown[0]!r} (paths: {', '.join(PATHS)})", file=sys.stderr
        )
        return 2
    try:
        import torch
    except ImportError:
        print("umbp bench transfer: needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("umbp bench transfer: needs a CUDA device (run it on the GPU machine)", file=sys.stderr)
        return 2
    from umbp.pool import Arena

    reps = args.reps or (2 if args.quick else 7)
    payload = (args.total_mib or (64 if args.quick else 1024)) * MiB
    torch.manual_seed(int(time.time()))
    res: dict[str, Any] = {
        "command": "umbp " + " ".join(sys.argv[1:]),
        "argv0": sys.argv[0],
        "env": device_env(),
        "payload_bytes": payload,
        "batches": args.batches,
        "reps": reps,
    }
    res["baseline"] = baseline(reps)
    arena = Arena(2 * payload + 64 * MiB, pinned=True, prefault=False)
    res["rows"] = rows = []
    for page in PAGES:
        rows += _page_rows(args, arena, page, payload, reps)
        torch.cuda.empty_cache()
    rows += _granite_rows(args, arena, payload, reps)
    for page in (16 * KiB, 64 * KiB):
        rows += _page_rows(args, arena, page, payload, reps, slots="runs")
        torch.cuda.empty_cache()
    rows += _granite_rows(args, arena, payload, reps, slots="runs")
    res["ctas_sweep"] = _sweep(args, arena, payload, reps)
    _write(args, res)
    print_table(res)
    return 0


PATHS = {  # row label -> (backend, save path, load path); "both" of the mixed rows pairs the two paths
    "zero-copy": ("kernel", "zero-copy", "zero-copy"),
    "dma": ("kernel", "dma", "dma"),
    "save zero-copy + load dma": ("kernel", "zero-copy", "dma"),
    "save dma + load zero-copy": ("kernel", "dma", "zero-copy"),
    "staged": ("staged", None, None),
    "auto": ("kernel", "auto", "auto"),  # the engine's default choice, what the connector runs
}
MODES = {
    "zero-copy": ("save", "load", "load_verified", "both"),
    "dma": ("save", "load", "load_verified", "both"),
    "save zero-copy + load dma": ("both",),
    "save dma + load zero-copy": ("both",),
    "staged": ("save", "load_verified"),
    "auto": ("save", "load", "load_verified", "both"),
}
RUN_PATHS = ["zero-copy", "dma", "auto"]


def _engine(arena: Any, groups: dict, path: str, ctas: int | None, **options: Any) -> Any:
    from umbp.transfer import make_engine

    backend, save_path, load_path = PATHS[path]
    if backend == "staged":
        return make_engine(arena, groups, backend="staged")
    opts = dict(save_path=save_path, load_path=load_path, **options)
    if ctas:
        opts["ctas"] = ctas
    return make_engine(arena, groups, backend="kernel", **opts)


def _rows_for(args: argparse.Namespace, case: Case, page: int, reps: int, paths: list[str]) -> list[dict]:
    if not any(word in case.name for word in args.only.split(",")):
        return []
    obj = max(_object_bytes(layers) for layers in case.groups.values())
    if args.paths:  # the order asked for: rows measured later may find the GPU warmer
        paths = [p for p in args.paths if p in paths]
    rows = []
    for path in paths:
        r = reps if path != "staged" else max(1, reps // 3)
        rows.append(
            dict(
                layout=case.name,
                page=page,
                object_bytes=obj,
                path=path,
                **measure(
                    _engine(case.arena, case.groups, path, args.ctas),
                    case,
                    r,
                    MODES[path],
                    queued=path != "staged",
                ),
            )
        )
    return rows


def _page_rows(
    args: argparse.Namespace, arena: Any, page: int, payload: int, reps: int, slots: str = "scattered"
) -> list[dict]:
    nobj = max(1, payload // (4 * page))
    groups = _layouts(page, 2 * nobj + 8, "cuda")
    case = Case(
        f"attention kv-first {page // KiB} KiB" + _RUNS[slots],
        groups,
        arena,
        payload,
        args.batches,
        seed=page,
        slots=slots,
    )
    if slots == "runs":
        return _rows_for(args, case, page, reps, RUN_PATHS)
    paths = [p for p in PATHS if p != "staged" or (not args.no_staged and page in (16 * KiB, 1 * MiB))]
    return _rows_for(args, case, page, reps, paths)


_RUNS = {"scattered": "", "runs": ", slots in runs"}


def _granite_rows(
    args: argparse.Namespace, arena: Any, payload: int, reps: int, slots: str = "scattered"
) -> list[dict]:
    from umbp.transfer import model_layouts as L

    s = L.granite_sizes()
    nobj = max(1, payload // (s["page_bytes"] * s["attention_layers"]))
    groups, _ = L.granite_hybrid(2 * nobj + 16, device="cuda")
    case = Case(
        "granite-4.0-h-350m hybrid" + _RUNS[slots], groups, arena, payload, args.batches, seed=7, slots=slots
    )
    paths = RUN_PATHS if slots == "runs" else [p for p in PATHS if p != "staged"]
    return _rows_for(args, case, s["page_bytes"], reps, paths)


def _sweep(args: argparse.Namespace, arena: Any, payload: int, reps: int) -> list[dict]:
    """Throughput against grid size at 16 KiB pages: how many SMs the copy needs (the rest run the model)."""
    page = 16 * KiB
    nobj = max(1, payload // (4 * page))
    groups = _layouts(page, 2 * nobj + 8, "cuda")
    case = Case("sweep", groups, arena, payload, args.batches, seed=1)
    out = []
    for ctas in args.sweep_ctas:
        r = measure(
            _engine(arena, groups, "zero-copy", ctas),
            case,
            max(2, reps // 2),
            ("save", "load", "both"),
            queued=False,
        )
        out.append(dict(ctas=ctas, block=1024, num_warps=4, **r))
    for block, warps in args.sweep_blocks:
        eng = _engine(arena, groups, "zero-copy", args.ctas, block=block, num_warps=warps)
        out.append(
            dict(
                ctas=args.ctas or 0,
                block=block,
                num_warps=warps,
                **measure(eng, case, max(2, reps // 2), ("save", "load", "both"), queued=False),
            )
        )
    return out


# ---- output -------------------------------------------------------------------------------------------


def _write(args: argparse.Namespace, res: dict[str, Any]) -> None:
    out = write_json(args.out, res, indent=1)
    png = Path(args.png) if args.png else out.with_suffix(".png")
    try:
        plot(res, png)
        res["png"] = str(png)
    except ImportError as exc:
        print(f"(no plot: {exc})", file=sys.stderr)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = res["baseline"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, runs, color in (("zero-copy", False, "C0"), ("dma", False, "C1"), ("dma", True, "C2")):
        kern = [
            r
            for r in res["rows"]
            if r["path"] == name
            and r["layout"].startswith("attention")
            and ("slots in runs" in r["layout"]) == runs
        ]
        x = [r["page"] // KiB for r in kern]
        label = name + (", slots in runs" if runs else "")
        for mode, style in (("save", "o-"), ("load", "s--"), ("both", "D-.")):
            ax.plot(x, [r[mode] for r in kern], style, color=color, label=f"{label} {mode}")
    for key, ls in (("d2h", "--"), ("h2d", ":"), ("both", "-.")):
        ax.axhline(base[key], color="gray", ls=ls, lw=1, label=f"1 GiB pinned copy {key}")
    if not any(r["layout"].startswith("attention") for r in res["rows"]):  # --only without them
        ax.set_visible(False)
    else:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("page size per layer (KiB), FlashAttention layout, 4 layers per object")
    ax.set_ylabel("GB/s")
    ax.set_title(f"{res['env']['gpu']}: scattered GPU blocks <-> page-locked arena")
    ax.legend(fontsize=7)
    sw = [r for r in res["ctas_sweep"] if r["block"] == 1024 and r["num_warps"] == 4 and r["ctas"]]
    if not sw:  # --sweep-ctas ""
        ax2.set_visible(False)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    ax2.plot([r["ctas"] for r in sw], [r["save"] for r in sw], "o-", label="save (D2H)")
    ax2.plot([r["ctas"] for r in sw], [r["load"] for r in sw], "s-", label="load (H2D)")
    ax2.axhline(base["d2h"], color="gray", ls="--", lw=1)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("kernel grid (CTAs), 16 KiB pages")
    ax2.set_title("throughput vs SMs used")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(res: dict[str, Any]) -> None:
    base = res["baseline"]
    print(
        f"\n{res['env']['gpu']}  torch {res['env']['torch']}  triton {res['env']['triton']}  "
        f"payload {res['payload_bytes'] // MiB} MiB/direction in {res['batches']} batches, median of {res['reps']}"
    )
    print(
        f"baseline 1 GiB pinned copy: D2H {base['d2h']:.1f}  H2D {base['h2d']:.1f}  both {base['both']:.1f} GB/s"
    )
    print(
        "zero-copy kernel sweep at 16 KiB (ctas/BLOCKxwarps: save/load/both GB/s): "
        + "  ".join(
            f"{r['ctas'] or 'SMs'}/{r['block']}x{r['num_warps']}: {r['save']:.1f}/{r['load']:.1f}/{r['both']:.1f}"
            for r in res["ctas_sweep"]
        )
    )
    hdr = (
        f"{'layout':<46} {'object':>8} {'path':<26} {'save D2H':>13} {'queued':>13} {'load H2D':>13} "
        f"{'queued':>13} {'load+verify':>13} {'both':>13} {'queued':>13} {'both x' + str(SUSTAIN):>13} ok"
    )
    print(hdr)
    print("-" * len(hdr))
    late = []
    for r in res["rows"]:
        cells = [
            _cell(r.get("save"), base["d2h"]),
            _cell(r.get("save_queued"), base["d2h"]),
            _cell(r.get("load"), base["h2d"]),
            _cell(r.get("load_queued"), base["h2d"]),
            _cell(r.get("load_verified"), base["h2d"]),
            _cell(r.get("both"), base["both"]),
            _cell(r.get("both_queued"), base["both"]),
            _cell(r.get("both_sustained"), base["both"]),
        ]
        print(
            f"{r['layout']:<46} {_size(r['object_bytes']):>8} {r['path']:<26} "
            + " ".join(f"{c:>13}" for c in cells)
            + f" {'yes' if r.get('sample_ok') else 'NO'}"
        )
        late += [f"{r['layout']} {r['path']} {m}" for m in QUEUED if r.get(m + "_queued_ahead", 1.0) < 1.0]
    print(
        "cells: GB/s (ratio to the pinned copy of the same direction; 'both' to both-at-once). 'both': one "
        f"pass of the payload each way; 'both x{SUSTAIN}': {SUSTAIN} passes back to back (sustained). "
        "'queued': the same calls issued behind GPU work, timed from when the device could start (host "
        f"planning hidden, as behind a serving step's forward). Targets: >= {TARGET_RATIO} per direction at "
        f"16-64 KiB, >= {TARGET_BOTH:.0f} GB/s both."
    )
    if late:
        print(
            "queued cells that include host time (the GPU's sleep ended before every call was issued in some "
            "repetitions): " + "; ".join(late)
        )


def _size(n: int) -> str:
    return f"{n / MiB:.2f}M" if n >= MiB else f"{n // KiB}K"


def _cell(v: float | None, ref: float) -> str:
    return "-" if v is None else f"{v:4.1f} ({v / ref:.2f})"
