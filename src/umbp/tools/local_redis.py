"""A throwaway redis-server for the tools (`umbp bench remote`, `umbp demo --restart redis`): a free
loopback port (never beyond 127.0.0.1), its own temp dir, no persistence; `stop()` removes it all."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time


class LocalRedis:
    def __init__(self, tool: str, instead: str) -> None:
        """`tool` names the caller in errors; `instead` is the option that points it at a running server."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(
                f"{tool}: redis-server not found; apt-get install redis-server, or pass {instead}"
            )
        self.tool = tool
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="umbp-redis-")
        argv = [
            exe,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--logfile",
            os.path.join(self.dir, "redis.log"),
            "--protected-mode",
            "yes",
        ]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._wait()

    def _wait(self, timeout: float = 10.0) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.tool}: redis-server exited; see {self.dir}/redis.log")
            try:
                if redis.Redis(port=self.port, socket_connect_timeout=0.2).ping():
                    return
            except redis.RedisError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.tool}: redis-server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
