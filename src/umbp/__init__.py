"""umbp: a KV-cache and hybrid-model-state offload store for LLM serving, with a vLLM connector."""

__version__ = "0.1.0"
