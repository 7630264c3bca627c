"""The engine options that change what a model computes, as the namespace sees them
(umbp.vllm.model_options): only those set away from their defaults, rendered the same in every process."""

from __future__ import annotations

import enum
from types import SimpleNamespace

from umbp.vllm.model_options import model_options


def _config(**set_options):
    base = dict(
        quantization=None,
        quantization_config=None,
        hf_overrides={},
        hf_config_path=None,
        model_weights="",
        code_revision=None,
        model_class_overrides={},
        model_impl="auto",
        convert="auto",
        config_format="auto",
        disable_sliding_window=False,
    )
    return SimpleNamespace(**(base | set_options))


def _rope(config):  # an hf_overrides callable
    return config


class Impl(enum.Enum):
    AUTO = "auto"
    TRANSFORMERS = "transformers"


def test_defaults_list_nothing():
    assert model_options(_config()) == ()
    assert model_options(_config(model_impl=Impl.AUTO)) == ()
    assert model_options(SimpleNamespace()) == ()  # an engine version without these fields


def test_options_set_are_listed_sorted_and_canonical():
    got = model_options(
        _config(
            quantization="fp8",
            hf_overrides={"rope_theta": 1234.0, "a": [1, 2]},
            model_impl=Impl.TRANSFORMERS,
            disable_sliding_window=True,
        )
    )
    assert got == (
        ("disable_sliding_window", "true"),
        ("hf_overrides", '{"a":[1,2],"rope_theta":1234.0}'),
        ("model_impl", '"transformers"'),
        ("quantization", '"fp8"'),
    )
    # the same overrides in another order are the same option
    again = model_options(_config(hf_overrides={"a": [1, 2], "rope_theta": 1234.0}))
    assert dict(again)["hf_overrides"] == dict(got)["hf_overrides"]


def test_callables_and_objects_render_without_addresses():
    """The scheduler and every worker compute the namespace on their own: a repr holding a memory
    address would give each process another one."""

    class Args:
        def __repr__(self):
            return f"<Args at {id(self):#x}>"

    got = dict(model_options(_config(hf_overrides=_rope, quantization_config=Args())))
    assert got["hf_overrides"] == f'"{_rope.__module__}._rope"'
    assert "0x" not in got["quantization_config"] and "Args" in got["quantization_config"]
