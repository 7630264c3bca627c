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
    logging = KVConnectorLogging(KVTransferConfig(kv_connector="UMBPConnector",
                                                  kv_connector_module_path="umbp.vllm", kv_role="kv_both"))
    logging.observe({"restored_tokens": 832, "loaded_bytes": 4096})
    logging.observe({"restored_tokens": 16})
    lines = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: loaded_bytes=4096, restored_tokens=848"]


def test_prometheus_counters():
    reg = CollectorRegistry()
    types = {Gauge: functools.partial(Gauge, registry=reg), Counter: functools.partial(Counter, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}
    vllm_config = type("Cfg", (), {"kv_transfer_config": None})()
    prom = UMBPConnector.build_prom_metrics(vllm_config, types, ["engine"], {0: ["0"]})
    prom.observe({"restored_tokens": 832, "load_failures": 0})
    prom.observe({"restored_tokens": 16})
    assert reg.get_sample_value("vllm:umbp_restored_tokens_total", {"engine": "0"}) == 848
