"""Pipeline parallelism on vLLM 0.32's real Scheduler (CPU, no model): vLLM hands the scheduler stage 0's
KV-cache config (`generate_scheduler_kv_cache_config`) and each stage its own layers, and a stage may hold
more layers of a group than stage 0, fewer, or none. Each worker reports its namespace and object sizes
(umbp.vllm.stages); from then on every stage's pages are restored at the local-hit boundary, byte for byte
and layer for layer, from DRAM, from the SSD tier after a restart and from the shared tier.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # redis_servers
from sched_harness import GroupDef, build  # noqa: E402
from test_connector_scheduler import FA_MAMBA_400, PROMPT, compute_then_drop, restore  # noqa: E402
from test_padded_pages import ATTN, NB, PAGE, worker  # noqa: E402  the same attention spec
from vllm.v1.attention.backends.utils import KVCacheLayout  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from redis_servers import require_redis, start_server  # noqa: E402
from umbp.identity import RankCoord  # noqa: E402
from umbp.vllm.metadata import PageMove, SaveJob, UMBPConnectorMetadata  # noqa: E402

NO_LEAKS = {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}
# layers of (attention, Mamba) per stage
STAGES = {
    "more-on-stage-1": [[1, 1], [2, 1]],  # stage 1's objects outgrow the slots stage 0's config implies
    "no-state-on-stage-1": [[1, 1], [3, 0]],  # stage 1 holds no Mamba layer: never asked for that group
    "no-attention-on-stage-0": [[0, 2], [2, 1]],  # the scheduler's own config has no attention layer
}


def make(tmp_path, stages, **kw):
    h = build(tmp_path, FA_MAMBA_400, unit=16, stage_layers=stages, **kw)
    warm_up(h)
    return h


def warm_up(h) -> None:
    """One short request: the workers report their layouts with its first step's output. Until then the
    scheduler offered nothing and saved nothing."""
    assert not h.umbp.stages.ready
    h.add("warm-up", [1, 2, 3, 4, 5], max_tokens=1)
    h.run()
    assert h.umbp.stages.ready
    assert h.umbp.totals["lookups_layout_pending"] >= 1


def handshake(h) -> None:
    """What vLLM's EngineCore does at start-up: every worker's handshake metadata, keyed (pp, tp), handed to
    the scheduler-side connector."""
    content = {}
    for w in h.workers:
        meta = w.get_handshake_metadata()
        if meta is not None:
            content[(w._worker.rank.pp, w._worker.rank.tp)] = meta
    h.sched.connector.set_xfer_handshake_metadata_pp_aware(content)


def shut(h) -> None:
    for w in h.workers:
        w.shutdown()


@pytest.mark.parametrize("name", sorted(STAGES))
@pytest.mark.parametrize("tp", [1, 2])
def test_restore_at_the_boundary_on_every_stage(tmp_path, name, tp):
    h = make(tmp_path, STAGES[name], tp=tp)
    assert compute_then_drop(h, "A", PROMPT) == 832  # vLLM's own local hit
    assert {w._worker.rank.pp for w in h.workers} == {0, 1}
    assert restore(h, "B", PROMPT) == (832, [])  # every rank, every layer, byte for byte
    assert h.leaks() == NO_LEAKS
    assert not h.umbp.totals["save_failures"]
    # DRAM slots fit the largest stage's objects; the data counter adds up each rank's own bytes
    attn, state = (w._worker.reported_layout()[1] for w in (h.workers[0], h.workers[-1]))
    assert h.umbp.slot_bytes == tuple(map(max, attn, state))
    per_object = [sum(w._worker.reported_layout()[1][g] for w in h.workers) for g in range(2)]
    assert h.umbp.data_bytes == tuple(per_object)


def test_decode_context_parallel_ranks_on_every_stage(tmp_path):
    """TP2/DCP2 on each of two stages: four ranks, each with its own DCP shard and its stage's layers."""
    h = build(
        tmp_path,
        [GroupDef("fa", 32), GroupDef("mamba", 64)],
        unit=16,
        tp=2,
        dcp=2,
        stage_layers=[[1, 1], [2, 1]],
    )
    warm_up(h)
    prompt = PROMPT[:300]
    b = 299 // 16 * 16
    assert compute_then_drop(h, "A", prompt) == b
    assert {(w._worker.rank.dcp, w._worker.rank.pp) for w in h.workers} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert restore(h, "B", prompt) == (b, [])
    assert h.leaks() == NO_LEAKS


def test_eagle_keying_on_every_stage(tmp_path):
    h = make(tmp_path, STAGES["more-on-stage-1"], eagle=True)
    local = compute_then_drop(h, "A", PROMPT)
    assert local > 0
    assert restore(h, "B", PROMPT) == (local, [])
    assert h.leaks() == NO_LEAKS


def test_the_start_up_handshake_makes_the_first_request_cached(tmp_path):
    h = build(tmp_path, FA_MAMBA_400, unit=16, tp=2, stage_layers=STAGES["more-on-stage-1"])
    assert not h.umbp.stages.ready
    handshake(h)
    assert h.umbp.stages.ready
    assert compute_then_drop(h, "A", PROMPT) == 832  # the very first request, saved
    assert restore(h, "B", PROMPT) == (832, [])
    assert not h.umbp.totals["lookups_layout_pending"] and not h.umbp.totals["saves_dropped_layout_pending"]
    assert all(w._worker.layout_known for w in h.workers)  # told so by the first step's metadata
    assert all(w.get_handshake_metadata() is None for w in h.workers)


def test_a_p_d_connectors_handshake_from_a_later_stage_is_ignored(tmp_path):
    """Beside NIXL in a MultiConnector, umbp is handed NIXL's metadata, from every stage: vLLM's base class
    would refuse stages past the first and stop start-up; umbp takes nothing from it."""
    h = build(tmp_path, FA_MAMBA_400, unit=16, stage_layers=STAGES["more-on-stage-1"])
    h.sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): object(), (1, 0): object()})
    assert not h.umbp.stages.ready and h.umbp.stages.refused is None
    warm_up(h)  # the step output still carries the layouts


def test_the_first_steps_before_the_reports_neither_restore_nor_save(tmp_path):
    h = build(tmp_path, FA_MAMBA_400, unit=16, stage_layers=STAGES["more-on-stage-1"])
    h.add("A", PROMPT, max_tokens=3)  # its first step is planned before any worker reported
    h.run()
    assert h.umbp.stages.ready
    assert h.umbp.totals["lookups_layout_pending"] == 1
    assert h.umbp.totals["saves_dropped_layout_pending"] > 0 and not h.umbp.totals["save_failures"]
    assert h.sched.reset_prefix_cache()
    hit, mism = restore(h, "B", PROMPT)  # what A saved after the reports is correct, on every stage
    assert mism == [] and hit < 832
    assert h.leaks() == NO_LEAKS


def test_ssd_restores_every_stage_after_a_restart(tmp_path):
    extra = {"dram_bytes": 64 << 20, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_gb": 0.25}
    h1 = make(tmp_path, STAGES["more-on-stage-1"], extra=extra)
    assert compute_then_drop(h1, "A", PROMPT) == 832
    shut(h1)
    h2 = build(tmp_path, FA_MAMBA_400, unit=16, stage_layers=STAGES["more-on-stage-1"], extra=extra)
    assert not h2.umbp.ssd_keys  # the SSD tier is scanned under each stage's namespace, once known
    warm_up(h2)
    assert h2.umbp.ssd_keys
    assert restore(h2, "B", PROMPT) == (832, [])
    assert all(w._worker.totals["ssd_loaded_bytes"] > 0 for w in h2.workers)
    shut(h2)


def test_a_new_layer_split_is_a_miss_not_another_stages_bytes(tmp_path):
    """Same model, same stage 0, but stage 1 holds other layers: its SSD records from the earlier split
    are under another namespace, so nothing is offered from them."""
    extra = {"dram_bytes": 64 << 20, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_gb": 0.25}
    h1 = make(tmp_path, [[1, 1], [2, 1]], extra=extra)
    assert compute_then_drop(h1, "A", PROMPT) == 832
    shut(h1)
    h2 = make(tmp_path, [[1, 1], [1, 2]], extra=extra)
    assert h2.umbp.ssd_keys == set()
    assert restore(h2, "B", PROMPT) == (0, [])
    shut(h2)


def test_shared_tier_restores_every_stage_on_another_instance(tmp_path):
    require_redis()
    server = start_server(tmp_path / "redis")
    try:
        extra = {"dram_bytes": 64 << 20, "remote": {"url": server.url, "timeout_s": 0.5}}
        h1 = make(tmp_path, STAGES["no-state-on-stage-1"], extra=extra)
        assert compute_then_drop(h1, "A", PROMPT) == 832
        shut(h1)
        h2 = make(tmp_path, STAGES["no-state-on-stage-1"], extra=extra)
        assert restore(h2, "B", PROMPT) == (832, [])
        assert h2.umbp.totals["remote_loaded_objects"] > 0
        shut(h2)
    finally:
        server.stop()


def test_a_corrupt_object_on_a_later_stage_quarantines_that_object_only(tmp_path):
    """The last worker (stage 1) finds one slot corrupt and names its object under stage 1's namespace;
    the scheduler maps the name to its own and drops that object alone."""
    h = make(tmp_path, STAGES["more-on-stage-1"])
    assert compute_then_drop(h, "A", PROMPT) == 832
    h.fail_next_load = True
    h.add("B", PROMPT, max_tokens=4)
    h.admit("B")  # the load fails; B's recompute would save the object again, so look before it runs
    assert "B" not in h.umbp.restored and h.umbp.totals["load_failures"] == 1
    assert len(h.umbp.quarantine) == 1
    (key,) = h.umbp.quarantine
    assert key.startswith(f"umbp:v1:{h.umbp.layout.namespace}:")
    h.run()
    assert h.leaks() == NO_LEAKS


def stage_config(layers: list[str]) -> KVCacheConfig:
    """One attention group whose layers are this stage's."""
    return KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[
            KVCacheTensor(size=NB * PAGE, layers=[name], layer_stride=NB * PAGE, block_stride=PAGE)
            for name in layers
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, ATTN)],
    )


def test_a_slot_smaller_than_the_object_is_refused(caplog):
    """The worker's own guard: a save into a slot smaller than its object (which the scheduler never
    reserves once it knows every stage) is refused, counted and logged once, and writes nothing."""
    config = stage_config(["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"])
    kv = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    for t in kv.values():
        t.fill_(1.0)
    w = worker(config, kv, rank=RankCoord(pp=1))  # its layout is its own: two layers' pages
    try:
        w.arena.view(0, 3 * PAGE)[:] = 0xAB
        with caplog.at_level(logging.WARNING, logger="umbp"):
            for job in (7, 8):
                w.save(UMBPConnectorMetadata(saves=[SaveJob(job, 0, [PageMove(1, 0, PAGE, b"\x01" * 8)])]))
        meta = w.take_worker_meta()
        assert meta is not None and {7, 8} <= set(meta.failed) and not meta.saved
        assert w.totals["save_failures"] == 2
        warned = [r for r in caplog.records if "reserved" in r.getMessage()]
        assert len(warned) == 1 and warned[0].exc_info is None  # one line, not a traceback per save
        assert bytes(w.arena.view(0, 3 * PAGE)) == b"\xab" * (3 * PAGE)  # nothing written
    finally:
        w.close()
