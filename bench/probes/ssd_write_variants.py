"""Probe (not a test; see bench/results/archive/26-the 2026-12-02 work-probes.txt): the 64 KiB write ratio of
`umbp bench ssd`'s method for variants of the tier's settings, alternated in one process so the disk's
drift hits every variant alike. Each round runs every variant (order reversed every other round); each
variant writes the working set twice, once after the baseline file and once before it (the bench's
balanced order), and prints both ratios. At the end: median and mean per variant, and the median MB/s of
each side by write order.

A variant is comma-separated key=value (defaults in brackets): seg [28] segment MiB, max_io [8] MiB per
write, depth [3] writes in flight, copy [2] copy threads, sealsync [1] (0: seals skip their fdatasync),
pause [0] tenths of a second to sleep after the deletes and sync, warm [0] MiB written untimed (to a file
kept until the end) before the timed writes.

    PYTHONPATH=$PWD/src python3 bench/probes/ssd_write_variants.py --rounds 6 --variants seg=28 seg=256
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import umbp.pool.ssd.io_hooks as ssd_io
import umbp.pool.ssd.tier as ssd
from umbp.tools.bench_ssd import _Bench, _config, put_all
from umbp.tools.benchutil import timed

MiB = 1 << 20
DEFAULTS = {"seg": 28, "max_io": 8, "depth": 3, "copy": 2, "sealsync": 1, "pause": 0, "warm": 0}
_real_seal_io = ssd.SsdTier._seal_io


def _seal_io_nosync(shard, seg, image, offset) -> bool:
    try:
        return ssd_io.pwritev(seg.fd, [image], offset) == image.size
    except OSError:
        return False


def parse(text: str) -> dict[str, int]:
    v = dict(DEFAULTS)
    for kv in text.split(","):
        k, x = kv.split("=")
        if k not in v:
            raise SystemExit(f"unknown variant key {k!r}; known: {', '.join(DEFAULTS)}")
        v[k] = int(x)
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["seg=28"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", type=int, default=64 * 1024, help="object bytes")
    ap.add_argument("--ws", type=int, default=192, help="working set MiB")
    ap.add_argument("--dir", default="/tmp/umbp-variants")
    a = ap.parse_args()
    ns = argparse.Namespace(quick=False, dir=a.dir, working_set_mib=a.ws, reps=2, batch_mib=16, io_mib=8,
                            direct_io="auto", copy_threads=2, refused="wait")
    cfg = _config(ns)
    bench = _Bench(cfg)
    ws, size = cfg["working_set_bytes"], a.size
    n = ws // size
    keys = [f"b/{i}" for i in range(n)]
    objs = [bench.src[i * size : (i + 1) * size] for i in range(n)]
    ratios: dict[str, list[float]] = {v: [] for v in a.variants}
    rates: dict[str, list[tuple[int, float, float]]] = {v: [] for v in a.variants}
    for r in range(a.rounds):
        for name in a.variants if r % 2 == 0 else a.variants[::-1]:
            v = parse(name)
            ssd_io.WRITE_DEPTH = v["depth"]
            ssd.SsdTier._seal_io = staticmethod(_real_seal_io if v["sealsync"] else _seal_io_nosync)
            d = Path(a.dir) / "tier"
            shutil.rmtree(d, ignore_errors=True)
            tier = ssd.SsdTier(str(d), capacity_bytes=max(2 * ws + 64 * MiB, 4 * v["seg"] * MiB),
                               queue_bytes=64 * MiB, direct_io=bench.direct, copy_threads=v["copy"],
                               segment_bytes=v["seg"] * MiB, max_io_bytes=v["max_io"] * MiB)

            def tier_write(tier: ssd.SsdTier = tier) -> None:
                put_all(tier, keys, objs, 256)
                assert tier.flush(timeout=600)

            for rep in range(2):
                tier.clear()
                bench.seq_path.unlink(missing_ok=True)
                os.sync()
                time.sleep(v["pause"] / 10)
                if v["warm"]:
                    fd = os.open(Path(a.dir) / f"warm-{r}-{rep}", os.O_WRONLY | os.O_CREAT
                                 | (os.O_DIRECT if bench.direct else 0), 0o644)
                    for off in range(0, v["warm"] * MiB, 8 * MiB):
                        os.pwritev(fd, [bench.src[off : off + 8 * MiB]], off)
                    os.fdatasync(fd)
                    os.close(fd)
                steps = [("disk", bench.seq_write), ("tier", tier_write)]
                t = {side: timed(fn) for side, fn in (steps if rep % 2 == 0 else steps[::-1])}
                ratios[name].append(t["disk"] / t["tier"])
                rates[name].append((rep, ws / t["disk"] / 1e6, ws / t["tier"] / 1e6))
            tier.close()
            print(f"round {r} {name}: ratios {ratios[name][-2]:.3f} {ratios[name][-1]:.3f}", flush=True)
    bench.close()
    for f in Path(a.dir).glob("warm-*"):
        f.unlink()
    for name in a.variants:
        xs = ratios[name]
        print(f"{name:28s}: median {statistics.median(xs):.3f} mean {statistics.mean(xs):.3f}  "
              + " ".join(f"{x:.2f}" for x in xs))
    for name in a.variants:
        for rep in (0, 1):
            xs = [(dk, tr) for rr, dk, tr in rates[name] if rr == rep]
            print(f"{name:28s} {'disk first' if rep == 0 else 'tier first'}: disk MB/s "
                  f"{statistics.median(x[0] for x in xs):.0f} tier MB/s {statistics.median(x[1] for x in xs):.0f}")


if __name__ == "__main__":
    main()
