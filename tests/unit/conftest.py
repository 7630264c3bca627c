"""Fixtures shared by the unit tests."""

import os
import sys
import threading
from pathlib import Path

import pytest

import umbp.pool.ssd.io_hooks as ssd_io


@pytest.fixture
def blocked_writer(monkeypatch):
    """The SSD writer stalls on its first write until the event is set (a wedged disk); set at teardown."""
    gate = threading.Event()
    real = ssd_io.pwritev
    monkeypatch.setattr(ssd_io, "pwritev", lambda *a: (gate.wait(), real(*a))[1])
    yield gate
    gate.set()


@pytest.fixture(params=["native", "python"])
def impl(request, monkeypatch):
    """Runs a test on the C extension's paths and again on the pure-Python ones, which must give the same
    results. Without the extension the native run is skipped, unless UMBP_REQUIRE_NATIVE=1 (CI)."""
    from umbp.pool import native

    if request.param == "python":
        monkeypatch.setattr(native, "lib", None)
    elif native.lib is None:
        if os.environ.get("UMBP_REQUIRE_NATIVE") == "1":
            pytest.fail(f"umbp.pool._native is {native.why_not}")
        pytest.skip(f"the C extension is {native.why_not}")
    return request.param


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Redis/Valkey server on 127.0.0.1 for the shared-tier tests of one module (tests/redis_servers.py
    finds it; each module that asks gets its own)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from redis_servers import start_server

    s = start_server(tmp_path_factory.mktemp("redis"))
    yield s
    s.stop()
