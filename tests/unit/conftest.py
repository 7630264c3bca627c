"""Fixtures shared by the unit tests."""

import threading

import pytest

import umbp.pool.ssd as ssd_mod


@pytest.fixture
def blocked_writer(monkeypatch):
    """The SSD writer stalls on its first write until the event is set (a wedged disk); set at teardown."""
    gate = threading.Event()
    real = ssd_mod._pwritev
    monkeypatch.setattr(ssd_mod, "_pwritev", lambda *a: (gate.wait(), real(*a))[1])
    yield gate
    gate.set()
