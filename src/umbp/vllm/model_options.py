"""The engine options that change what a model computes without changing its name, revision, dtype or
page shapes, as part of the key namespace (umbp.identity.ModelIdentity.model_options).

Why: two deployments of one checkpoint, one quantized (or with a config override such as `rope_theta`,
or other weights), write pages of the same shape for the same tokens with different contents. Sharing an
SSD directory or a shared tier, each would restore the other's KV and state: wrong tokens. With these
options in the namespace, each deployment only ever finds its own objects.

Only options set away from their defaults are listed, so deployments that set none keep the namespace
they had. The values are rendered as canonical text that is the same in every process (the scheduler and
each worker compute the namespace on their own): sorted JSON, callables by their qualified name, never a
repr that holds a memory address. The resolved `hf_config` is deliberately not digested: model code may
set attributes on it while the weights load, in the workers only, and the namespaces would then differ.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

# ModelConfig field -> its default (options whose value differs from it are listed)
_OPTIONS: dict[str, Any] = {
    "quantization": None,
    "quantization_config": None,
    "hf_overrides": {},
    "hf_config_path": None,
    "model_weights": "",
    "code_revision": None,
    "model_class_overrides": {},
    "model_impl": "auto",
    "convert": "auto",
    "config_format": "auto",
    "disable_sliding_window": False,
}


def model_options(model_config: Any) -> tuple[tuple[str, str], ...]:
    """(name, canonical text) of each option in _OPTIONS that `model_config` sets away from its default,
    sorted by name."""
    out = []
    for name, default in sorted(_OPTIONS.items()):
        value = _plain(getattr(model_config, name, default))
        if value != _plain(default) and value not in (None, {}, [], ""):
            out.append((name, json.dumps(value, sort_keys=True, separators=(",", ":"))))
    return tuple(out)


def _plain(value: Any) -> Any:
    """`value` as JSON-ready data that reads the same in every process."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__qualname__, **_plain(dataclasses.asdict(value))}
    if hasattr(value, "model_dump"):  # pydantic models
        return {"type": type(value).__qualname__, **_plain(value.model_dump())}
    if callable(value):  # a function that rewrites the config: named, its code cannot be digested stably
        return (
            f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
        )
    return f"{type(value).__module__}.{type(value).__qualname__}"
