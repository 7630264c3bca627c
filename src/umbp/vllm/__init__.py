"""Layer 3: the vLLM 0.32 engine adapter. `kv_connector_module_path: "umbp.vllm"` loads UMBPConnector.

The connector is imported lazily so `umbp.vllm.config` (option parsing) works without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UMBPConnector"]


def __getattr__(name: str) -> Any:
    if name == "UMBPConnector":
        from umbp.vllm.connector import UMBPConnector

        return UMBPConnector
    raise AttributeError(f"module 'umbp.vllm' has no attribute {name!r}")
