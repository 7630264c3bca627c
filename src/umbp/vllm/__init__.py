"""Layer 3: the vLLM 0.32 engine adapter. `kv_connector_module_path: "umbp.vllm"` loads UMBPConnector."""

from umbp.vllm.connector import UMBPConnector

__all__ = ["UMBPConnector"]
