"""The optional C extension (umbp.pool._native), or None.

Why optional: umbp must install and run wherever numpy does; the extension only makes the pool's
per-object loops cheaper (psum64 copies, GET-reply parsing), and every caller keeps its pure-Python path,
which gives identical results. Set UMBP_NATIVE=0 to use the Python paths (e.g. to compare them).
UMBP_REQUIRE_NATIVE=1 (set by CI) makes a missing extension an import error instead of a quiet fallback.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

lib: ModuleType | None = None
why_not: str = ""

_disabled = os.environ.get("UMBP_NATIVE", "1") == "0"
if _disabled:
    why_not = "disabled by UMBP_NATIVE=0"
else:
    try:
        lib = importlib.import_module("umbp.pool._native")
    except ImportError as exc:  # a missing module is the usual case; anything else is worth showing
        why_not = "not built" if isinstance(exc, ModuleNotFoundError) else f"not loadable ({exc})"
        why_not += "; reinstall umbp with a C compiler present (e.g. apt-get install gcc; pip install -e .)"

if lib is None and not _disabled and os.environ.get("UMBP_REQUIRE_NATIVE") == "1":
    raise ImportError(f"umbp: UMBP_REQUIRE_NATIVE=1 but the C extension umbp.pool._native is {why_not}")


def describe() -> str:
    """One line for the bench reports and the connector's start-up log: which paths this process runs."""
    return "native (C extension)" if lib is not None else f"pure Python: extension {why_not}"
