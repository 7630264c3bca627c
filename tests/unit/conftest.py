"""Fixtures shared by the unit tests."""

import os
import threading

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
