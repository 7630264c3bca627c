"""umbp.pool.native: which paths a process runs, and the switches that choose them (each case in a fresh
interpreter, since the choice is made at import)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "from umbp.pool import native; print(native.describe())"
HIDE = "import sys; sys.modules['umbp.pool._native'] = None; "  # as if the extension had not been built


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("UMBP_")}
    return subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=60
    )


def test_umbp_native_0_selects_the_python_paths_even_when_required():
    out = _run(PROBE, UMBP_NATIVE="0", UMBP_REQUIRE_NATIVE="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "pure Python: extension disabled by UMBP_NATIVE=0"


def test_a_missing_extension_falls_back_and_says_how_to_build_it():
    out = _run(HIDE + PROBE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("pure Python: extension not built") and "C compiler" in out.stdout


def test_a_missing_extension_is_an_error_when_required():
    out = _run(HIDE + PROBE, UMBP_REQUIRE_NATIVE="1")
    assert out.returncode != 0
    assert "UMBP_REQUIRE_NATIVE=1 but the C extension umbp.pool._native is not built" in out.stderr


def test_the_built_extension_is_used_by_default():
    from umbp.pool import native

    if native.lib is None and os.environ.get("UMBP_REQUIRE_NATIVE") != "1":
        pytest.skip(f"the C extension is {native.why_not}")
    out = _run(PROBE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "native (C extension)"
