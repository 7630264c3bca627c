"""`UMBPConnector`: vLLM 0.32's KV-connector API over umbp's embedded DRAM tier.

    --kv-transfer-config '{"kv_connector":"UMBPConnector","kv_connector_module_path":"umbp.vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"dram_gb":64}}'

vLLM builds one instance in the scheduler process (role SCHEDULER) and one per worker (role WORKER);
this class only routes each hook to `SchedulerSide` or `WorkerSide`.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from umbp.pool import native
from umbp.vllm.compose import apply_load_failure_policy, enclosing_transfer_configs, register_with_vllm
from umbp.vllm.config import ConfigError, UMBPConfig
from umbp.vllm.kv_layout import describe
from umbp.vllm.logs import attach_to_vllm_logging
from umbp.vllm.metadata import UMBPConnectorMetadata, UMBPLayoutReport
from umbp.vllm.scheduler import SchedulerSide
from umbp.vllm.stats import UMBPPromMetrics, UMBPStats
from umbp.vllm.worker import WorkerSide

logger = logging.getLogger("umbp.vllm")
register_with_vllm()  # a MultiConnector rebuilds its children's stats by registered name (umbp.vllm.compose)


class UMBPConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        attach_to_vllm_logging()
        transfer = vllm_config.kv_transfer_config
        self.cfg = UMBPConfig.from_extra_config(transfer.kv_connector_extra_config)
        # A hybrid model cannot report block-level load errors, only failed requests; with vLLM's default
        # "fail" policy a missing page would fail the request. umbp's contract is "a miss is a recompute".
        # Inside a MultiConnector vLLM reads the policy from the outer config (umbp.vllm.compose).
        apply_load_failure_policy(transfer, self.cfg.load_failure_policy)
        # inside a MultiConnector the start-up handshake carries only one child's metadata (vLLM 0.32 takes
        # the first that is not None): umbp then leaves it to the other connector (NIXL needs it)
        self._nested = bool(enclosing_transfer_configs(transfer))
        if self._nested and transfer.kv_role in ("kv_producer", "kv_consumer"):
            # store-mediated P/D beside another connector: both would answer the P/D kv_transfer_params,
            # and MultiConnector raises on the clash in the middle of the first P/D request's step
            raise ConfigError(
                f"umbp: kv_role {transfer.kv_role!r} inside a MultiConnector: beside another connector "
                "umbp's kv_role must be 'kv_both' (the P/D connector beside it hands off; 'kv_producer' / "
                "'kv_consumer' select umbp's own store-mediated P/D, used without a MultiConnector)"
            )
        self.layout = describe(vllm_config, kv_cache_config, tenant=self.cfg.tenant)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.cfg, self.layout, role=transfer.kv_role)
        else:
            self._worker = WorkerSide(self.cfg, self.layout, kv_cache_config)
        logger.info(
            "umbp: %s connector (the umbp package, not vLLM's in-tree UMBPStoreConnector), namespace %s, "
            "unit %d, groups %s, eagle groups %s; pool paths: %s",
            role.name.lower(),
            self.layout.namespace,
            self.layout.unit,
            [type(g).__name__ for g in self.layout.groups],
            sorted(self.layout.eagle_groups),
            native.describe(),
        )

    @classmethod
    def umbp_validate_extra_config(cls, extra_config: dict[str, Any] | None) -> UMBPConfig:
        """Raise ConfigError (naming the key) for a bad extra config; called while vLLM builds its config
        (umbp.vllm.plugin) so a typo stops start-up before the model loads."""
        return UMBPConfig.from_extra_config(extra_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # vLLM asks this while building its config when full CUDA graphs are on: the earliest point a
        # connector sees its options without the plugin. umbp has no layer-wise hooks, so the answer is no.
        cls.umbp_validate_extra_config(extra_config)
        return False

    # A best-effort cache: a dropped save is a future miss, not a lost hand-off.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # vLLM 0.34 asks before it turns on lookahead block hashes under EAGLE. umbp keys objects by vLLM's
    # block hashes and reads its EAGLE rule from vLLM's own config (umbp.vllm.compat.eagle_block_drop),
    # so it follows either hashing; with lookahead hashes nothing is dropped and hits reach a block further.
    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config) -> bool:
        return True

    # ============================================================ scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        if self._sched is not None:
            self._sched.block_pool = gpu_block_pool

    def on_new_request(self, request) -> None:
        self._sched.track(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.lookup(request, num_computed_tokens)

    def may_load_async(self, request) -> bool:
        """vLLM 0.34, with --max-num-inflight-kv-loads: a request umbp will likely load starts its load
        while the running batch is full. A cheap guess (local tiers only), see SchedulerSide.may_load."""
        return self._sched is not None and self._sched.may_load(request)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._sched.on_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> UMBPConnectorMetadata:
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._sched.on_worker_output(connector_output)

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads) -> bool:
        self._sched.on_partial_tail(request, block_ids, partial_tail_offloads)
        return False  # the blocks it saves are pinned by the connector itself

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        # (True, params) only for a store-mediated hand-off (kv_producer): see umbp.vllm.handoff
        return self._sched.on_finished(request, block_ids)

    # Pipeline parallelism: every rank's layout reaches the scheduler before the first request through
    # vLLM's start-up handshake (umbp.vllm.stages). The base class refuses metadata from stages past the
    # first, which beside a P/D connector (whose metadata this is then) would stop start-up.
    def set_xfer_handshake_metadata_pp_aware(self, metadata) -> None:
        self.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata(self, metadata) -> None:
        if self._sched is None:
            return
        layouts: dict = {}
        for value in (metadata or {}).values():
            if isinstance(value, UMBPLayoutReport):
                layouts.update(value.layouts)
        if layouts:
            self._sched.learn_layouts(layouts)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    def reset_cache(self) -> bool | None:
        return self._sched.reset() if self._sched is not None else None

    def get_kv_connector_stats(self) -> UMBPStats | None:
        side = self._sched or self._worker
        return side.stats.take() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> UMBPStats:
        return UMBPStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return UMBPPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register(kv_caches)

    # Sleep mode and weight updates (vLLM 0.33+): the KV cache's memory is released, then mapped again at
    # the same addresses with undefined contents. Copies in flight finish first; none start meanwhile.
    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.suspend()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.resume()

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.before_forward()  # vLLM binds before the forward; start_load_kv may come after it
            if isinstance(connector_metadata, UMBPConnectorMetadata):
                self._worker.delivered.update(connector_metadata.handoffs_done)
                if connector_metadata.layouts_known:
                    self._worker.layout_known = True

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, UMBPConnectorMetadata) and meta.loads:
            self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request: vLLM schedules a request only after its load is reported done

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saves run after the forward, in wait_for_save (Mamba layers have no per-layer hook)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, UMBPConnectorMetadata) and meta.saves:
            self._worker.save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished, failed = self._worker.take_transfer_results()
        sent, self._worker.delivered = self._worker.delivered, set()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=finished, failed_recving=failed
        )

    def build_connector_worker_meta(self):
        return self._worker.take_worker_meta() if self._worker is not None else None

    def get_handshake_metadata(self) -> UMBPLayoutReport | None:
        w = self._worker
        if w is None or self._nested or w.layout_known or w.arena is None:
            return None
        return UMBPLayoutReport({w.rank.tag(): w.reported_layout()})

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
