"""umbp's counters travel vLLM's KV-connector stats path: logging and Prometheus."""

from __future__ import annotations

import functools
import os

import pytest

if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging  # noqa: E402

from umbp.vllm import UMBPConnector  # noqa: E402
from umbp.vllm.stats import UMBPStats  # noqa: E402


def test_stats_aggregate_by_addition_and_reset_per_interval():
    a, b = UMBPStats(), UMBPStats()
    a.add("restored_tokens", 832)
    b.add("restored_tokens", 16)
    b.add("stored_objects_g1", 2)
    merged = a.aggregate(b)
    assert merged.reduce() == {"restored_tokens": 848, "stored_objects_g1": 2}
    assert a.take().data == {"restored_tokens": 832} and a.take() is None


def test_vllm_logging_accepts_umbp_stats():
    logging = KVConnectorLogging(
        KVTransferConfig(
            kv_connector="UMBPConnector", kv_connector_module_path="umbp.vllm", kv_role="kv_both"
        )
    )
    logging.observe({"restored_tokens": 832, "loaded_bytes": 4096})
    logging.observe({"restored_tokens": 16})
    lines = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: loaded_bytes=4096, restored_tokens=848"]


def test_prometheus_counters():
    reg = CollectorRegistry()
    types = {
        Gauge: functools.partial(Gauge, registry=reg),
        Counter: functools.partial(Counter, registry=reg),
        Histogram: functools.partial(Histogram, registry=reg),
    }
    vllm_config = type("Cfg", (), {"kv_transfer_config": None})()
    prom = UMBPConnector.build_prom_metrics(vllm_config, types, ["engine"], {0: ["0"]})
    prom.observe({"restored_tokens": 832, "load_failures": 0})
    prom.observe({"restored_tokens": 16})
    assert reg.get_sample_value("vllm:umbp_restored_tokens_total", {"engine": "0"}) == 848


def _registry():
    reg = CollectorRegistry()
    types = {
        Gauge: functools.partial(Gauge, registry=reg),
        Counter: functools.partial(Counter, registry=reg),
        Histogram: functools.partial(Histogram, registry=reg),
    }
    return reg, types


def test_every_counter_is_exported_from_the_start():
    """rate() alerts need each series to exist before it first moves."""
    from umbp.vllm.stats import COUNTERS, TIER_COUNTERS, TIERS

    reg, types = _registry()
    vllm_config = type("Cfg", (), {"kv_transfer_config": None})()
    UMBPConnector.build_prom_metrics(vllm_config, types, ["engine"], {0: ["0"], 1: ["1"]})
    for name in COUNTERS:
        for engine in ("0", "1"):
            assert reg.get_sample_value(f"vllm:umbp_{name}_total", {"engine": engine}) == 0.0, name
    for name in TIER_COUNTERS:
        for tier in TIERS:
            assert reg.get_sample_value(f"vllm:umbp_tier_{name}_total", {"engine": "0", "tier": tier}) == 0.0


def test_group_and_tier_are_labels_not_names():
    reg, types = _registry()
    vllm_config = type("Cfg", (), {"kv_transfer_config": None})()
    prom = UMBPConnector.build_prom_metrics(vllm_config, types, ["engine"], {0: ["0"]})
    prom.observe(
        {
            "stored_objects_g1": 3,
            "stored_objects_g0": 2,
            "ssd_loaded_objects": 5,
            "loaded_objects": 7,
            "remote_loaded_bytes": 4096,
            "ssd_saves_dropped": 1,
        }
    )
    assert reg.get_sample_value("vllm:umbp_group_stored_objects_total", {"engine": "0", "group": "1"}) == 3
    assert reg.get_sample_value("vllm:umbp_group_stored_objects_total", {"engine": "0", "group": "0"}) == 2
    assert reg.get_sample_value("vllm:umbp_tier_loaded_objects_total", {"engine": "0", "tier": "ssd"}) == 5
    assert (
        reg.get_sample_value("vllm:umbp_tier_loaded_bytes_total", {"engine": "0", "tier": "remote"}) == 4096
    )
    assert reg.get_sample_value("vllm:umbp_tier_saves_dropped_total", {"engine": "0", "tier": "ssd"}) == 1
    assert reg.get_sample_value("vllm:umbp_loaded_objects_total", {"engine": "0"}) == 7
    names = {m.name for m in reg.collect()}
    assert not any("_g1" in n or n.startswith("vllm:umbp_ssd_") for n in names), names


def test_docs_list_every_counter():
    from pathlib import Path

    from umbp.vllm.stats import COUNTERS, GROUP_COUNTERS, TIER_COUNTERS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    names = [*COUNTERS, *(f"tier_{n}" for n in TIER_COUNTERS), *(f"group_{n}" for n in GROUP_COUNTERS)]
    missing = [n for n in names if f"`vllm:umbp_{n}_total" not in doc]
    assert not missing, f"docs/vllm.md does not list {missing}"


def test_umbp_logs_go_through_vllms_handlers():
    """vLLM gives only its `vllm` logger a handler (when the engine starts); umbp's records must reach it."""
    import io
    import logging

    from umbp.vllm.logs import attach_to_vllm_logging

    umbp_logger, vllm_logger = logging.getLogger("umbp"), logging.getLogger("vllm")
    saved = (
        list(umbp_logger.handlers),
        umbp_logger.level,
        umbp_logger.propagate,
        list(vllm_logger.handlers),
        vllm_logger.level,
    )
    stream = io.StringIO()
    vllm_handler = logging.StreamHandler(stream)
    vllm_handler.setFormatter(logging.Formatter("VLLMFMT %(levelname)s [%(name)s] %(message)s"))
    try:
        umbp_logger.handlers.clear()
        vllm_logger.handlers[:] = []
        assert not attach_to_vllm_logging(), "nothing to attach to while vLLM's logging is off"
        vllm_logger.handlers[:] = [vllm_handler]
        vllm_logger.setLevel(logging.INFO)
        assert attach_to_vllm_logging() and attach_to_vllm_logging(), "idempotent"
        logging.getLogger("umbp.vllm").info("umbp: scheduler connector up")
        logging.getLogger("umbp.vllm").debug("below vLLM's level")
        assert stream.getvalue() == "VLLMFMT INFO [umbp.vllm] umbp: scheduler connector up\n"
        umbp_logger.handlers.clear()
        own = logging.StreamHandler(io.StringIO())
        umbp_logger.addHandler(own)
        assert not attach_to_vllm_logging() and umbp_logger.handlers == [own], (
            "an application's setup is kept"
        )
    finally:
        umbp_logger.handlers[:] = saved[0]
        umbp_logger.setLevel(saved[1])
        umbp_logger.propagate = saved[2]
        vllm_logger.handlers[:] = saved[3]
        vllm_logger.setLevel(saved[4])
