"""`umbp bench pool`: DRAM pool put/get throughput as a ratio to a plain numpy copy, and the exists rate.

Method (why it is honest): the pool and the baseline copy the same objects between the same kind of
prefaulted buffers, in the same run, alternating which goes first each repetition; the working set is
several times the L3 cache, so both pay real DRAM bandwidth; the figure is the median of the per-repetition
ratios. The baseline is `np.copyto` per object; the pool additionally computes (put) or verifies (get) a
checksum of every byte, takes its lock and does its bookkeeping. The first repetition also checks that
every byte read back equals what was written.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from umbp.tools.argtypes import whole
from umbp.tools.benchutil import Progress, check_memory, human, timed, write_json

KiB, MiB = 1 << 10, 1 << 20
SIZES = (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
RATIO_TARGET = 0.9  # for objects >= RATIO_TARGET_MIN_SIZE
RATIO_TARGET_MIN_SIZE = 256 * KiB
EXISTS_TARGET = 1_000_000  # keys/s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="small, fast run (smoke test; not representative)"
    )
    parser.add_argument(
        "--out", default="umbp-out/bench_pool.json", help="JSON output path (default: %(default)s)"
    )
    parser.add_argument(
        "--reps", type=whole(1), default=None, help="repetitions per size (default 9, quick 2)"
    )
    parser.add_argument(
        "--working-set-mib",
        type=whole(1),
        default=None,
        help="bytes moved per pass, in MiB (default: max(256, 4 x L3), quick 16)",
    )
    parser.add_argument("--batch", type=whole(1), default=32, help="keys per put/get_into call (default 32)")
    parser.add_argument(
        "--copy-threads",
        type=whole(1),
        default=1,
        help="DramPool copy_threads (default 1, the pool's default; the numpy baseline is always 1)",
    )
    parser.add_argument(
        "--exists-keys", type=whole(1), default=None, help="keys per exists() call (default 100000)"
    )


# ---- progress -------------------------------------------------------------------------------------------


# ---- measurement helpers ------------------------------------------------------------------------------


def _l3_bytes() -> int | None:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                text = (index / "size").read_text().strip().upper()
                scale = {"K": KiB, "M": MiB}.get(text[-1], 1)
                return int(text.rstrip("KM")) * scale
        except (OSError, ValueError):
            continue
    return None


def _config(args: argparse.Namespace) -> dict[str, Any]:
    l3 = _l3_bytes()
    default_ws = 16 if args.quick else max(256, 4 * (l3 or 32 * MiB) // MiB)
    return {
        "quick": bool(args.quick),
        "working_set_bytes": (args.working_set_mib or default_ws) * MiB,
        "l3_bytes": l3,
        "reps": args.reps or (2 if args.quick else 9),
        "batch": max(1, args.batch),
        "copy_threads": max(1, args.copy_threads),
        "exists_keys": args.exists_keys or (20_000 if args.quick else 100_000),
        "sizes": list(SIZES),
    }


# ---- the benchmark ------------------------------------------------------------------------------------


class _Bench:
    def __init__(self, cfg: dict[str, Any], progress: Progress) -> None:
        import numpy as np

        from umbp.pool import DramPool

        self.np, self.cfg, self.progress = np, cfg, progress
        ws = cfg["working_set_bytes"]
        self.src = np.arange(ws // 8, dtype=np.uint64).view(np.uint8)  # distinct words: a wrong copy shows
        self.copy_dst = np.zeros(ws, np.uint8)
        self.get_dst = np.zeros(ws, np.uint8)
        self.copy_dst.fill(1)  # prefault: neither side pays page faults in the timed passes
        self.get_dst.fill(1)
        self.pool = DramPool(
            capacity_bytes=ws,
            high_watermark=1.0,
            low_watermark=1.0,
            pinned="auto",
            copy_threads=cfg["copy_threads"],
        )

    def run_size(self, size: int) -> list[dict[str, Any]]:
        np, cfg, pool = self.np, self.cfg, self.pool
        n, batch = cfg["working_set_bytes"] // size, cfg["batch"]
        keys = [f"bench/{size}/{i}" for i in range(n)]
        objs = [self.src[i * size : (i + 1) * size] for i in range(n)]
        copies = [self.copy_dst[i * size : (i + 1) * size] for i in range(n)]
        outs = [self.get_dst[i * size : (i + 1) * size] for i in range(n)]
        batches = [slice(i, i + batch) for i in range(0, n, batch)]

        def copy_put() -> None:
            for o, d in zip(objs, copies, strict=True):
                np.copyto(d, o)

        def copy_get() -> None:
            for c, d in zip(copies, outs, strict=True):
                np.copyto(d, c)

        def pool_put() -> None:
            for b in batches:
                if not all(pool.put(keys[b], objs[b])):
                    raise RuntimeError("umbp bench: a put failed; the arena should hold the working set")

        def pool_get() -> None:
            for b in batches:
                if not all(pool.get_into(keys[b], outs[b])):
                    raise RuntimeError("umbp bench: a get missed; every key was just stored")

        times: dict[str, list[float]] = {"put": [], "put_np": [], "get": [], "get_np": []}
        for rep in range(cfg["reps"]):
            pool.clear()
            order = [("put_np", copy_put), ("put", pool_put), ("get_np", copy_get), ("get", pool_get)]
            if rep % 2:  # alternate who goes first, keeping put before get for each side
                order = [order[1], order[0], order[3], order[2]]
            for name, fn in order:
                times[name].append(timed(fn))
            if rep == 0:  # untimed honesty check: the pool's get alone must reproduce every byte
                self.get_dst.fill(0)
                pool_get()
                if not np.array_equal(self.get_dst[: n * size], self.src[: n * size]):
                    raise RuntimeError("umbp bench: bytes read back differ from bytes written")
            self.progress.step(f"put/get {human(size)}")
        pool.clear()
        return [self._row(op, size, n, times[op], times[op + "_np"]) for op in ("put", "get")]

    def _row(self, op: str, size: int, n: int, t_pool: list[float], t_np: list[float]) -> dict[str, Any]:
        moved = n * size
        ratios = [b / p for p, b in zip(t_pool, t_np, strict=True)]
        ratio = statistics.median(ratios)
        target = RATIO_TARGET if size >= RATIO_TARGET_MIN_SIZE else None
        verdict = "info" if target is None else ("PASS" if ratio >= target else "MISS")
        return {
            "op": op,
            "size_bytes": size,
            "objects": n,
            "pool_gbps": moved / statistics.median(t_pool) / 1e9,
            "numpy_gbps": moved / statistics.median(t_np) / 1e9,
            "ratio": ratio,
            "ratios": ratios,
            "target_ratio": target,
            "verdict": verdict,
        }

    def run_exists(self) -> dict[str, Any]:
        from umbp.pool import DramPool

        nkeys = self.cfg["exists_keys"]
        pool = DramPool(
            capacity_bytes=max(nkeys * 64, 4096), alignment=64, high_watermark=1.0, low_watermark=1.0
        )
        keys = [f"exists/{i}" for i in range(nkeys)]
        blob = bytes(64)
        for i in range(0, nkeys, 2 * 1024):  # every other key present: hits and misses both cost
            pool.put(keys[i : i + 2 * 1024 : 2], [blob] * len(keys[i : i + 2 * 1024 : 2]))
        times = []
        for _ in range(self.cfg["reps"]):
            times.append(timed(lambda: pool.exists(keys)))
            self.progress.step("exists")
        present = sum(pool.exists(keys))
        rate = nkeys / statistics.median(times)
        pool.close()
        return {
            "keys": nkeys,
            "present": present,
            "keys_per_s": rate,
            "target_keys_per_s": EXISTS_TARGET,
            "verdict": "PASS" if rate >= EXISTS_TARGET else "MISS",
        }

    def run_checksum(self) -> dict[str, Any]:
        """psum64 alone, cache-hot (256 KiB) and streaming from DRAM (the working set), next to the
        candidates it was chosen over, all on the same cache-hot 256 KiB."""
        import hashlib
        import zlib

        from umbp.pool.checksum import checksum

        np, hot = self.np, self.src[: 256 * KiB]
        words = hot.view(np.uint64)
        candidates: dict[str, Callable[[], Any]] = {
            "psum64": lambda: checksum(hot),
            "numpy uint64 sum": lambda: np.add.reduce(words),
            "numpy uint64 sum+xor": lambda: (np.add.reduce(words), np.bitwise_xor.reduce(words)),
            "zlib.crc32": lambda: zlib.crc32(hot),
            "zlib.adler32": lambda: zlib.adler32(hot),
            "hashlib.sha1": lambda: hashlib.sha1(hot).digest(),
            "hashlib.blake2b": lambda: hashlib.blake2b(hot, digest_size=8).digest(),
        }
        gbps = {}
        for name, fn in candidates.items():
            t = statistics.median(timed(lambda fn=fn: [fn() for _ in range(32)]) for _ in range(5))
            gbps[name] = 32 * hot.size / t / 1e9
        t_dram = statistics.median(timed(lambda: checksum(self.src)) for _ in range(3))
        self.progress.step("checksum")
        return {
            "name": "psum64",
            "cache_hot_gbps": gbps["psum64"],
            "dram_gbps": self.src.size / t_dram / 1e9,
            "candidates_cache_hot_gbps": gbps,
        }


def _machine() -> dict[str, Any]:
    import numpy as np

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "processor": platform.processor() or platform.machine(),
    }


def _print_table(report: dict[str, Any]) -> None:
    cfg = report["config"]
    l3 = f"L3 {human(cfg['l3_bytes'])}" if cfg["l3_bytes"] else "L3 unknown"
    print(
        f"umbp bench pool: working set {human(cfg['working_set_bytes'])} ({l3}), {cfg['reps']} reps, "
        f"batch {cfg['batch']}, copy_threads {cfg['copy_threads']}, arena {cfg['arena_backend']}, medians; "
        "ratio = pool / np.copyto (1 thread)" + ("  [--quick: not representative]" if cfg["quick"] else "")
    )
    print(f"{'op':<7}{'size':>9}{'pool GB/s':>11}{'numpy GB/s':>12}{'ratio':>8}{'target':>9}  result")
    for r in report["results"]:
        target = f">={r['target_ratio']:.2f}" if r["target_ratio"] is not None else "-"
        print(
            f"{r['op']:<7}{human(r['size_bytes']):>9}{r['pool_gbps']:>11.2f}{r['numpy_gbps']:>12.2f}"
            f"{r['ratio']:>8.2f}{target:>9}  {r['verdict']}"
        )
    e = report["exists"]
    print(
        f"{'exists':<7}{e['keys']:>9} keys  {e['keys_per_s'] / 1e6:.2f} M keys/s"
        f"{'>=' + format(e['target_keys_per_s'] / 1e6, '.1f') + ' M/s':>23}  {e['verdict']}"
    )
    c = report["checksum"]
    print(
        f"checksum {c['name']}: {c['cache_hot_gbps']:.1f} GB/s cache-hot, {c['dram_gbps']:.1f} GB/s from DRAM"
    )


def run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    # the source, two destinations and the pool's arena
    check_memory("umbp bench pool", 4 * cfg["working_set_bytes"], "--working-set-mib (4 copies of it)")
    if not cfg["quick"] and cfg["l3_bytes"] and cfg["working_set_bytes"] < 2 * cfg["l3_bytes"]:
        print(
            "umbp bench pool: warning: the working set is under 2x L3; figures will flatter both sides",
            file=sys.stderr,
        )
    progress = Progress(len(SIZES) * cfg["reps"] + cfg["reps"] + 1)
    try:
        bench = _Bench(cfg, progress)
        cfg["arena_backend"] = bench.pool.stats()["arena_backend"]
        results = [row for size in SIZES for row in bench.run_size(size)]
        report = {
            "tool": "umbp bench pool",
            "created_unix": time.time(),
            "machine": _machine(),
            "config": cfg,
            "results": results,
            "exists": bench.run_exists(),
            "checksum": bench.run_checksum(),
        }
        bench.pool.close()
    finally:
        progress.close()
    targets = [r["verdict"] for r in results if r["target_ratio"] is not None] + [report["exists"]["verdict"]]
    report["all_targets_met"] = all(v == "PASS" for v in targets)
    out = write_json(args.out, report)
    print(f"wrote {out}")
    cands = report["checksum"]["candidates_cache_hot_gbps"]
    print(
        "checksum candidates, GB/s on cache-hot 256 KiB: "
        + ", ".join(f"{k} {v:.1f}" for k, v in cands.items())
    )
    _print_table(report)
    return 0
