"""The optional C extensions: the pool's (umbp.pool._native, here as `lib`, or None) and how any other
is loaded (`optional_extension`: the transfer engine's round layout, umbp.transfer._rounds).

Why optional: umbp must install and run wherever numpy does; the extensions only make per-object loops
cheaper (psum64 copies, GET-reply parsing, a transfer's staging layout), and every caller keeps its
pure-Python path, which gives identical results. Set UMBP_NATIVE=0 to use the Python paths (e.g. to compare them).
UMBP_REQUIRE_NATIVE=1 (set by CI) makes a missing extension an import error instead of a quiet fallback.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def optional_extension(module: str) -> tuple[ModuleType | None, str]:
    """(the C extension `module`, or None; why not, when None), by the rules above: UMBP_NATIVE=0 turns
    every extension off, UMBP_REQUIRE_NATIVE=1 makes a missing one an ImportError."""
    if os.environ.get("UMBP_NATIVE", "1") == "0":
        return None, "disabled by UMBP_NATIVE=0"
    try:
        return importlib.import_module(module), ""
    except ImportError as exc:  # a missing module is the usual case; anything else is worth showing
        why = "not built" if isinstance(exc, ModuleNotFoundError) else f"not loadable ({exc})"
        why += "; reinstall umbp with a C compiler present (e.g. apt-get install gcc; pip install -e .)"
    if os.environ.get("UMBP_REQUIRE_NATIVE") == "1":
        raise ImportError(f"umbp: UMBP_REQUIRE_NATIVE=1 but the C extension {module} is {why}")
    return None, why


lib, why_not = optional_extension("umbp.pool._native")


def describe() -> str:
    """One line for the bench reports and the connector's start-up log: which paths this process runs."""
    return "native (C extension)" if lib is not None else f"pure Python: extension {why_not}"
