"""umbp's per-step connector stats, carried by vLLM's KV-connector stats path to its logs and Prometheus.

Every value is a counter summed over the interval (and over ranks for worker-side counts), so aggregation is
addition. Inside the stats dict a per-group count is a flat key ``<name>_g<group>`` and a per-tier count a key
``<tier>_<name>``: flat keys keep vLLM's log line readable and its aggregation generic. Prometheus gets labels
instead (``group``, ``tier``), so one series family covers every group and tier and a dashboard needs no
per-model metric names.

Every counter in :data:`COUNTERS` is exported from the start with value 0: a ``rate()`` alert on a counter
that appears only once it first moves would stay silent until then.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# name -> help. Exported as `vllm:umbp_<name>_total`; docs/vllm.md lists the same names (a test checks).
COUNTERS: dict[str, str] = {
    "lookups": "requests looked up in umbp's tiers",
    "lookup_hit_requests": "lookups that found a restorable prefix beyond the local GPU hit",
    "hit_tokens": "tokens umbp offered to vLLM beyond the local GPU hit",
    "restored_tokens": "tokens whose KV and state were restored (loads that completed and verified)",
    "loaded_objects": "objects loaded into the KV cache, from every tier",
    "loaded_bytes": "bytes copied into the KV cache by loads, summed over ranks",
    "load_failures": "loads that failed (vLLM recomputes those requests)",
    "load_failures_rank": "rank-level load failures (a request's load fails if any rank's does)",
    "checksum_failures": "objects whose checksum did not match when loaded (counted as misses)",
    "stored_objects": "objects stored (logical objects; each rank stores its shard)",
    "stored_bytes": "DRAM bytes the stored objects take (slots of whole 4 KiB pages, times the ranks)",
    "stored_data_bytes": "bytes of state and KV the stored objects hold (no padding; times the ranks)",
    "stored_bytes_rank": "bytes stored, summed over ranks",
    "save_failures": "objects whose save failed",
    "saves_dropped_no_space": "saves dropped because the DRAM tier had no room even after eviction",
    "lookups_layout_pending": "pipeline parallel: lookups answered 0 before every stage reported its layout",
    "saves_dropped_layout_pending": "pipeline parallel: saves dropped before every stage reported its layout",
    "evictions": "objects evicted from the DRAM tier",
    "demotions": "objects copied from DRAM to the SSD tier on eviction",
    "demotions_dropped": "evicted objects not demoted (SSD staging full)",
    "demotion_errors": "demotions that failed",
    "promotions": "objects read from the SSD or shared tier into DRAM for a load",
    "promotions_failed": "promotions that failed (missing, corrupt or unreachable: counted as misses)",
    "hash_rewrites": "lookups that found a request's block hashes recomputed by vLLM (its cached keys dropped)",
    "handoffs_started": "store-mediated P/D, P: hand-offs begun (requests finished with do_remote_decode)",
    "handoffs_delivered": "store-mediated P/D, P: hand-offs whose objects were all visible on the shared tier",
    "handoff_timeouts": "store-mediated P/D, P: hand-offs released after handoff_timeout_s, not all visible",
    "handoffs_unavailable": "store-mediated P/D, P: hand-offs not started, objects neither shared nor being saved",
    "republished_objects": "store-mediated P/D, P: objects written to the shared tier again from DRAM (it lost them)",
    "handoff_delivery_us": "store-mediated P/D, P: microseconds from finish to visible, summed over hand-offs",
    "handoffs_received": "store-mediated P/D, D: hand-offs whose named boundary the lookup reached",
    "handoff_misses": "store-mediated P/D, D: hand-offs incomplete after handoff_wait_s (rest recomputed)",
    "handoff_wait_us": "store-mediated P/D, D: microseconds requests waited for hand-offs, summed",
}

# name -> help for per-tier counters: `vllm:umbp_tier_<name>_total{tier=...}`.
TIER_COUNTERS: dict[str, str] = {
    "loaded_objects": "objects loaded, by the tier they were read from",
    "loaded_bytes": "bytes read from the SSD or shared tier for loads",
    "saves_queued": "objects queued for write-through to the tier",
    "saves_dropped": "write-throughs dropped because the tier's queue was full",
}
TIERS = ("dram", "ssd", "remote")

# name -> help for per-group counters: `vllm:umbp_group_<name>_total{group=...}`.
GROUP_COUNTERS: dict[str, str] = {
    "stored_objects": "objects stored, by KV-cache group",
}

_GROUP_KEY = re.compile(r"^(?P<name>[a-z_]+)_g(?P<group>\d+)$")
_TIER_KEY = re.compile(rf"^(?P<tier>{'|'.join(TIERS)})_(?P<name>[a-z_]+)$")


def split_key(key: str) -> tuple[str, dict[str, str]]:
    """A stats key -> (Prometheus family, labels). ``stored_objects_g1`` -> ``group_stored_objects``,
    ``{"group": "1"}``; ``ssd_loaded_bytes`` -> ``tier_loaded_bytes``, ``{"tier": "ssd"}``."""
    if m := _GROUP_KEY.match(key):
        return f"group_{m['name']}", {"group": m["group"]}
    if m := _TIER_KEY.match(key):
        return f"tier_{m['name']}", {"tier": m["tier"]}
    return key, {}


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
    """Exposes umbp's counters on vLLM's Prometheus endpoint, every one from the start."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for name, doc in COUNTERS.items():
            self._family(name, doc, ())
        for name, doc in TIER_COUNTERS.items():
            for tier in TIERS:
                for idx in self.per_engine_labelvalues:
                    self._child(f"tier_{name}", {"tier": tier}, idx, doc)
        for name, doc in GROUP_COUNTERS.items():
            self._family(f"group_{name}", doc, ("group",))
        for name in COUNTERS:
            for idx in self.per_engine_labelvalues:
                self._child(name, {}, idx)

    def _family(self, family: str, doc: str, extra: tuple[str, ...]):
        metric = self._families.get(family)
        if metric is None:
            metric = self._counter_cls(
                name=f"vllm:umbp_{family}", documentation=doc, labelnames=[*self._labelnames, *extra]
            )
            self._families[family] = metric
        return metric

    def _child(self, family: str, labels: dict[str, str], engine_idx: int, doc: str = ""):
        metric = self._family(family, doc or f"umbp counter {family}", tuple(labels))
        return metric.labels(*self.per_engine_labelvalues[engine_idx], *labels.values())

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if isinstance(value, int | float) and value > 0:
                family, labels = split_key(key)
                self._child(family, labels, engine_idx).inc(value)
