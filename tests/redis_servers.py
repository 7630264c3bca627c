"""Real redis-server instances for tests: single servers and a 3-master Redis Cluster, each on free ports
of 127.0.0.1 in its own temporary directory, never persisted, always stopped by the test that started it.

Tests skip when redis-server (or redis-py) is missing, unless UMBP_REQUIRE_REDIS=1: then they fail, so a
CI job meant to run them cannot pass by skipping.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

HOST = "127.0.0.1"  # tests only ever bind and reach loopback


def blob(n: int, seed: int) -> np.ndarray:
    """n random bytes, the same for the same seed: a test object's payload."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def require_redis() -> None:
    """Skip (or fail under UMBP_REQUIRE_REDIS=1) when redis-server or redis-py is not installed."""
    missing = []
    if shutil.which("redis-server") is None:
        missing.append("redis-server (apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py (pip install redis)")
    _skip_or_fail(missing)


def _skip_or_fail(missing: list[str]) -> None:
    if missing:
        msg = "needs " + " and ".join(missing)
        if os.environ.get("UMBP_REQUIRE_REDIS") == "1":
            pytest.fail(msg + " (UMBP_REQUIRE_REDIS=1)")
        pytest.skip(msg, allow_module_level=True)  # also called at module level, before any test


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; a small race with other processes is accepted)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls_files(workdir: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost (openssl CLI)."""
    _skip_or_fail([] if shutil.which("openssl") else ["openssl (apt-get install openssl)"])
    d = workdir / "tls"
    d.mkdir(parents=True, exist_ok=True)

    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ossl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=umbp-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    )
    ossl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ossl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    )
    return TlsFiles(d / "ca.crt", d / "server.crt", d / "server.key")


@dataclass
class RedisServer:
    """One redis-server process; `stop()` kills it, `start()` brings it back on the same port."""

    workdir: Path
    port: int = field(default_factory=free_port)
    extra: tuple[str, ...] = ()
    password: str | None = None
    tls: TlsFiles | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        auth = f":{self.password}@" if self.password else ""
        return f"{scheme}://{auth}{HOST}:{self.port}/0"

    def argv(self) -> list[str]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            "redis-server",
            "--bind",
            HOST,
            "--protected-mode",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.workdir / "redis.log"),
        ]
        if self.tls:
            argv += [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(self.tls.cert),
                "--tls-key-file",
                str(self.tls.key),
                "--tls-ca-cert-file",
                str(self.tls.ca),
                "--tls-auth-clients",
                "no",
            ]
        else:
            argv += ["--port", str(self.port)]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv + list(self.extra)

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                log = (
                    (self.workdir / "redis.log").read_text() if (self.workdir / "redis.log").exists() else ""
                )
                raise RuntimeError(f"redis-server on port {self.port} exited: {err}{log[-2000:]}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def client(self, **kw):
        import redis

        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=str(self.tls.ca))
        return redis.Redis(host=HOST, port=self.port, password=self.password, socket_timeout=5, **kw)

    def ping(self) -> bool:
        try:
            c = self.client(socket_connect_timeout=0.5)
            try:
                return bool(c.ping())
            finally:
                c.close()
        except Exception:
            return False

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def pause(self, seconds: float) -> None:
        """Make the server unresponsive to clients (CLIENT PAUSE): a slow server, from the outside."""
        c = self.client()
        try:
            c.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
        finally:
            c.close()


def start_server(
    workdir: Path, *extra: str, password: str | None = None, tls: TlsFiles | None = None
) -> RedisServer:
    return RedisServer(workdir, extra=extra, password=password, tls=tls).start()


@dataclass
class ClusterServers:
    """A Redis Cluster of `masters` masters, no replicas; `cluster-require-full-coverage no` so the
    surviving masters keep serving their slots when one is killed."""

    servers: list[RedisServer]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def owner_of(self, slot: int) -> RedisServer:
        for s in self.servers:
            c = s.client()
            try:
                me = c.execute_command("CLUSTER", "MYID")
                me = me.decode() if isinstance(me, bytes) else me
                owner = c.execute_command("CLUSTER", "SLOTS")
            finally:
                c.close()
            for start, end, primary, *_ in owner:
                node_id = primary[2].decode() if isinstance(primary[2], bytes) else primary[2]
                if start <= slot <= end and node_id == me:
                    return s
        raise LookupError(f"no master owns slot {slot}")


def start_cluster(workdir: Path, masters: int = 3, timeout: float = 20.0) -> ClusterServers:
    servers: list[RedisServer] = []
    try:
        for i in range(masters):
            bus = free_port()
            servers.append(
                start_server(
                    workdir / f"node{i}",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-port",
                    str(bus),
                    "--cluster-node-timeout",
                    "1000",
                    "--cluster-require-full-coverage",
                    "no",
                    "--cluster-allow-reads-when-down",
                    "no",
                )
            )
        _assign_slots(servers)
        _wait_cluster_ok(servers, timeout)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return ClusterServers(servers)


def _assign_slots(servers: list[RedisServer]) -> None:
    n = len(servers)
    for i, s in enumerate(servers):
        c = s.client()
        try:
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * 16384 // n, (i + 1) * 16384 // n - 1)
        finally:
            c.close()
    first = servers[0].client()
    try:
        for s in servers[1:]:
            bus = s.extra[s.extra.index("--cluster-port") + 1]
            first.execute_command("CLUSTER", "MEET", HOST, s.port, bus)
    finally:
        first.close()


def _wait_cluster_ok(servers: list[RedisServer], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_cluster_ok(s, len(servers)) for s in servers):
            return
        time.sleep(0.05)
    raise RuntimeError("the test cluster did not reach cluster_state:ok")


def _cluster_ok(s: RedisServer, n: int) -> bool:
    c = s.client()
    try:
        info = c.execute_command("CLUSTER", "INFO")
        info = info.decode() if isinstance(info, bytes) else info
        fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
        return fields.get("cluster_state") == "ok" and fields.get("cluster_known_nodes") == str(n)
    finally:
        c.close()
