"""The replay with vLLM's ``OffloadingConnector`` in umbp's place (a peer row of `umbp replay --peers`).

Same loop, trace, clock, oracle and DRAM budget as umbp's rows (:class:`umbp.replay.driver.Replay`); only
the connector and its simulated workers differ (:mod:`umbp.replay.offloading`). Why a restore fell short of
the oracle is read off the peer's own CPU manager: which group's object at the oracle's boundary it lacks,
and whether that object was never stored or stored and then evicted.
"""

from __future__ import annotations

from vllm.utils.math_utils import round_up
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from umbp.replay import oracle
from umbp.replay.driver import Replay, RequestRecord
from umbp.replay.offloading import SimOffloadWorkers, StoreCounter, build_offloading_engine
from umbp.vllm.kv_layout import describe


class OffloadingReplay(Replay):
    """`Replay` with vLLM's OffloadingConnector (scheduler side real, worker side simulated)."""

    def _build(self) -> None:
        self.engine = build_offloading_engine(
            self.layout, retention=self.setting.retention, workdir=self.workdir
        )
        eng = self.engine
        # the oracle and the byte model use umbp's reading of the same vLLM config (no umbp connector runs)
        self.umbp_layout = describe(eng.vllm_config, eng.kv_cache_config)
        sched_side = eng.connector.connector_scheduler
        self.manager = sched_side.manager
        self.peer_config = sched_side.config
        self.stores = StoreCounter()
        self.stores.install(self.manager)
        self.workers = SimOffloadWorkers(
            self.layout.timing,
            tuple(self.umbp_layout.object_bytes),
            eng.vllm_config.parallel_config.world_size,
        )

    def _loads_done(self):
        return self.workers.loaded

    def _totals(self) -> dict[str, int]:
        """umbp-compatible names where the meaning is the same; ``stored_bytes``: CPU bytes taken (vLLM
        allocates one chunk of the largest group's size per key), all ranks."""
        spec_chunk_bytes = self._chunk_bytes()
        return {
            "stored_bytes": self.stores.stored_keys * spec_chunk_bytes,
            "stored_content_bytes": self.workers.stored_bytes,
            "stored_objects": self.stores.stored_keys,
            "evicted_objects": self.stores.evicted_keys,
            "store_refusals": self.stores.refused,
            "cpu_chunks": self.manager._num_chunks,
            "cpu_chunk_bytes": spec_chunk_bytes,
            "restored_tokens": sum(r.restored for r in self.records),
        }

    def _chunk_bytes(self) -> int:
        """One CPU chunk, all ranks, as CPUOffloadingSpec sizes it (rounded up to its alignment)."""
        cfg = self.engine.connector._kv_cache_config
        per_block = cfg.kv_cache_tensors[0].size // cfg.num_blocks
        raw = per_block * self.peer_config.blocks_per_chunk * self.workers.num_workers
        return round_up(raw, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)

    # ------------------------------------------------------------------ observation
    def observe_lookup(self, rec: RequestRecord, request, num_computed_tokens: int = 0, ext=None) -> None:
        rec.local = oracle.local_hit(self.engine.sched.kv_cache_manager, request)
        rec.oracle = oracle.oracle_hit(self.ever, request, self.umbp_layout)
        rec.umbp_hit = num_computed_tokens + (ext or 0)
        rec.reason = ""
        if max(rec.local, rec.umbp_hit) < rec.oracle:
            rec.reason = self.stop_reason(request, rec.oracle, num_computed_tokens)

    def _settle(self, rec: RequestRecord) -> None:
        if rec.restored_of_oracle >= rec.restorable:
            rec.reason = ""
        elif rec.external and not rec.load_ok:
            rec.reason = "load failed"
        elif not rec.reason:
            rec.reason = "vLLM took less than the connector's hit"

    def stop_reason(self, request, target: int, local: int) -> str:
        """The first object the CPU tier lacks for a resume at ``target``: each group's key at the boundary
        (a chunk's key, or a partial tail's), then the attention chunks between the local hit and it; with
        every object present, which of the connector's lookup rules stopped it."""
        cfg = self.peer_config
        unit = cfg.tokens_per_hash
        first_chunk = cfg.kv_group_configs[0].tokens_per_chunk
        mid_block = target % first_chunk != 0
        if target // unit > len(request.block_hashes):
            return "boundary beyond the hashed prompt"
        if mid_block and not cfg.supports_partial_tail:
            return f"boundary inside a block: partial tails off ({', '.join(partial_tail_blockers(cfg))})"
        for gcfg in cfg.kv_group_configs:
            key = make_offload_key(request.block_hashes[target // unit - 1], gcfg.group_idx)
            if not self._present(key):
                what = "state" if gcfg.requires_cow_source else "attention page"
                tail = " (partial tail)" if target % gcfg.tokens_per_chunk else ""
                return f"g{gcfg.group_idx} {what}{tail} at the boundary {self._why(key)}"
        for gcfg in cfg.kv_group_configs:
            if gcfg.sliding_window_size_in_chunks is not None:
                continue
            per = gcfg.hashes_per_chunk
            for end in range(local // gcfg.tokens_per_chunk + 1, target // gcfg.tokens_per_chunk + 1):
                key = make_offload_key(request.block_hashes[end * per - 1], gcfg.group_idx)
                if not self._present(key):
                    return f"g{gcfg.group_idx} earlier attention block {self._why(key)}"
        if mid_block:
            return "objects present; a partial tail is looked up only in the block after a complete-chunk hit"
        return "objects present; the connector's lookup rule"

    def _present(self, key) -> bool:
        chunk = self.manager._policy.get(key)
        return chunk is not None and chunk.is_ready

    def _why(self, key) -> str:
        if key in self.stores.admitted:
            if self.manager._policy.get(key) is None:
                return "missing (evicted from CPU)"
            return "missing (store in flight)"
        if key in self.stores.offered:
            return "missing (store refused)"
        # e.g. the block that held an earlier partial-tail load: vLLM 0.32 counts it as stored at the load
        return "missing (never offered for store)"


def partial_tail_blockers(cfg) -> list[str]:
    """Which of vLLM 0.32's conditions for the OffloadingConnector's partial-tail path a layout fails
    (``SchedulerOffloadConfig.supports_partial_tail``: one block per chunk, one block size, a recurrent
    group with blocks longer than a hash unit, no sliding window, no EAGLE group, DCP 1)."""
    out = []
    if cfg.dcp_world_size != 1:
        out.append(f"DCP {cfg.dcp_world_size}")
    eagle = [g.group_idx for g in cfg.kv_group_configs if g.is_eagle_group]
    if eagle:
        out.append(f"EAGLE group g{eagle[0]}")
    sizes = sorted({g.tokens_per_block for g in cfg.kv_group_configs}, reverse=True)
    if len(sizes) > 1:
        out.append("block sizes " + "/".join(map(str, sizes)))
    if cfg.blocks_per_chunk != 1:
        out.append(f"{cfg.blocks_per_chunk} blocks per chunk")
    return out or ["no recurrent group longer than a hash unit, or a sliding window"]
