"""`umbp bench remote`: the shared tier (RedisTier) on loopback — lookup latency for 8,192 keys and put/get
throughput for 64 KiB ... 4 MiB objects — beside redis-benchmark's own SET/GET figures in the same run.

Method (why it is honest):
* The bench starts its own redis-server on 127.0.0.1 (no persistence) unless --url names one.
* Lookups: 8,192 real umbp object keys (a 128K-token prompt at prefix_match_unit=16), every other one
  stored, so hits and misses both cost; median and p90 of repeated `exists` calls, each a full round trip.
* Throughput: the working set is cut into objects of one size; `put` then `get_into` move all of it in
  batches, through the tier's real paths (header, psum64 checksum on both sides, key checks). The first
  repetition checks that every byte read back equals what was written.
* Reference: in each repetition, before or after the tier's passes (alternating, as the machine's load
  drifts), `redis-benchmark -c 1 -d <size>` with no pipelining and with a pipeline as deep as the tier's
  batch, the better of the two: SET over -r <objects> random keys, and GET of <objects> keys stored
  beforehand (with -r alone most GETs would find no key, yet be counted at full size). That is the tier's
  work: distinct objects in server memory. Its default one-key figures (one value rewritten or re-read,
  cache-hot on the server) are reported beside, for information. The figure is the median of the
  per-repetition ratios, over an even number of repetitions by default: over 48 rows of the H200
  host's runs the tier's ratio was ~6% higher in repetitions where the reference ran after it, and the
  old default of 5 had 3 such repetitions.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from umbp.pool import native
from umbp.tools.argtypes import whole
from umbp.tools.benchutil import Progress, check_memory, human, spread, write_json
from umbp.tools.local_redis import LocalRedis

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
LOOKUP_KEYS = 8192  # 131,072 tokens at prefix_match_unit=16
LOOKUP_TARGET_MS = 5.0
RATIO_TARGET = 0.7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="small, fast run (smoke test; not representative)"
    )
    parser.add_argument(
        "--url",
        default=None,
        help="use this redis:// server instead of starting one (its umbp keys are cleared)",
    )
    parser.add_argument(
        "--out", default="umbp-out/bench_remote.json", help="JSON output path (default: %(default)s)"
    )
    parser.add_argument(
        "--reps",
        type=whole(1),
        default=None,
        help="repetitions per size (default 6, quick 2); an even count balances who goes first",
    )
    parser.add_argument(
        "--working-set-mib",
        type=whole(1),
        default=None,
        help="bytes moved per pass, in MiB (default 256, quick 16)",
    )
    parser.add_argument(
        "--batch", type=whole(1), default=16, help="objects per put/get_into call (default 16)"
    )
    parser.add_argument(
        "--lookup-keys", type=whole(1), default=LOOKUP_KEYS, help="keys per exists() call (default 8192)"
    )
    parser.add_argument(
        "--no-redis-benchmark", action="store_true", help="skip the redis-benchmark reference"
    )
    parser.add_argument(
        "--auth",
        default="none",
        choices=("none", "hmac-sha256", "aes-gmac", "aes-gcm"),
        help="value protection to measure: none (default), a MAC keyed by a random tenant secret "
        "(hmac-sha256 or aes-gmac), or aes-gcm encryption (docs/remote.md)",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help="object sizes in KiB, comma-separated, a subset of 64,256,1024,4096 (default all)",
    )


# ---- measurement helpers ------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _lookup_keys(n: int) -> list[str]:
    """Real object keys: one model namespace, rank 0, group 0, 32-byte prefix hashes."""
    from umbp.identity import GroupLayout, ModelIdentity, RankCoord, object_key

    ident = ModelIdentity(
        model="bench/model", dtype="bfloat16", groups=(GroupLayout("full_attention", 16, ("layers.0.attn",)),)
    )
    ns = ident.namespace()
    return [object_key(ns, RankCoord(), 0, os.urandom(32)) for _ in range(n)]


def _redis_benchmark(
    host: str, port: int, tests: str, size: int, requests: int, pipeline: int, keyspace: int | None
) -> dict[str, float]:
    """Bytes/s of redis-benchmark's SET and/or GET: one client, values of `size`, over `keyspace` random
    keys (key:000000000000 ...) or, with None, its default single key."""
    argv = [
        "redis-benchmark",
        "-h",
        host,
        "-p",
        str(port),
        "-c",
        "1",
        "-P",
        str(pipeline),
        "-d",
        str(size),
        "-n",
        str(requests),
        "-t",
        tests,
        "--csv",
    ]
    if keyspace:
        argv += ["-r", str(keyspace)]
    for attempt in (1, 2):  # it very rarely exits 1 on a loaded machine; one retry, then a clear error
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if done.returncode == 0:
            break
        if attempt == 2:
            raise RuntimeError(
                f"umbp bench remote: {' '.join(argv)} failed: {(done.stderr or done.stdout)[-300:]}"
            )
    out: dict[str, float] = {}
    for line in done.stdout.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) > 1 and cells[0] in ("SET", "GET"):
            out[cells[0]] = float(cells[1]) * size
    if set(out) != {t.upper() for t in tests.split(",")}:
        raise RuntimeError(f"umbp bench remote: cannot read redis-benchmark's output: {done.stdout[-300:]!r}")
    return out


def _fill_keyspace(client: Any, keyspace: int, size: int) -> None:
    """Store every key redis-benchmark -r draws, so each of its GETs returns a full value (a GET of a
    missing key returns nothing yet would be counted as `size` bytes)."""
    value = bytes(size)
    pipe = client.pipeline(transaction=False)
    for i in range(keyspace):
        pipe.set(f"key:{i:012d}", value)
        if i % 16 == 15:
            pipe.execute()
    pipe.execute()


# ---- the benchmark ------------------------------------------------------------------------------------


class _Bench:
    def __init__(self, cfg: dict[str, Any], tier: Any, progress: Any) -> None:
        import numpy as np

        self.np, self.cfg, self.tier, self.progress = np, cfg, tier, progress
        ws = cfg["working_set_bytes"]
        self.src = np.random.default_rng(0).integers(0, 256, ws, dtype=np.uint8)
        self.dst = np.ones(ws, np.uint8)  # prefaulted

    def run_lookup(self) -> dict[str, Any]:
        tier, n = self.tier, self.cfg["lookup_keys"]
        keys = _lookup_keys(n)
        blob = bytes(64)
        for i in range(0, n, 512):
            chunk = keys[i : i + 512 : 2]
            tier.put(chunk, [blob] * len(chunk))
        first = _timed(lambda: tier.exists(keys))
        times = []
        for _ in range(self.cfg["lookup_reps"]):
            times.append(_timed(lambda: tier.exists(keys)))
        present = sum(tier.exists(keys))
        self.progress.step("lookup")
        tier.clear()
        ms = sorted(t * 1e3 for t in times)
        median = statistics.median(ms)
        return {
            "keys": n,
            "present": present,
            "key_bytes": len(keys[0]),
            "first_ms": first * 1e3,
            "median_ms": median,
            "p90_ms": ms[int(0.9 * (len(ms) - 1))],
            "min_ms": ms[0],
            "max_ms": ms[-1],
            "target_ms": LOOKUP_TARGET_MS,
            "verdict": "PASS" if median <= LOOKUP_TARGET_MS else "MISS",
        }

    def run_size(self, size: int) -> list[dict[str, Any]]:
        cfg, tier = self.cfg, self.tier
        n, batch = cfg["working_set_bytes"] // size, cfg["batch"]
        keys = [f"bench:{size}:{i}" for i in range(n)]
        objs = [self.src[i * size : (i + 1) * size] for i in range(n)]
        outs = [self.dst[i * size : (i + 1) * size] for i in range(n)]
        spans = [slice(i, i + batch) for i in range(0, n, batch)]

        def put() -> None:
            for s in spans:
                if not all(tier.put(keys[s], objs[s])):
                    raise RuntimeError("umbp bench remote: a put was dropped; see the tier's stats")

        def put_async() -> None:
            for s in spans:
                tier.put_async(keys[s], objs[s])
            tier.flush()

        def get() -> None:
            for s in spans:
                if not all(tier.get_into(keys[s], outs[s])):
                    raise RuntimeError("umbp bench remote: a get missed; every key was just stored")

        times: dict[str, list[float]] = {
            k: [] for k in ("put", "get", "put_async", "SET", "GET", "SET_one_key", "GET_one_key")
        }
        for rep in range(cfg["reps"]):
            if rep % 2:  # alternate who goes first: the machine's load drifts during a run
                self._add_reference(times, size, n)
            tier.clear()
            times["put"].append(n * size / _timed(put))
            times["get"].append(n * size / _timed(get))
            if rep == 0:
                self._check_bytes(n * size, get)
            tier.clear()
            times["put_async"].append(n * size / _timed(put_async))
            tier.clear()
            if rep % 2 == 0:
                self._add_reference(times, size, n)
            self.progress.step(f"put/get {human(size)}")
        rows = [
            self._row(op, size, n, times[op], times[ref] if ref else None)
            for op, ref in (("put", "SET"), ("get", "GET"), ("put_async", None))
        ]
        for row, ref in zip(rows, ("SET", "GET"), strict=False):
            one = times[ref + "_one_key"]
            row["ref_one_key_gbps"] = statistics.median(one) / 1e9 if one else None
        return rows

    def _check_bytes(self, nbytes: int, get: Callable[[], None]) -> None:
        self.dst.fill(0)
        get()
        if not self.np.array_equal(self.dst[:nbytes], self.src[:nbytes]):
            raise RuntimeError("umbp bench remote: bytes read back differ from bytes written")

    def _add_reference(self, times: dict[str, list[float]], size: int, n: int) -> None:
        for op, rate in self._reference(size, n).items():
            times[op].append(rate)

    def _reference(self, size: int, n: int) -> dict[str, float]:
        """redis-benchmark on the same server: SET over n distinct keys, GET of n stored keys (the
        reference), and its default one-key SET/GET (shown for information). Best of -P 1 and -P batch."""
        if self.cfg["redis_benchmark"] is None:
            return {}
        import redis

        host, port = self.cfg["redis_benchmark"]
        client = redis.Redis(host=host, port=port)
        best: dict[str, float] = {}
        for pipeline in sorted({1, self.cfg["batch"]}):
            requests = max(n, 2 * pipeline)
            client.flushdb()
            runs = [_redis_benchmark(host, port, "set", size, requests, pipeline, n)]
            _fill_keyspace(client, n, size)
            runs.append(_redis_benchmark(host, port, "get", size, requests, pipeline, n))
            client.flushdb()
            one = _redis_benchmark(host, port, "set,get", size, requests, pipeline, None)
            runs.append({op + "_one_key": rate for op, rate in one.items()})
            for run in runs:
                for op, rate in run.items():
                    best[op] = max(best.get(op, 0.0), rate)
        client.flushdb()
        client.close()
        return best

    @staticmethod
    def _row(op: str, size: int, n: int, rates: list[float], refs: list[float] | None) -> dict[str, Any]:
        row: dict[str, Any] = {
            "op": op,
            "size_bytes": size,
            "objects": n,
            "umbp_gbps": statistics.median(rates) / 1e9,
            "umbp_gbps_reps": [r / 1e9 for r in rates],
        }
        if refs:
            ratios = [u / r for u, r in zip(rates, refs, strict=True)]
            row.update(
                ref_gbps=statistics.median(refs) / 1e9,
                ratio=statistics.median(ratios),
                ratios=ratios,
                target_ratio=RATIO_TARGET,
                verdict="PASS" if statistics.median(ratios) >= RATIO_TARGET else "MISS",
            )
        else:
            row.update(ref_gbps=None, ratio=None, ratios=None, target_ratio=None, verdict="info")
        return row


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "quick": bool(args.quick),
        "working_set_bytes": (args.working_set_mib or (16 if args.quick else 256)) * MiB,
        "reps": args.reps or (2 if args.quick else 6),
        "lookup_reps": 5 if args.quick else 31,
        "batch": max(1, args.batch),
        "lookup_keys": max(1, args.lookup_keys),
        "sizes": _sizes(args.sizes),
        "auth": args.auth,
    }


def _auth_options(auth: str) -> dict[str, Any]:
    """Remote options for --auth: a random tenant secret for this run, handed over in an env var as an
    operator would (never on a command line or in the report)."""
    if auth == "none":
        return {}
    import secrets

    os.environ["UMBP_BENCH_AUTH_KEY"] = secrets.token_hex(32)
    opts: dict[str, Any] = {"auth_key_env": "UMBP_BENCH_AUTH_KEY"}
    if auth == "aes-gcm":
        opts["encrypt"] = True
    else:
        opts["auth_mac"] = auth
    return opts


def _sizes(text: str | None) -> list[int]:
    """--sizes in KiB -> bytes; only the standard sizes, so a partial run's rows match a full run's."""
    if not text:
        return list(SIZES)
    sizes = [int(s) * KiB for s in text.split(",") if s.strip()]
    if not sizes or any(s not in SIZES for s in sizes):
        raise SystemExit(
            f"umbp bench remote: --sizes takes a subset of {','.join(str(s // KiB) for s in SIZES)}"
        )
    return sizes


def _machine() -> dict[str, Any]:
    import numpy as np
    import redis

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "redis_py": redis.__version__,
        "load_avg": os.getloadavg(),
        "umbp_paths": native.describe(),
    }


def _server_info(url: str) -> dict[str, Any]:
    import redis

    info = redis.Redis.from_url(url).info("server")
    return {"version": info.get("redis_version"), "mode": info.get("redis_mode")}


def _print_table(report: dict[str, Any]) -> None:
    cfg, srv = report["config"], report["server"]
    print(
        f"umbp bench remote: redis-server {srv['version']} at {cfg['url']} ({cfg['server']}), working set "
        f"{human(cfg['working_set_bytes'])}, {cfg['reps']} reps, batch {cfg['batch']}, medians; load avg "
        f"{report['machine']['load_avg'][0]:.2f} on {report['machine']['cpus']} CPUs; umbp's paths: "
        f"{report['machine']['umbp_paths']}; values {report['values']}; reps: lowest-highest "
        "repetition's ratio" + ("  [--quick: not representative]" if cfg["quick"] else "")
    )
    lk = report["lookup"]
    print(
        f"lookup {lk['keys']} keys ({lk['present']} present, {lk['key_bytes']}-char keys): median "
        f"{lk['median_ms']:.2f} ms, p90 {lk['p90_ms']:.2f}, min {lk['min_ms']:.2f}, first {lk['first_ms']:.2f}"
        f"   target <= {lk['target_ms']:.0f} ms  {lk['verdict']}"
    )
    print(
        f"{'op':<10}{'size':>8}{'umbp GB/s':>11}{'redis-benchmark':>17}{'ratio':>7}{'reps':>12}{'target':>8}  result"
        f"{'rb one key':>12}"
    )
    for r in report["results"]:
        ref = f"{r['ref_gbps']:.2f}" if r["ref_gbps"] is not None else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        target = f">={r['target_ratio']:.1f}" if r["target_ratio"] is not None else "-"
        one = r.get("ref_one_key_gbps")
        reps = spread(r["ratios"]) if r["ratios"] else "-"
        print(
            f"{r['op']:<10}{human(r['size_bytes']):>8}{r['umbp_gbps']:>11.2f}{ref:>17}{ratio:>7}{reps:>12}{target:>8}"
            f"  {r['verdict']:<6}{f'{one:.2f}' if one is not None else '-':>10}"
        )


def _open(args: argparse.Namespace, cfg: dict[str, Any]) -> tuple[Any, LocalRedis | None]:
    from umbp.pool.errors import UmbpValueError
    from umbp.pool.remote.tier import RedisTier, RemoteConfig

    def config(url: str) -> RemoteConfig:
        options = {"url": url, "key_prefix": "umbp-bench:", "quarantine_s": 0, "timeout_s": 30}
        options.update(write_queue_bytes=2 * cfg["working_set_bytes"], **_auth_options(cfg["auth"]))
        try:
            return RemoteConfig.from_options(options)
        except UmbpValueError as exc:  # the config's messages hide secrets (a password in the URL)
            raise SystemExit(f"umbp bench remote: {str(exc).removeprefix('umbp: ')}") from None

    # a given --url is checked before anything starts: no server of the bench's own then
    server = None if args.url else LocalRedis("umbp bench remote", "--url")
    url = args.url or server.url
    rc = config(url)
    ep = rc.endpoints[0]
    # redis-benchmark writes and flushes its own keys: only on the bench's private server
    has_rb = (
        shutil.which("redis-benchmark") is not None and server is not None and not args.no_redis_benchmark
    )
    cfg.update(
        url=url if not rc.password else "<url with password>",
        server="started by the bench" if server else "given by --url",
        redis_benchmark=(ep.host, ep.port) if has_rb else None,
    )
    tier = RedisTier(rc)
    if not tier.ping():
        tier.close()
        if server is not None:
            server.stop()
        raise SystemExit(
            f"umbp bench remote: cannot reach {cfg['url']}; start that server, fix --url, or leave "
            "--url out to let the bench start its own redis-server"
        )
    return tier, server


def run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    # the source and destination here, and the values in the local server's memory
    check_memory("umbp bench remote", 3 * cfg["working_set_bytes"], "--working-set-mib (3 copies of it)")
    tier, server = _open(args, cfg)
    progress = Progress(1 + len(cfg["sizes"]) * cfg["reps"])
    try:
        report: dict[str, Any] = {
            "tool": "umbp bench remote",
            "created_unix": time.time(),
            "machine": _machine(),
            "server": _server_info(tier.config.urls[0]),
        }
        bench = _Bench(cfg, tier, progress)
        report["lookup"] = bench.run_lookup()
        report["results"] = [row for size in cfg["sizes"] for row in bench.run_size(size)]
        stats = tier.stats()
        report["tier_stats"] = {k: v for k, v in stats.items() if k != "config"}
        report["values"] = stats["config"]["values"]
    finally:
        progress.close()
        tier.clear()
        tier.close()
        if server is not None:
            server.stop()
    rb = cfg.pop("redis_benchmark")
    cfg["redis_benchmark"] = (
        "redis-benchmark -c 1 -P {1,batch}; SET over -r <objects> keys, GET of <objects> "
        "stored keys; best per rep"
        if rb
        else None
    )
    report["config"] = cfg
    verdicts = [report["lookup"]["verdict"]] + [r["verdict"] for r in report["results"] if r["target_ratio"]]
    report["all_targets_met"] = all(v == "PASS" for v in verdicts) and rb is not None
    out = write_json(args.out, report)
    print(f"wrote {out}")
    _print_table(report)
    return 0
