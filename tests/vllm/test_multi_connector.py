"""umbp inside vLLM 0.32's MultiConnector beside a P/D connector (NIXL), on the real Scheduler.

The prefill instance of a 1P1D deployment runs MultiConnector[NixlConnector, UMBPConnector]. The scheduler
and both connectors' scheduler sides are vLLM's own; the workers are umbp's real worker side on fake CPU
"GPU" tensors (sched_harness), and NIXL's worker (which needs the nixl library and a peer) is stood in for
by reporting `finished_sending` once the test says the decode instance pulled the blocks.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from sched_harness import GroupDef, Harness, _spec, build, fake_model_dir  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,  # noqa: E402
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiConnector,
    MultiKVConnectorStats,
    MultiKVConnectorWorkerMetadata,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from umbp.replay.engine import make_scheduler  # noqa: E402
from umbp.tools.pd import TO_DECODE  # noqa: E402
from umbp.tools.vllm_harness import umbp_transfer  # noqa: E402
from umbp.vllm.config import ConfigError  # noqa: E402
from umbp.vllm.connector import UMBPConnector  # noqa: E402

PROMPT = [3 + (i * 37) % 500 for i in range(840)]
GROUPS = [GroupDef("fa", 400), GroupDef("mamba", 400)]
NUM_BLOCKS = 64


class MultiHarness(Harness):
    """sched_harness.Harness with a MultiConnector scheduler: each step hands umbp's workers their part of
    the MultiConnector metadata and returns their worker metadata wrapped the way MultiConnector expects;
    `pulled` holds the requests whose blocks the decode instance has read (NIXL's finished_sending)."""

    umbp_index: int = 1
    pulled: set
    params: dict  # request id -> the kv_transfer_params the scheduler returned at finish
    stats: list  # every step's SchedulerStats.kv_connector_stats (as vLLM serializes it)

    @property
    def umbp(self):
        return self.sched.connector.sub_connectors[self.umbp_index]._sched

    def add(self, req_id, prompt, max_tokens=3, params=None):
        extra = {"kv_transfer_params": dict(params)} if params else None
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            pooling_params=None,
            block_hasher=self.hasher,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra),
        )
        self.sched.add_request(req)
        return req

    def run_until_handed_off(self, req_id: str, max_steps: int = 200) -> None:
        """Step until the request finished and umbp's saves were confirmed; its blocks stay with NIXL
        (vLLM keeps the request until finished_sending), so `run` would wait for the decode side forever."""
        for _ in range(max_steps):
            if req_id in self.params and not self.umbp.has_pending_work() and not self.umbp.loads:
                return
            self.step()
        raise AssertionError(f"{req_id} was not handed off in {max_steps} steps")

    def step(self):
        so = self.sched.schedule()
        multi = so.kv_connector_metadata
        so.kv_connector_metadata = multi.metadata[self.umbp_index]
        out = self.execute(so)
        so.kv_connector_metadata = multi
        kv_out = out.kv_connector_output
        metas = [None, None]
        metas[self.umbp_index] = kv_out.kv_connector_worker_meta
        kv_out.kv_connector_worker_meta = MultiKVConnectorWorkerMetadata(tuple(metas))
        if kv_out.kv_connector_stats is not None:  # a MultiConnector worker groups them by class name
            kv_out.kv_connector_stats = MultiKVConnectorStats(
                data={"UMBPConnector": kv_out.kv_connector_stats}
            )
        kv_out.finished_sending = set(self.pulled)  # every worker reports them: the aggregate holds them
        self.pulled = set()
        for outputs in self.sched.update_from_output(so, out).values():
            for o in outputs.outputs:
                if o.finished:
                    self.params[o.request_id] = o.kv_transfer_params
            if outputs.scheduler_stats is not None and outputs.scheduler_stats.kv_connector_stats:
                self.stats.append(outputs.scheduler_stats.kv_connector_stats)
        return so


def build_multi(tmp_path, umbp_extra: dict | None = None, umbp_role: str = "kv_both") -> MultiHarness:
    model = ModelConfig(
        model=str(fake_model_dir(tmp_path)), skip_tokenizer_init=True, dtype="float32", max_model_len=4096
    )
    sched_cfg = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(
        block_size=400,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        prefix_match_unit=16,
        prefix_cache_retention_interval=0,
    )
    children = [
        {"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
        umbp_transfer(umbp_extra or {"dram_bytes": 64 << 20}, umbp_role),
    ]
    transfer = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={"connectors": children},
    )
    assert transfer.kv_load_failure_policy == "fail"  # vLLM's default, which umbp must not be left under
    vllm_config = VllmConfig(
        model_config=model, cache_config=cache, scheduler_config=sched_cfg, kv_transfer_config=transfer
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size=1, layers=[f"g{g}"], layer_stride=0, block_stride=0)
            for g in range(len(GROUPS))
        ],
        kv_cache_groups=[KVCacheGroupSpec([f"g{g}"], _spec(gd)) for g, gd in enumerate(GROUPS)],
        prefix_cache_retention_interval=0,
    )
    sched, hasher = make_scheduler(vllm_config, kv_cache_config)
    assert isinstance(sched.connector, MultiConnector)
    # umbp's worker is built from the child config MultiConnector itself derives (vLLM's own code)
    ((_, child_config),) = [
        (cls, cfg)
        for cls, cfg in MultiConnector._get_connector_classes_and_configs(vllm_config)
        if cls is UMBPConnector
    ]
    import torch

    with set_current_vllm_config(vllm_config):
        worker = UMBPConnector(child_config, KVConnectorRole.WORKER, kv_cache_config)
        cache_t = {"g0": torch.zeros(NUM_BLOCKS, 400, 2, 2, 8), "g1": torch.zeros(NUM_BLOCKS, 4, 8)}
        worker.register_kv_caches(cache_t)
    h = MultiHarness(
        sched, [worker], [cache_t], kv_cache_config, vllm_config, hasher, GROUPS, KVOutputAggregator(1)
    )
    h.pulled, h.params, h.stats = set(), {}, []
    return h


def test_restore_on_prefill_feeds_the_handoff(tmp_path):
    """Turn 1 computes and hands off; turn 2 (local cache dropped) is restored by umbp at the local-hit
    boundary; the blocks NIXL hands to the decode instance hold exactly what a recompute would; NIXL's
    delayed free and umbp's pins compose (blocks held until pulled, nothing leaks after)."""
    h = build_multi(tmp_path)
    req = h.add("A", PROMPT, max_tokens=1, params=TO_DECODE)
    assert req.num_prompt_tokens == 839  # NIXL on P leaves the last token to D (hybrid models)
    h.run_until_handed_off("A")
    params = h.params["A"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == 839
    assert h.leaks()["gpu_blocks_held"] > 0  # NIXL holds them for D
    h.pulled.add("A")
    h.step()
    assert h.leaks() == {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}
    local = h.local_hit(PROMPT[:839])
    assert local == 832
    assert h.sched.reset_prefix_cache()

    h.add("B", PROMPT, max_tokens=1, params=TO_DECODE)
    h.admit("B")
    assert h.umbp.restored["B"] == 832
    assert h.held_values("B", 832) == []
    h.run_until_handed_off("B")
    params = h.params["B"]
    assert params["remote_num_tokens"] == 839
    # what D will read: B's blocks (kept for NIXL), holding all 839 prompt positions and the state at 839
    # exactly as a recompute would have written them
    assert "B" in h.sched.requests
    assert params["remote_block_ids"][0] == h.sched.kv_cache_manager.get_block_ids("B")[0]
    assert h.held_values("B", 839) == []
    h.pulled.add("B")
    h.step()
    assert h.leaks() == {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}
    assert h.umbp.totals["restored_tokens"] == 832


def test_failed_umbp_load_is_a_recompute_under_the_outer_policy(tmp_path):
    """vLLM reads the failure policy from the MultiConnector's config; umbp sets it there. Under vLLM's
    default ("fail") a corrupt page would fail the request instead of recomputing it."""
    h = build_multi(tmp_path)
    assert h.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert h.sched.recompute_kv_load_failures
    h.add("A", PROMPT, max_tokens=1)
    h.run()
    assert h.sched.reset_prefix_cache()
    h.fail_next_load = True  # flip bytes in the arena slot right before the load reads it
    req = h.add("B", PROMPT, max_tokens=2)
    h.run()
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.umbp.totals["load_failures"] == 1


def test_fail_policy_is_kept_when_asked(tmp_path):
    h = build_multi(tmp_path, {"dram_bytes": 64 << 20, "load_failure_policy": "fail"})
    assert h.vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"


def test_umbp_stats_reach_vllms_logger_through_multiconnector(tmp_path):
    """vLLM serializes MultiConnector stats as {class name: dict} and rebuilds them by registered name."""
    h = build_multi(tmp_path)
    h.add("A", PROMPT, max_tokens=1)
    h.run()
    assert h.sched.reset_prefix_cache()
    h.add("B", PROMPT, max_tokens=1)
    h.run()
    logging_ = KVConnectorLogging(h.vllm_config.kv_transfer_config)
    for payload in h.stats:
        logging_.observe(payload)
    reduced = logging_.transfer_stats_accumulator.reduce()
    assert reduced["UMBPConnector"]["restored_tokens"] == 832
    assert reduced["UMBPConnector"]["stored_objects"] > 0


def test_inside_a_multi_connector_umbp_leaves_the_start_up_handshake_to_the_p_d_connector(tmp_path):
    """vLLM carries one child's handshake metadata per worker (the first that is not None) and NIXL's
    scheduler refuses any other kind, so umbp's pipeline-stage report must not take that slot there."""
    h = build_multi(tmp_path)
    ((child,),) = [[c for c in h.sched.connector._connectors if isinstance(c, UMBPConnector)]]
    assert child._nested
    plain = build(tmp_path / "plain", GROUPS, unit=16)
    assert not plain.sched.connector._nested


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_store_mediated_roles_are_refused_inside_a_multi_connector(tmp_path, role):
    """Beside a P/D connector both would answer a P/D request's kv_transfer_params, and MultiConnector
    raises on that clash in the middle of the engine's step: refused at start-up, naming kv_role."""
    with pytest.raises(ConfigError, match=f"kv_role '{role}' inside a MultiConnector"):
        build_multi(tmp_path, {"dram_bytes": 64 << 20, "remote": "redis://127.0.0.1:1/0"}, umbp_role=role)
