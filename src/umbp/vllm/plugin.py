"""Check umbp's `kv_connector_extra_config` while vLLM builds its configuration, before any weights load.

Why: the connector object is built late. vLLM creates the worker-side connector after the model has
loaded and the KV cache is sized, and the scheduler-side one after that, so a typo in the extra config
used to surface minutes into start-up, once per process, in hundreds of lines of tracebacks.

vLLM 0.32 gives a connector no hook that sees its config while the config is built, except
`requires_piecewise_for_cudagraph(extra_config)`, which vLLM calls only when full CUDA graphs are on
(GPU without `--enforce-eager`); `UMBPConnector` validates there. For every other set-up (CPU,
`--enforce-eager`) this module is a `vllm.general_plugins` entry point (declared in pyproject.toml, so
it is active wherever umbp is pip-installed): vLLM loads general plugins in every process before it
builds the `VllmConfig`, and `register()` wraps `KVConnectorFactory.get_connector_class`, the function
`VllmConfig` calls to resolve the connector class (to ask whether it supports the hybrid KV-cache
manager). When that class is umbp's, the extra config is validated right there: a bad key stops
`vllm serve` or `LLM(...)` in the front-end process, before the engine process starts, with one
`ConfigError` line naming the key. Any other connector is untouched, and if a future vLLM moves the
function, `register()` does nothing (the connector's own checks still run, only later).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("umbp.vllm")
_MARK = "_umbp_validates_extra_config"


def validate_transfer_config(kv_transfer_config: Any, connector_cls: type) -> None:
    """Raise umbp's ConfigError when `connector_cls` is umbp's connector and its extra config is bad."""
    check = getattr(connector_cls, "umbp_validate_extra_config", None)
    if check is not None:
        check(getattr(kv_transfer_config, "kv_connector_extra_config", None))


def register() -> None:
    """The `vllm.general_plugins` entry point: make vLLM's connector lookup validate umbp's options, and
    register umbp's connector by name (umbp.vllm.compose: MultiConnector rebuilds stats by name)."""
    from umbp.vllm.compose import register_with_vllm

    register_with_vllm()
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # a vLLM without this factory: the connector still validates when it is built
        return
    current = KVConnectorFactory.__dict__.get("get_connector_class")
    if not isinstance(current, classmethod) or getattr(current.__func__, _MARK, False):
        return  # not the shape this wraps, or wrapped already (plugins load once per process and again)
    resolve = current.__func__

    def get_connector_class(cls, kv_transfer_config):
        connector_cls = resolve(cls, kv_transfer_config)
        validate_transfer_config(kv_transfer_config, connector_cls)
        return connector_cls

    setattr(get_connector_class, _MARK, True)
    get_connector_class.__doc__ = resolve.__doc__
    KVConnectorFactory.get_connector_class = classmethod(get_connector_class)
