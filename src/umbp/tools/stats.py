"""`umbp stats`: what umbp's tiers hold, and what a running vLLM's connector has done.

    umbp stats --ssd /mnt/nvme/umbp                      # every <namespace>/<rank> directory (read-only)
    umbp stats --remote redis://127.0.0.1:6379/0         # the shared tier (SCAN: the server keeps serving)
    umbp stats --remote redis://... --auth-key-env VAR   # ... a tenant's namespace, sealed with its key
    umbp stats --metrics http://127.0.0.1:8000/metrics   # a running vLLM's vllm:umbp_* counters
    umbp stats ... --json                                # the same, machine-readable

Why per namespace and rank: a restore needs every rank's shard of an object, so "complete" objects (held
by every rank found for that namespace) are what a restarted or second engine can actually restore.
Nothing here takes the SSD tier's lock or writes anything, so it is safe beside a running vLLM.

Tenant keys: values sealed with a tenant key (`auth_key_env`/`auth_key_file`) live in a namespace derived
from the key, so only the key finds them. Given the same auth options as the connector, the report reads
that namespace; any other namespace it finds under the key prefix is only counted and named, with the
option that would read it.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import math
import os
import re
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from umbp.identity import parse_key
from umbp.redact import redact_url, scrub, secrets_of, url_secrets
from umbp.tools.argtypes import whole

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_NAMESPACE = re.compile(r"^[0-9a-f]{32}$")
_METRIC = re.compile(r"^(vllm:umbp_[A-Za-z0-9_]+?)(?:_total)?(?:\{([^}]*)\})?\s+(\S+)\s*$")
# the labels umbp adds to vLLM's own (engine, model): kept apart in the report, the others summed over
_UMBP_LABEL = re.compile(r'\b(group|tier)="([^"]*)"')
METRICS_MAX_BYTES = 64 << 20  # a /metrics reply past this is not vLLM's
METRICS_DEADLINE_S = 30.0  # the whole /metrics request: connect, headers and body
METRICS_TIMEOUT_S = 10.0  # each connect or read of it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ssd",
        action="append",
        default=[],
        metavar="DIR",
        help="an ssd_dirs entry of the connector's config (repeatable)",
    )
    parser.add_argument(
        "--remote",
        default=None,
        metavar="URL|JSON",
        help="the shared tier: a redis:// URL or the connector's remote options as JSON",
    )
    parser.add_argument(
        "--auth-key-env",
        default=None,
        metavar="VAR",
        help="remote: the tenant's auth_key_env (an environment variable holding its secret), to read the "
        "namespace its values are sealed in",
    )
    parser.add_argument(
        "--auth-key-file", default=None, metavar="PATH", help="remote: the tenant's auth_key_file instead"
    )
    parser.add_argument("--metrics", default=None, metavar="URL", help="a vLLM /metrics endpoint")
    parser.add_argument("--no-sizes", action="store_true", help="remote: count objects only (no STRLEN)")
    parser.add_argument(
        "--max-keys", type=whole(1), default=1_000_000, help="remote: stop after this many objects"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


@dataclass
class Shard:
    """One rank's share of one namespace in one tier."""

    namespace: str
    rank: str
    objects: int = 0
    payload_bytes: int = 0
    groups: Counter = field(default_factory=Counter)
    boundaries: set = field(default_factory=set, repr=False)  # (group, prefix hash): for "complete"
    segments: int = 0
    disk_bytes: int = 0
    markers_without_value: int = 0

    def add(self, group: int, prefix_hash: bytes, nbytes: int) -> None:
        self.objects += 1
        self.payload_bytes += nbytes
        self.groups[group] += 1
        self.boundaries.add((group, prefix_hash))


@dataclass
class TierReport:
    tier: str  # "ssd <dir>" | "remote <url>"
    shards: list[Shard] = field(default_factory=list)
    foreign: int = 0  # records/keys that are not umbp object keys
    notes: list[str] = field(default_factory=list)
    values: str = ""  # remote: "unauthenticated", "authenticated (<mac>)" or "encrypted"
    # remote: objects in namespaces this report could not read ("" = unauthenticated values, "t<hex>" = a
    # tenant key's namespace), by namespace
    other_namespaces: dict[str, int] = field(default_factory=dict)

    def complete(self) -> dict[str, tuple[int, int]]:
        """namespace -> (objects every rank found holds, ranks found)."""
        out = {}
        for ns in sorted({s.namespace for s in self.shards}):
            shards = [s for s in self.shards if s.namespace == ns]
            both = set.intersection(*(s.boundaries for s in shards))
            out[ns] = (len(both), len(shards))
        return out


# ---- collection ---------------------------------------------------------------------------------------


def ssd_report(base: str) -> TierReport:
    from umbp.pool.ssd.format import scan

    if not os.path.isdir(base):
        raise StatsError(
            f"umbp stats: {base} is not a directory; pass an ssd_dirs entry of the connector's "
            "kv_connector_extra_config"
        )
    report = TierReport(f"ssd {base}")
    try:
        namespaces = sorted(os.listdir(base))
    except OSError as exc:
        raise StatsError(
            f"umbp stats: cannot read {base}: {exc.strerror or exc}; run as the user the connector runs as"
        ) from None
    for ns in namespaces:
        if not _NAMESPACE.match(ns) or not os.path.isdir(os.path.join(base, ns)):
            continue
        try:
            ranks = sorted(os.listdir(os.path.join(base, ns)))
        except OSError as exc:
            report.notes.append(f"{ns}: unreadable ({exc.strerror or exc}): its ranks are not counted")
            continue
        for rank in ranks:
            path = os.path.join(base, ns, rank)
            if not os.path.isdir(path):
                continue
            try:
                found = scan(path)
            except OSError as exc:
                report.notes.append(
                    f"{ns}/{rank}: unreadable ({exc.strerror or exc}): not counted, nor in 'complete'"
                )
                continue
            shard = Shard(
                ns,
                rank.replace("-", ":"),
                segments=len(found.segments),
                disk_bytes=sum(s.size for s in found.segments),
            )
            for key, rec in found.records.items():
                parsed = _parse(key)
                if parsed is None:
                    report.foreign += 1
                else:
                    shard.add(parsed.group, parsed.prefix_hash, rec.length)
            report.notes += [f"{ns}/{rank}: discarded {d}" for d in found.discarded]
            report.shards.append(shard)
    if not report.shards and not report.notes:
        report.notes.append("no <namespace>/<rank> directories here (nothing stored yet?)")
    return report


def remote_options(spec: str, auth_key_env: str | None = None, auth_key_file: str | None = None) -> dict:
    """The shared tier's options from `--remote` (a URL or the connector's `remote` options as JSON) and
    the `--auth-key-*` flags, which add to (and must not contradict) the JSON's."""
    try:
        options = json.loads(spec) if spec.lstrip().startswith("{") else {"url": spec}
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise StatsError("umbp stats: --remote takes a redis:// URL or a JSON object of remote options")
    for name, value in (("auth_key_env", auth_key_env), ("auth_key_file", auth_key_file)):
        if value is None:
            continue
        if options.get(name) not in (None, value):
            raise StatsError(f"umbp stats: --{name.replace('_', '-')} contradicts the {name} in --remote")
        options[name] = value
    return options


def remote_report(
    spec: str,
    sizes: bool,
    max_keys: int,
    auth_key_env: str | None = None,
    auth_key_file: str | None = None,
) -> TierReport:
    import redis

    from umbp.pool.errors import UmbpValueError
    from umbp.pool.remote.admin import ScanError
    from umbp.pool.remote.tier import RedisTier

    options = remote_options(spec, auth_key_env, auth_key_file)
    secrets = secrets_of(options)
    try:
        tier = RedisTier.from_options(options)
    except UmbpValueError as exc:  # the config's own messages hide every secret; scrubbed again all the same
        raise StatsError(f"umbp stats: {scrub(str(exc), secrets).removeprefix('umbp: ')}") from None
    name = ",".join(redact_url(u) for u in tier.config.urls)
    report = TierReport(f"remote {name}", values=tier.stats()["config"]["values"])
    shards: dict[tuple[str, str], Shard] = {}
    seen = 0
    header = tier.value_header_bytes
    try:
        namespaces = tier.scan_namespaces(limit=2 * max_keys)  # a value and a marker per object
        for key, length in tier.scan_objects(sizes=sizes, limit=max_keys):
            seen += 1
            parsed = _parse(key)
            if parsed is None:
                report.foreign += 1
                continue
            shard = shards.setdefault(
                (parsed.namespace, parsed.rank.tag()), Shard(parsed.namespace, parsed.rank.tag())
            )
            if length == 0:
                shard.markers_without_value += 1
                continue
            shard.add(parsed.group, parsed.prefix_hash, max(0, (length or header) - header))
    except ScanError as exc:
        raise StatsError(f"umbp stats: cannot read {name}: {exc}; is this a Redis server?") from None
    except (redis.RedisError, OSError) as exc:
        raise StatsError(
            f"umbp stats: cannot read {name}: {scrub(str(exc), secrets)}; is the server up and the URL right?"
        ) from None
    except (TypeError, ValueError, AttributeError, IndexError, RecursionError) as exc:  # redis-py's parsing
        raise StatsError(
            f"umbp stats: cannot read {name}: a reply Redis does not send ({type(exc).__name__}); is this "
            "a Redis server?"
        ) from None
    finally:
        tier.close()
    report.shards = [shards[k] for k in sorted(shards)]
    own = tier.config.redis_prefix.removeprefix(tier.config.key_prefix).rstrip(":")
    report.other_namespaces = {ns: n for ns, n in sorted(namespaces.items()) if ns != own}
    if seen >= max_keys:
        report.notes.append(f"stopped after {max_keys} objects (--max-keys)")
    if not sizes:
        report.notes.append("sizes not read (--no-sizes)")
    return report


def _metrics_request(url: str) -> urllib.request.Request:
    """A GET of `url`. Its user info, if any (`https://user:password@host/metrics`, behind a proxy
    that asks for it), is sent as HTTP basic authentication, and only to that host (not after a redirect);
    urllib alone would take it for part of the host name."""
    from umbp.pool.remote.config import split_credentials

    user, password, bare = split_credentials(url.strip())
    if urlsplit(bare).scheme.lower() not in ("http", "https"):
        raise ValueError("only http:// and https:// URLs are read")
    request = urllib.request.Request(bare)
    if user is not None or password is not None:
        token = base64.b64encode(f"{user or ''}:{password or ''}".encode()).decode()
        request.add_unredirected_header("Authorization", f"Basic {token}")
    return request


class _HttpRedirectsOnly(urllib.request.HTTPRedirectHandler):
    """Redirects are followed to http:// and https:// URLs only (urllib would also follow one to ftp://)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201 - urllib's
        if urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.HTTPError(
                req.full_url, code, "a redirect to a URL that is not http(s)", headers, fp
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(request: urllib.request.Request) -> bytes:
    """The reply's body: at most METRICS_MAX_BYTES, all of it within METRICS_DEADLINE_S (a server that
    sends a byte now and then cannot hold the command: each read's timeout alone would not stop it). The
    request runs in a daemon thread, left behind at the deadline (it ends at its next read's timeout)."""
    box: dict[str, Any] = {}
    stop = threading.Event()

    def get() -> None:
        try:
            opener = urllib.request.build_opener(_HttpRedirectsOnly)
            with opener.open(request, timeout=METRICS_TIMEOUT_S) as resp:
                body = bytearray()
                while not stop.is_set():
                    chunk = resp.read1(1 << 16)
                    if not chunk:
                        box["body"] = bytes(body)
                        return
                    body += chunk
                    if len(body) > METRICS_MAX_BYTES:
                        raise ValueError(f"the reply is larger than {METRICS_MAX_BYTES >> 20} MiB")
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which reports it
            box["error"] = exc

    thread = threading.Thread(target=get, name="umbp-stats-metrics", daemon=True)
    thread.start()
    thread.join(METRICS_DEADLINE_S)
    if thread.is_alive():
        stop.set()
        raise TimeoutError(f"no complete reply within {METRICS_DEADLINE_S:g} s")
    if "error" in box:
        raise box["error"]
    return box["body"]


def metrics_report(url: str, notes: list[str] | None = None) -> dict[str, float]:
    """Every vllm:umbp_* counter, summed over label sets (engines, models). Messages show the URL with its
    user info and credential-like query parameters (`?token=`) masked. A sample whose value is not a
    finite number is skipped, and said so in `notes`."""
    try:
        text = _fetch(_metrics_request(url)).decode("utf-8", errors="replace")
    except (OSError, ValueError, http.client.HTTPException) as exc:  # InvalidURL is an HTTPException
        why = scrub(redact_url(str(exc)), url_secrets(url))
        raise StatsError(
            f"umbp stats: cannot read {redact_url(url)}: {why}; is vLLM running with --kv-transfer-config "
            "UMBPConnector, and is this its /metrics URL?"
        ) from None
    out: dict[str, float] = {}
    skipped: list[str] = []
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and not m.group(1).endswith("_created"):
            name = m.group(1).removeprefix("vllm:umbp_")
            labels = ",".join(f"{k}={v}" for k, v in _UMBP_LABEL.findall(m.group(2) or ""))
            if labels:
                name = f"{name}{{{labels}}}"
            try:
                value = float(m.group(3))
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                skipped.append(name)
                continue
            out[name] = out.get(name, 0.0) + value
    if skipped and notes is not None:
        shown = ", ".join(sorted(set(skipped))[:5])
        notes.append(f"{len(skipped)} sample(s) whose value is not a finite number skipped ({shown[:200]})")
    return dict(sorted(out.items()))


def padding_factor(metrics: dict[str, float]) -> float | None:
    """DRAM bytes per stored data byte: the arena pages the stored objects take over the state and KV
    bytes they hold. umbp stores pages without vLLM's padding, so above 1 it is only each object's rounding
    to 4 KiB; None before anything is stored (or from a umbp that does not export stored_data_bytes)."""
    dram, data = metrics.get("stored_bytes", 0.0), metrics.get("stored_data_bytes", 0.0)
    return dram / data if dram > 0 and data > 0 else None


class StatsError(Exception):
    pass


def _parse(key: str):
    try:
        return parse_key(key)
    except ValueError:
        return None


# ---- output -------------------------------------------------------------------------------------------


def _size(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n} B"


def print_tier(report: TierReport) -> None:
    print(report.tier)
    for s in report.shards:
        groups = ", ".join(f"g{g} {n}" for g, n in sorted(s.groups.items()))
        line = (
            f"  {s.namespace}  {s.rank:<22} {s.objects:>9,} objects ({groups or '-'})  "
            f"payload {_size(s.payload_bytes)}"
        )
        if report.tier.startswith("ssd"):
            line += f"  {s.segments} segments, {_size(s.disk_bytes)} on disk"
        if s.markers_without_value:
            line += f"  {s.markers_without_value} markers without a value"
        print(line)
    if report.values:
        print(f"  values: {report.values}")
    for ns, n in report.other_namespaces.items():
        print(f"  {_other_namespace(ns, n)}")
    for ns, (n, ranks) in report.complete().items():
        print(f"  {ns}  complete on all {ranks} rank(s) found: {n:,} objects")
    if report.foreign:
        print(f"  {report.foreign} entries that are not umbp object keys (ignored)")
    for note in report.notes:
        print(f"  note: {note}")


def _other_namespace(ns: str, n: int) -> str:
    if not ns:
        return (
            f"{n:,} objects with unauthenticated values (no tenant key) are not listed here: run without "
            "--auth-key-env/--auth-key-file (and without auth options in --remote) to read them"
        )
    return (
        f"{n:,} objects in tenant namespace {ns} are sealed with a tenant key this command was not given: "
        "they cannot be read or verified here; pass that tenant's --auth-key-env VAR or --auth-key-file PATH"
    )


def _jsonable(report: TierReport) -> dict[str, Any]:
    shards = []
    for s in report.shards:
        d = asdict(s)
        d.pop("boundaries")
        d["groups"] = {f"g{g}": n for g, n in sorted(s.groups.items())}
        shards.append(d)
    complete = {ns: {"objects": n, "ranks": r} for ns, (n, r) in report.complete().items()}
    return {
        "tier": report.tier,
        "shards": shards,
        "complete": complete,
        "foreign": report.foreign,
        "notes": report.notes,
        **({"values": report.values, "other_namespaces": report.other_namespaces} if report.values else {}),
    }


def _gather(args: argparse.Namespace):
    """Each source on its own: one that cannot be read is reported as unreachable, the others still are."""
    tiers: list[TierReport] = []
    metrics: dict[str, float] | None = None
    unreachable: dict[str, str] = {}
    notes: list[str] = []  # about the metrics
    sources = [(f"ssd {d}", lambda d=d: ssd_report(d)) for d in args.ssd]
    if args.remote:
        sources.append(
            (
                "remote",
                lambda: remote_report(
                    args.remote, not args.no_sizes, args.max_keys, args.auth_key_env, args.auth_key_file
                ),
            )
        )
    for name, read in sources:
        try:
            tiers.append(read())
        except StatsError as exc:
            unreachable[name] = str(exc)
    if args.metrics:
        try:
            metrics = metrics_report(args.metrics, notes)
        except StatsError as exc:
            unreachable["metrics"] = str(exc)
    return tiers, metrics, notes, unreachable


def run(args: argparse.Namespace) -> int:
    """Exit code: 0 every source was read; 1 some were unreachable (the rest is printed); 2 none was
    readable, or nothing was asked for."""
    if (args.auth_key_env or args.auth_key_file) and not args.remote:
        print("umbp stats: --auth-key-env/--auth-key-file are for --remote", file=sys.stderr)
        return 2
    if not (args.ssd or args.remote or args.metrics):
        print(
            "umbp stats: nothing to inspect; give --ssd DIR, --remote URL and/or --metrics URL",
            file=sys.stderr,
        )
        return 2
    tiers, metrics, metrics_notes, unreachable = _gather(args)
    asked = len(args.ssd) + bool(args.remote) + bool(args.metrics)
    code = 0 if not unreachable else (2 if len(unreachable) == asked else 1)
    for name, why in unreachable.items():
        print(f"unreachable: {name}: {why}", file=sys.stderr)
    if code == 2:
        return code
    if args.json:
        out: dict[str, Any] = {"tiers": [_jsonable(t) for t in tiers], "unreachable": unreachable}
        if metrics is not None:
            out["metrics"] = metrics
            out["dram_bytes_per_data_byte"] = padding_factor(metrics)
            if metrics_notes:
                out["metrics_notes"] = metrics_notes
        print(json.dumps(out, indent=1))
        return code
    for t in tiers:
        print_tier(t)
    if metrics is not None:
        print(f"vLLM {redact_url(args.metrics)}: umbp counters since start (summed over engines)")
        for name, value in metrics.items():
            print(f"  {name:<28} {value:>16,.0f}")
        if not metrics:
            print("  none: is the connector UMBPConnector?")
        factor = padding_factor(metrics)
        if factor is not None:
            print(f"  DRAM bytes per stored data byte {factor:>8.3f}  (stored_bytes / stored_data_bytes)")
        for note in metrics_notes:
            print(f"  note: {note}")
    for name in unreachable:
        print(f"{name}: UNREACHABLE (see the error above)")
    return code
