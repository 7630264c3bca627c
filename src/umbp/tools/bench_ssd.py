"""`umbp bench ssd`: SSD-tier write and read throughput as a ratio to the disk's own sequential bandwidth.

Method (why it is honest): in the same run and directory, the baseline writes the working set to a freshly
created temp file with large O_DIRECT writes (--io-mib each, then fdatasync) and reads it back the same way;
the tier
stores the same bytes as objects (put, then flush(): written and synced) and reads them back with
get_into in batches. Both sides use O_DIRECT where the filesystem allows, so the page cache inflates
neither; where it does not, both fall back to buffered I/O and the page cache of the files is dropped
(posix_fadvise) before every read pass. Writes: baseline and tier alternate which goes first each
repetition, and the default count is even: on the H200 host's virtual disk whichever side wrote first
after the deletes ran ~15% slower, so with an odd count the majority order would bias the figure (3
repetitions, the old default, put the baseline first twice: the tier's favour). Reads: the two sides take
turns slice by slice (32 MiB), so a disk whose own rate drifts within a pass drifts for both alike. The
figure is the median of the per-repetition ratios. A put refused because staging is full (the disk is
behind) waits for room and is retried (--refused poll retries every 0.2 ms instead; each refused call
costs a pass over its keys, CPU the writer needs). Both sides write fresh files, and each repetition
first deletes both sides' old files and syncs, outside the timed steps: on a filesystem mounted with
`discard`, deleting a file inside a timed write (or truncating one) put the TRIM in that side's window and
made it up to ~30% slower, which flattered whichever side it was not. The first repetition checks every
byte read back.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from umbp.pool import native
from umbp.tools.argtypes import whole
from umbp.tools.benchutil import check_memory, human, spread, timed, write_json

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
RATIO_TARGET = 0.8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="small, fast run (smoke test; not representative)"
    )
    parser.add_argument(
        "--out", default="umbp-out/bench_ssd.json", help="JSON output path (default: %(default)s)"
    )
    parser.add_argument(
        "--dir",
        default="umbp-out/bench-ssd-data",
        help="scratch directory on the disk to measure; removed afterwards (default: %(default)s)",
    )
    parser.add_argument(
        "--working-set-mib", type=whole(1), default=None, help="bytes per pass, in MiB (default 192, quick 8)"
    )
    parser.add_argument(
        "--reps",
        type=whole(1),
        default=None,
        help="repetitions per size (default 4, quick 1); an even count balances who writes first",
    )
    parser.add_argument(
        "--batch-mib",
        type=whole(1),
        default=16,
        help="bytes per put/get_into call, in MiB: 64 KiB objects go 256 to a call, 4 MiB ones 4 "
        "(default 16)",
    )
    parser.add_argument("--io-mib", type=whole(1), default=8, help="baseline I/O size in MiB (default 8)")
    parser.add_argument(
        "--direct-io",
        default="auto",
        choices=("auto", "true", "false"),
        help="O_DIRECT for both sides (default auto: where the filesystem allows)",
    )
    parser.add_argument(
        "--copy-threads",
        type=whole(1),
        default=2,
        help="the tier's copy_threads: threads a put's copies are split across (default 2)",
    )
    parser.add_argument(
        "--refused",
        default="wait",
        choices=("wait", "poll"),
        help="a put refused for lack of staging (the writer behind): wait for room "
        "(SsdTier.wait_for_room, default) or retry every 0.2 ms (a polling client)",
    )


def put_all(tier: Any, keys: list[str], objs: list[Any], batch: int, refused: str = "wait") -> None:
    """Put every object, `batch` per call; a put refused because staging is full (the writer behind) is
    retried once there is room (`refused="wait"`: SsdTier.wait_for_room) or every 0.2 ms ("poll").
    The bench's write loop, shared with the probes in bench/probes/."""
    for b in range(0, len(keys), batch):
        pending = list(range(b, min(b + batch, len(keys))))
        while pending:
            ok = tier.put([keys[i] for i in pending], [objs[i] for i in pending])
            pending = [i for i, stored in zip(pending, ok, strict=True) if not stored]
            if pending and refused == "poll":
                time.sleep(0.0002)  # staging full: the writer is behind; try again soon
            elif pending:
                tier.wait_for_room([objs[i].size for i in pending])


def _drop_cache(paths: list[Path]) -> None:
    """Evict the files' clean pages (buffered fallback only; no privileges needed)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _Bench:
    def __init__(self, cfg: dict[str, Any]) -> None:
        import numpy as np

        from umbp.pool.buffers import aligned_buffer

        self.np, self.cfg = np, cfg
        ws = cfg["working_set_bytes"]
        self.src = aligned_buffer(ws)
        self.src.view(np.uint64)[:] = np.arange(ws // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        self.dst = aligned_buffer(ws)
        self.dst.fill(1)  # prefault: no side pays page faults in the timed passes
        self.root = Path(cfg["dir"])
        self.seq_path = self.root / "baseline.tmp"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.direct = self._probe_direct(cfg["direct_io"])
        except OSError as exc:
            raise SystemExit(
                f"umbp bench ssd: cannot use --dir {cfg['dir']}: {exc.strerror or exc}; pass --dir "
                "with a writable folder on the disk to measure"
            ) from None
        cfg["direct_io_used"] = self.direct

    def _probe_direct(self, mode: str) -> bool:
        os.close(os.open(self.seq_path, os.O_WRONLY | os.O_CREAT, 0o644))  # OSError: --dir is not writable
        if mode == "false":
            return False
        try:
            fd = os.open(self.seq_path, os.O_WRONLY | os.O_DIRECT)
        except OSError:
            if mode == "true":
                raise SystemExit(f"umbp bench ssd: O_DIRECT is not supported in {self.root}") from None
            return False
        os.close(fd)
        return True

    # ---- the disk's own sequential bandwidth ----

    def seq_write(self) -> None:
        io, ws = self.cfg["io_bytes"], self.cfg["working_set_bytes"]
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        fd = os.open(self.seq_path, flags, 0o644)
        try:
            for off in range(0, ws, io):
                os.pwritev(fd, [self.src[off : off + io]], off)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def seq_read(self, lo: int = 0, hi: int | None = None) -> None:
        io, ws = self.cfg["io_bytes"], self.cfg["working_set_bytes"]
        fd = os.open(self.seq_path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        try:
            for off in range(lo, ws if hi is None else hi, io):
                os.preadv(fd, [self.dst[off : off + io]], off)
        finally:
            os.close(fd)

    # ---- the tier ----

    def run_size(self, size: int) -> list[dict[str, Any]]:
        from umbp.pool.ssd.tier import SsdTier

        np, cfg = self.np, self.cfg
        ws = cfg["working_set_bytes"]
        n = ws // size
        batch = max(1, cfg["batch_bytes"] // size)
        keys = [f"bench/{size}/{i}" for i in range(n)]
        objs = [self.src[i * size : (i + 1) * size] for i in range(n)]
        outs = [self.dst[i * size : (i + 1) * size] for i in range(n)]
        batches = [slice(i, i + batch) for i in range(0, n, batch)]
        tier_dir = self.root / "tier"
        shutil.rmtree(tier_dir, ignore_errors=True)
        tier = SsdTier(
            str(tier_dir),
            capacity_bytes=2 * ws + 64 * MiB,
            queue_bytes=min(ws, 64 * MiB),
            direct_io=self.direct,
            copy_threads=cfg["copy_threads"],
        )

        def tier_write() -> None:
            put_all(tier, keys, objs, batch, cfg["refused"])
            if not tier.flush(timeout=600):
                raise RuntimeError("umbp bench ssd: flush timed out")

        def tier_read(lo: int = 0, hi: int = ws) -> None:
            for b in batches:
                if lo <= b.start * size < hi and not all(tier.get_into(keys[b], outs[b])):
                    raise RuntimeError("umbp bench ssd: a get missed; every key was just stored")

        def read_interleaved(rep: int) -> tuple[float, float]:
            """Tier and disk read the working set slice by slice, back to back (who goes first alternates),
            so a disk whose own rate drifts within a pass (this bench's VM disk moved 1.1-2.3 GB/s) drifts
            for both sides alike. Returns (disk seconds, tier seconds), each summed over the slices."""
            if not self.direct:
                _drop_cache([self.seq_path, *tier_dir.glob("seg-*")])
            step = max(cfg["batch_bytes"] // size * size, size) * max(
                1, cfg["read_slice_bytes"] // cfg["batch_bytes"]
            )
            step = max(step // cfg["io_bytes"], 1) * cfg["io_bytes"]
            disk = tier_s = 0.0
            for k, lo in enumerate(range(0, ws, step)):
                hi = min(ws, lo + step)
                pair = [
                    ("disk", lambda lo=lo, hi=hi: self.seq_read(lo, hi)),
                    ("tier", lambda lo=lo, hi=hi: tier_read(lo, hi)),
                ]
                for side, fn in pair if (k + rep) % 2 == 0 else pair[::-1]:
                    t = timed(fn)
                    if side == "disk":
                        disk += t
                    else:
                        tier_s += t
            return disk, tier_s

        times: dict[str, list[float]] = {"write": [], "seq_write": [], "read": [], "seq_read": []}
        try:
            for rep in range(cfg["reps"]):
                # Both sides write fresh files; the old ones are deleted first and synced, so the discards
                # (TRIM) of deleted files land on neither side's timed window.
                tier.clear()
                self.seq_path.unlink(missing_ok=True)
                os.sync()
                steps = [("seq_write", self.seq_write), ("write", tier_write)]
                for name, fn in steps if rep % 2 == 0 else steps[::-1]:  # alternate who goes first
                    times[name].append(timed(fn))
                disk, tier_s = read_interleaved(rep)
                times["seq_read"].append(disk)
                times["read"].append(tier_s)
                if rep == 0:  # untimed honesty check: the tier's reads alone reproduce every byte
                    self.dst.fill(0)
                    tier_read()
                    if not np.array_equal(self.dst[: n * size], self.src[: n * size]):
                        raise RuntimeError("umbp bench ssd: bytes read back differ from bytes written")
            stats = tier.stats()
        finally:
            tier.close()
            shutil.rmtree(tier_dir, ignore_errors=True)
        return [self._row(op, size, n, times[op], times["seq_" + op], stats) for op in ("write", "read")]

    def _row(
        self, op: str, size: int, n: int, t_tier: list[float], t_seq: list[float], stats: dict[str, Any]
    ) -> dict[str, Any]:
        moved = n * size
        ratios = [s / t for t, s in zip(t_tier, t_seq, strict=True)]
        ratio = statistics.median(ratios)
        return {
            "op": op,
            "size_bytes": size,
            "objects": n,
            "tier_mbps": moved / statistics.median(t_tier) / 1e6,
            "disk_mbps": moved / statistics.median(t_seq) / 1e6,
            "ratio": ratio,
            "ratios": ratios,
            "target_ratio": RATIO_TARGET,
            "first": (
                ["disk" if rep % 2 == 0 else "tier" for rep in range(len(ratios))]
                if op == "write"
                else ["alternating per slice"] * len(ratios)
            ),
            "verdict": "PASS" if ratio >= RATIO_TARGET else "MISS",
            "dropped_backpressure_retried": stats["dropped_backpressure"] if op == "write" else 0,
        }

    def run_checksum(self) -> dict[str, float]:
        """Why psum64 and not crc32: GB/s of each over the same 4 MiB (cache-hot)."""
        import zlib

        from umbp.pool.checksum import checksum

        hot = self.src[: 4 * MiB]
        out = {}
        for name, fn in (("psum64", lambda: checksum(hot)), ("zlib.crc32", lambda: zlib.crc32(hot))):
            t = statistics.median(timed(lambda fn=fn: [fn() for _ in range(8)]) for _ in range(3))
            out[name] = 8 * hot.size / t / 1e9
        return out

    def close(self) -> None:
        self.seq_path.unlink(missing_ok=True)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    ws = args.working_set_mib or (8 if args.quick else 192)
    io = args.io_mib * MiB
    ws_bytes = max(ws * MiB // io, 1) * io  # whole baseline I/Os
    return {
        "quick": bool(args.quick),
        "dir": args.dir,
        "working_set_bytes": ws_bytes,
        "reps": args.reps or (1 if args.quick else 4),
        "batch_bytes": args.batch_mib * MiB,
        "io_bytes": io,
        "direct_io": args.direct_io,
        "sizes": list(SIZES),
        "read_slice_bytes": 32 * MiB,
        "copy_threads": args.copy_threads,
        "refused": args.refused,
    }


def _print_table(report: dict[str, Any]) -> None:
    cfg = report["config"]
    io = "O_DIRECT" if cfg["direct_io_used"] else "buffered (page cache dropped before reads)"
    print(
        f"umbp bench ssd: {cfg['dir']}, working set {human(cfg['working_set_bytes'])}, {cfg['reps']} reps, "
        f"{human(cfg['batch_bytes'])} per call, {cfg['copy_threads']} copy threads, refused puts "
        f"{cfg['refused']}, {io}; disk = sequential {human(cfg['io_bytes'])} I/Os of one "
        f"file; umbp's paths: {report['machine'].get('umbp_paths', '?')}; medians; ratio = tier / disk "
        "(reps: lowest-highest repetition)" + ("  [--quick: not representative]" if cfg["quick"] else "")
    )
    print(
        f"{'op':<7}{'size':>9}{'tier MB/s':>11}{'disk MB/s':>11}{'ratio':>8}{'reps':>12}{'target':>9}  result"
    )
    for r in report["results"]:
        print(
            f"{r['op']:<7}{human(r['size_bytes']):>9}{r['tier_mbps']:>11.0f}{r['disk_mbps']:>11.0f}"
            f"{r['ratio']:>8.2f}{spread(r['ratios']):>12}{'>=' + format(r['target_ratio'], '.2f'):>9}  {r['verdict']}"
        )
    c = report["checksum_gbps"]
    load = report["machine"]["loadavg_start_end"]
    print(
        "checksum GB/s (4 MiB, cache-hot): "
        + ", ".join(f"{k} {v:.1f}" for k, v in c.items())
        + f"; load average {load[0]:.1f} -> {load[1]:.1f} on {report['machine']['cpus']} CPUs"
        + f"; total {report['seconds']:.0f} s"
    )


def run(args: argparse.Namespace) -> int:
    import numpy as np

    cfg = _config(args)
    check_memory("umbp bench ssd", 2 * cfg["working_set_bytes"], "--working-set-mib (source and destination)")
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    bench = _Bench(cfg)
    try:
        results = [row for size in SIZES for row in bench.run_size(size)]
        checksums = bench.run_checksum()
    finally:
        bench.close()
        if Path(cfg["dir"]).is_dir() and not any(Path(cfg["dir"]).iterdir()):
            Path(cfg["dir"]).rmdir()
    report = {
        "tool": "umbp bench ssd",
        "created_unix": time.time(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "loadavg_start_end": [load0, os.getloadavg()[0]],
            "umbp_paths": native.describe(),
        },
        "config": cfg,
        "results": results,
        "checksum_gbps": checksums,
        "all_targets_met": all(r["verdict"] == "PASS" for r in results),
        "seconds": time.perf_counter() - t0,
    }
    out = write_json(args.out, report)
    print(f"wrote {out}")
    _print_table(report)
    return 0
