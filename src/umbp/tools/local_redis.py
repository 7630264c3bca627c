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
    def __init__(self, tool: str, instead: str | None = None, prefix: str = "umbp-redis-") -> None:
        """`tool` names the caller in errors; `instead` is the option that points it at a running server."""
        exe = shutil.which("redis-server")
        if exe is None:
            hint = f", or pass {instead}" if instead else ""
            raise RuntimeError(f"{tool}: redis-server not found; apt-get install redis-server{hint}")
        self.tool, self.exe = tool, exe
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        """Start the server on this instance's port and directory (again, after `kill`), empty."""
        argv = [
            self.exe,
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

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crashed server: nothing is saved (no persistence)."""
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
