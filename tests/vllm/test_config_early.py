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
        (
            {"remote": "redis://:" + PASSWORD + "@127.0.0.1:99999/0"},
            "'remote': remote tier option 'url'",
        ),  # a bad port
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


def _plugin_dist(where: Path) -> None:
    """A distribution on sys.path declaring pyproject's vllm.general_plugins entry points, as `pip install`
    would (the test venv's umbp may be installed from another checkout)."""
    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    plugins = meta["project"]["entry-points"]["vllm.general_plugins"]
    info = where / "umbp_plugin_probe-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: umbp-plugin-probe\nVersion: 0.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in plugins.items())
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{lines}")


@pytest.mark.slow
def test_vllm_serve_stops_in_the_front_end_with_one_error(tiny_model_dir, tmp_path):
    """The real OpenAI server (multiprocess: front end, engine core, worker): a bad key stops the front end
    before the engine process starts. Without the plugin the same typo took 174 s, 268 lines and 5
    tracebacks here (it failed in the worker after the model loaded, then in every process above it)."""
    import os
    import socket
    import subprocess
    import sys

    from umbp.tools.vllm_harness import ARCH_CONFIGS

    _plugin_dist(tmp_path)
    src = Path(__file__).resolve().parents[2] / "src"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src), str(tmp_path)]),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    arch = ARCH_CONFIGS["granite"]
    transfer = (
        '{"kv_connector":"UMBPConnector","kv_connector_module_path":"umbp.vllm","kv_role":"kv_both",'
        '"kv_connector_extra_config":{"dram_gb":0.1,"tenent":"a"}}'
    )
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model_dir("granite")),
        "--dtype",
        arch["dtype"],
        "--block-size",
        str(arch["block_size"]),
        "--max-num-batched-tokens",
        str(arch["max_num_batched_tokens"]),
        "--enable-prefix-caching",
        "--prefix-match-unit",
        "16",
        "--max-model-len",
        "2048",
        "--skip-tokenizer-init",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-transfer-config",
        transfer,
    ]
    t0 = time.monotonic()
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - t0
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-2000:]
    umbp_lines = [line for line in out.splitlines() if "umbp:" in line]
    assert len(umbp_lines) == 1 and "'tenent' (did you mean 'tenant'?)" in umbp_lines[0], out[-3000:]
    assert out.count("Traceback") == 1, out[-3000:]
    assert "Initializing a V1 LLM engine" not in out  # the engine process never started
    assert elapsed < 150, elapsed  # measured 31 s on a loaded 2-core machine (mostly vLLM's imports)
