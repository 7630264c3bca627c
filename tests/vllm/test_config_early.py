"""A bad kv_connector_extra_config stops vLLM while it builds its config, before any weights load.

Runs vLLM's real `EngineArgs.create_engine_config` and `LLM(...)` on CPU with umbp's general plugin
registered (pyproject's `vllm.general_plugins` entry point does that wherever umbp is pip-installed).
"""

from __future__ import annotations

import time
import tomllib
import traceback
from pathlib import Path

import pytest

PASSWORD = "p#/?@:w0rd"


@pytest.fixture
def plugin():
    """umbp's plugin registered for the test, vLLM's factory restored after it (tests stay independent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from umbp.vllm.plugin import register

    saved = KVConnectorFactory.__dict__["get_connector_class"]
    register()
    register()  # plugins load once per process and again in later ones: a second call must not wrap twice
    yield KVConnectorFactory
    KVConnectorFactory.get_connector_class = saved


def _engine_args(model_dir: Path, extra: dict, connector: str = "UMBPConnector"):
    from vllm.engine.arg_utils import EngineArgs

    from umbp.tools.vllm_harness import ARCH_CONFIGS

    transfer = dict(kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra)
    if connector == "UMBPConnector":
        transfer["kv_connector_module_path"] = "umbp.vllm"
    return EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=2048,
        enable_prefix_caching=True,
        prefix_match_unit=16,
        kv_transfer_config=transfer,
        **ARCH_CONFIGS["granite"],
    )


def _frames(exc: BaseException) -> list[str]:
    return [f.name for f in traceback.extract_tb(exc.__traceback__)]


@pytest.mark.parametrize(
    "extra,key",
    [
        ({"dram_gbs": 1}, "'dram_gbs' (did you mean 'dram_gb'?)"),
        ({"dram_gb": float("nan")}, "'dram_gb' must be a finite number"),
        ({"quarantine_s": -1}, "'quarantine_s' must be a finite number >= 0"),
        (
            {"remote": ["redis://:" + PASSWORD + "@127.0.0.1:6379"]},
            "'remote' must be a Redis URL or an options dict",
        ),
        ({"remote": "redis://:" + PASSWORD + "@127.0.0.1:6379/0"}, "'remote': remote url"),
    ],
)
def test_bad_key_fails_while_vllm_builds_its_config(plugin, tiny_model_dir, extra, key):
    args = _engine_args(tiny_model_dir("granite"), extra)
    with pytest.raises(ValueError) as err:  # vLLM's pydantic config wraps umbp's ConfigError (a ValueError)
        args.create_engine_config()
    msg = str(err.value)
    lines = [line for line in msg.splitlines() if "umbp:" in line]
    assert len(lines) == 1 and key in lines[0], msg  # one line, naming the key
    assert "kv_connector_extra_config key" in lines[0]
    assert PASSWORD not in msg and "w0rd" not in msg
    assert "create_engine_config" in _frames(err.value)


def test_a_good_config_builds_and_other_connectors_are_untouched(plugin, tiny_model_dir):
    cfg = _engine_args(tiny_model_dir("granite"), {"dram_gb": 0.25, "ssd_gb": 1.5}).create_engine_config()
    assert cfg.kv_transfer_config.kv_connector_extra_config == {"dram_gb": 0.25, "ssd_gb": 1.5}
    other = _engine_args(tiny_model_dir("granite"), {"dram_gbs": "not umbp's"}, connector="ExampleConnector")
    assert (
        plugin.get_connector_class(other.create_engine_config().kv_transfer_config).__name__
        == "ExampleConnector"
    )


def test_llm_start_stops_before_the_model_loads(plugin, tiny_model_dir):
    from vllm import LLM

    from umbp.tools.vllm_harness import ARCH_CONFIGS, setup_env

    setup_env()
    t0 = time.monotonic()
    with pytest.raises(ValueError) as err:
        LLM(
            model=str(tiny_model_dir("granite")),
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=2048,
            enable_prefix_caching=True,
            prefix_match_unit=16,
            **ARCH_CONFIGS["granite"],
            kv_transfer_config=dict(
                kv_connector="UMBPConnector",
                kv_connector_module_path="umbp.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={"dram_gb": 1, "tenent": "a"},
            ),
        )
    elapsed = time.monotonic() - t0
    assert "unknown kv_connector_extra_config key(s) 'tenent' (did you mean 'tenant'?)" in str(err.value)
    frames = _frames(err.value)
    assert "create_engine_config" in frames  # raised while the config was built ...
    assert not {"load_model", "_initialize_kv_caches", "init_device"} & set(frames)  # ... no engine yet
    assert elapsed < 60, elapsed  # measured ~1-3 s; a start that loads the model takes far longer


def test_the_connector_validates_in_vllms_cuda_graph_hook():
    """On GPU without --enforce-eager vLLM calls this while building its config, plugin or not."""
    from umbp.vllm import UMBPConnector
    from umbp.vllm.config import ConfigError

    assert UMBPConnector.requires_piecewise_for_cudagraph({"dram_gb": 1}) is False
    with pytest.raises(ConfigError, match="'high_watermark' must be a finite number > 0 and <= 1, got 2"):
        UMBPConnector.requires_piecewise_for_cudagraph({"high_watermark": 2})


def test_pyproject_declares_the_plugin():
    root = Path(__file__).resolve().parents[2]
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["vllm.general_plugins"]["umbp"] == "umbp.vllm.plugin:register"
