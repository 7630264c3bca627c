"""`umbp stats` on real tiers: SSD rank directories written by SsdTier, a real redis-server on 127.0.0.1,
and a /metrics endpoint served on 127.0.0.1 in the Prometheus text format vLLM exposes."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import require_redis, start_server  # noqa: E402
from umbp.cli import main  # noqa: E402
from umbp.identity import RankCoord, object_key  # noqa: E402
from umbp.pool.ssd.tier import SsdTier  # noqa: E402
from umbp.vllm.tiers import rank_dir  # noqa: E402

NS = "0123456789abcdef0123456789abcdef"
R0, R1 = RankCoord(tp=0), RankCoord(tp=1)


def _objects(rank: RankCoord, spec: dict[int, int], size: int = 10_000) -> tuple[list[str], list[np.ndarray]]:
    keys, bufs = [], []
    for group, n in spec.items():
        for i in range(n):
            keys.append(object_key(NS, rank, group, bytes([i + 1]) * 32))
            bufs.append(np.full(size, i, np.uint8))
    return keys, bufs


def _stats(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["stats", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_ssd_rank_directories(tmp_path, capsys):
    base = str(tmp_path / "ssd")
    for rank, spec in ((R0, {0: 3, 1: 2}), (R1, {0: 2})):  # rank 1 lacks one g0 object and every g1
        tier = SsdTier(rank_dir(base, NS, rank), 64 << 20)
        assert all(tier.put(*_objects(rank, spec)))
        assert tier.flush(30)
        tier.close()
    rc, out, _ = _stats(capsys, "--ssd", base, "--json")
    assert rc == 0
    (report,) = json.loads(out)["tiers"]
    shards = {s["rank"]: s for s in report["shards"]}
    assert shards["tp0:pcp0:dcp0:pp0"]["objects"] == 5 and shards["tp0:pcp0:dcp0:pp0"]["groups"] == {
        "g0": 3,
        "g1": 2,
    }
    assert shards["tp1:pcp0:dcp0:pp0"]["payload_bytes"] == 2 * 10_000
    assert all(s["segments"] >= 1 and s["disk_bytes"] > s["payload_bytes"] for s in shards.values())
    assert report["complete"] == {NS: {"objects": 2, "ranks": 2}}
    rc, out, _ = _stats(capsys, "--ssd", base)
    assert rc == 0 and "complete on all 2 rank(s) found: 2 objects" in out and "g0 3, g1 2" in out


def test_missing_ssd_directory_is_one_clear_error(tmp_path, capsys):
    rc, out, err = _stats(capsys, "--ssd", str(tmp_path / "nope"))
    assert rc == 2 and "is not a directory" in err and out == ""
    rc, _, err = _stats(capsys)
    assert rc == 2 and "nothing to inspect" in err


def test_remote_tier(tmp_path, capsys):
    require_redis()
    from umbp.pool.remote.tier import RedisTier

    server = start_server(tmp_path / "redis")
    try:
        tier = RedisTier.from_options({"url": server.url})
        for rank, spec in ((R0, {0: 4, 1: 1}), (R1, {0: 4, 1: 1})):
            assert all(tier.put(*_objects(rank, spec, size=5000)))
        tier.close()
        raw = server.client()
        raw.set("umbp:m:" + object_key(NS, R0, 2, b"\x09" * 32), b"1")  # a marker whose value is gone
        raw.set("umbp:m:not-an-object-key", b"1")
        raw.set("other-app:key", b"x")  # outside umbp's prefix: never looked at
        rc, out, _ = _stats(capsys, "--remote", server.url, "--json")
        assert rc == 0
        (report,) = json.loads(out)["tiers"]
        shards = {s["rank"]: s for s in report["shards"]}
        assert (
            shards["tp0:pcp0:dcp0:pp0"]["objects"] == 5
            and shards["tp0:pcp0:dcp0:pp0"]["payload_bytes"] == 25_000
        )
        assert shards["tp0:pcp0:dcp0:pp0"]["markers_without_value"] == 1
        assert report["complete"] == {NS: {"objects": 5, "ranks": 2}} and report["foreign"] == 1
        rc, out, _ = _stats(capsys, "--remote", server.url, "--no-sizes", "--max-keys", "3")
        assert rc == 0 and "stopped after 3 objects" in out
    finally:
        server.stop()
    rc, _, err = _stats(capsys, "--remote", server.url)  # the server is gone now
    assert rc == 2 and "cannot read" in err


def test_remote_tenant_namespaces(tmp_path, capsys, monkeypatch):
    """Values sealed with a tenant key live in a namespace only the key finds: given the key, stats reads
    it (payload bytes exclude the sealed header); without it, stats names the namespace and says it
    cannot read it, instead of leaving it out."""
    require_redis()
    from umbp.pool.remote.tier import RedisTier

    monkeypatch.setenv("UMBP_TEST_TENANT_KEY", "tenant-secret-0123456789abcdef")
    server = start_server(tmp_path / "redis")
    try:
        sealed = RedisTier.from_options({"url": server.url, "auth_key_env": "UMBP_TEST_TENANT_KEY"})
        assert all(sealed.put(*_objects(R0, {0: 3, 1: 1}, size=5000)))
        namespace = sealed.config.redis_prefix.removeprefix("umbp:").rstrip(":")
        sealed.close()
        plain = RedisTier.from_options({"url": server.url})
        assert all(plain.put(*_objects(R1, {0: 2}, size=5000)))
        plain.close()

        rc, out, _ = _stats(capsys, "--remote", server.url, "--json")
        (report,) = json.loads(out)["tiers"]
        assert rc == 0 and [s["rank"] for s in report["shards"]] == ["tp1:pcp0:dcp0:pp0"]
        assert report["values"].startswith("unauthenticated") and report["other_namespaces"] == {namespace: 4}
        rc, out, _ = _stats(capsys, "--remote", server.url)
        assert rc == 0 and f"4 objects in tenant namespace {namespace} are sealed" in out
        assert "--auth-key-env" in out

        for argv in (
            ("--remote", server.url, "--auth-key-env", "UMBP_TEST_TENANT_KEY"),
            ("--remote", json.dumps({"url": server.url, "auth_key_env": "UMBP_TEST_TENANT_KEY"})),
        ):
            rc, out, _ = _stats(capsys, *argv, "--json")
            (report,) = json.loads(out)["tiers"]
            (shard,) = report["shards"]
            assert rc == 0 and shard["rank"] == "tp0:pcp0:dcp0:pp0" and shard["objects"] == 4
            assert shard["payload_bytes"] == 4 * 5000 and report["values"].startswith("authenticated")
            assert report["other_namespaces"] == {"": 2}
        rc, out, _ = _stats(capsys, "--remote", server.url, "--auth-key-env", "UMBP_TEST_TENANT_KEY")
        assert "tenant-secret" not in out and "2 objects with unauthenticated values" in out

        monkeypatch.setenv("UMBP_TEST_SHORT_KEY", "short")
        rc, _, err = _stats(capsys, "--remote", server.url, "--auth-key-env", "UMBP_TEST_SHORT_KEY")
        assert rc == 2 and "at least 16 bytes" in err and "short" not in err.replace("at least", "")
        rc, _, err = _stats(capsys, "--auth-key-env", "UMBP_TEST_TENANT_KEY")
        assert rc == 2 and "are for --remote" in err
    finally:
        server.stop()


EXPOSITION = """# HELP vllm:umbp_restored_tokens_total umbp connector counter restored_tokens
# TYPE vllm:umbp_restored_tokens_total counter
vllm:umbp_restored_tokens_total{engine="0",model_name="m"} 832.0
vllm:umbp_restored_tokens_total{engine="1",model_name="m"} 768.0
vllm:umbp_restored_tokens_created{engine="0",model_name="m"} 1.7e+09
vllm:umbp_load_failures_total{engine="0",model_name="m"} 1.0
vllm:umbp_tier_loaded_objects_total{engine="0",model_name="m",tier="ssd"} 9.0
vllm:umbp_tier_loaded_objects_total{engine="1",model_name="m",tier="ssd"} 1.0
vllm:umbp_group_stored_objects_total{engine="0",group="1",model_name="m"} 4.0
vllm:umbp_stored_bytes_total{engine="0",model_name="m"} 712704.0
vllm:umbp_stored_data_bytes_total{engine="0",model_name="m"} 708864.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


@contextlib.contextmanager
def metrics_server(authorization: str | None = None) -> Iterator[int]:
    """A /metrics endpoint on 127.0.0.1 serving EXPOSITION (401 without `authorization`, when one is
    asked for); yields its port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            ok = authorization is None or self.headers.get("Authorization") == authorization
            body = EXPOSITION.encode() if ok else b"unauthorized"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_metrics_endpoint(capsys):
    with metrics_server() as port:
        url = f"http://127.0.0.1:{port}/metrics"
        rc, out, _ = _stats(capsys, "--metrics", url, "--json")
        report = json.loads(out)
        assert rc == 0 and report["metrics"] == {
            "group_stored_objects{group=1}": 4.0,
            "load_failures": 1.0,
            "restored_tokens": 1600.0,
            "stored_bytes": 712704.0,
            "stored_data_bytes": 708864.0,
            "tier_loaded_objects{tier=ssd}": 10.0,
        }
        assert abs(report["dram_bytes_per_data_byte"] - 712704 / 708864) < 1e-9
        rc, out, _ = _stats(capsys, "--metrics", url)
        assert rc == 0 and "restored_tokens" in out and "1,600" in out
        assert "DRAM bytes per stored data byte    1.005" in out
    rc, _, err = _stats(capsys, "--metrics", url)
    assert rc == 2 and "cannot read" in err


def test_one_unreachable_source_still_reports_the_others(tmp_path, capsys):
    base = str(tmp_path / "ssd")
    tier = SsdTier(rank_dir(base, NS, R0), 64 << 20)
    assert all(tier.put(*_objects(R0, {0: 2})))
    assert tier.flush(30)
    tier.close()
    dead = "http://127.0.0.1:9/metrics"  # the discard port: nothing listens there
    rc, out, err = _stats(capsys, "--ssd", base, "--metrics", dead, "--json")
    assert rc == 1, "partial results exit with 1"
    report = json.loads(out)
    assert report["tiers"][0]["shards"][0]["objects"] == 2
    assert "metrics" in report["unreachable"] and "cannot read" in err
    rc, out, _ = _stats(capsys, "--ssd", base, "--metrics", dead)
    assert rc == 1 and "2 objects" in out and "metrics: UNREACHABLE" in out
    rc, _, _ = _stats(capsys, "--ssd", str(tmp_path / "nope"), "--metrics", dead)
    assert rc == 2, "nothing readable exits with 2"


SECRET = "Hunter2SecretXYZ123456"


def test_metrics_url_credentials_never_shown(capsys):
    """A /metrics URL's user info and credential-like query parameters are masked in every message,
    whatever urllib makes of the URL (a password in the user info once read as a bad port, uncaught)."""
    for url in (
        f"http://user:{SECRET}@127.0.0.1:9/metrics",
        f"http://user:{SECRET}@127.0.0.1/metrics",  # no port: urllib took the password for one
        f"http://127.0.0.1:9/metrics?token={SECRET}",
        f"http://127.0.0.1:9/metrics?x=1&api_key={SECRET}",
        f"127.0.0.1:9/metrics?password={SECRET}",  # no scheme
        f"user:{SECRET}@127.0.0.1:9/metrics",
    ):
        for json_flag in ((), ("--json",)):
            rc, out, err = _stats(capsys, "--metrics", url, *json_flag)
            assert rc == 2 and "cannot read" in err and "***" in err, err
            assert SECRET not in out + err and "Hunter2" not in out + err


def test_metrics_basic_auth_and_token_stay_hidden(capsys):
    import base64

    expected = "Basic " + base64.b64encode(f"admin:{SECRET}".encode()).decode()
    with metrics_server(authorization=expected) as port:
        rc, out, err = _stats(
            capsys, "--metrics", f"http://admin:{SECRET}@127.0.0.1:{port}/metrics?token={SECRET}"
        )
        assert rc == 0 and "restored_tokens" in out, err
        assert f"vLLM http://admin:***@127.0.0.1:{port}/metrics?token=***:" in out
        assert SECRET not in out + err
        rc, out, err = _stats(
            capsys, "--metrics", f"http://admin:wrong@127.0.0.1:{port}/metrics?token={SECRET}"
        )
        assert rc == 2 and "401" in err and "wrong" not in err and SECRET not in out + err


def test_remote_config_errors_never_show_the_password(capsys):
    pytest.importorskip("redis")
    for spec in (
        f"redis:/:{SECRET}@127.0.0.1:6379/0",
        f"redis//:{SECRET}@127.0.0.1:6379/0",
        f"redis:{SECRET}@127.0.0.1",
        json.dumps({"url": "redis://127.0.0.1:6379/0", "password_env": SECRET}),
        json.dumps({"url": "redis://127.0.0.1:6379/0", "auth_key_file": SECRET}),
        json.dumps({"url": {"token": SECRET}}),
    ):
        rc, out, err = _stats(capsys, "--remote", spec)
        assert rc == 2 and "remote tier option" in err, err
        assert SECRET not in out + err and "Hunter2" not in out + err
