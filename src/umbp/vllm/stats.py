"""umbp's per-step connector stats, carried by vLLM's KV-connector stats path to its logs and Prometheus.

All values are counters summed over the interval (and over ranks for worker-side byte counts), so
aggregation is addition. Per-group counters are flat keys like ``stored_objects_g1``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# Counters every interval reports (others, like per-group keys, appear when non-zero).
BASE_COUNTERS = (
    "lookups",
    "lookup_hit_requests",
    "hit_tokens",
    "restored_tokens",
    "load_failures",
    "loaded_objects",
    "loaded_bytes",
    "stored_objects",
    "stored_bytes",
    "save_failures",
    "saves_dropped_no_space",
    "evictions",
)


@dataclass
class UMBPStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def add(self, key: str, value: int | float = 1) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def aggregate(self, other: KVConnectorStats) -> UMBPStats:
        merged = Counter(self.data)
        merged.update(other.data)
        return UMBPStats(data=dict(merged))

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> UMBPStats | None:
        """Hand the interval's counters to vLLM and start a new interval."""
        if self.is_empty():
            return None
        out = UMBPStats(data=dict(self.data))
        self.reset()
        return out


class UMBPPromMetrics(KVConnectorPromMetrics):
    """Exposes every umbp counter as `vllm:umbp_<name>_total` on vLLM's Prometheus endpoint."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}

    def _counter(self, name: str, engine_idx: int):
        per_engine = self._counters.get(name)
        if per_engine is None:
            metric = self._counter_cls(
                name=f"vllm:umbp_{name}",
                documentation=f"umbp connector counter {name}",
                labelnames=self._labelnames,
            )
            per_engine = {
                idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()
            }
            self._counters[name] = per_engine
        return per_engine[engine_idx]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if isinstance(value, int | float) and value > 0:
                self._counter(name, engine_idx).inc(value)
