"""Pipeline parallelism's limits, as the start-up warning states them (kv_layout.pipeline_limits). vLLM
hands the scheduler stage 0's KV-cache config (`generate_scheduler_kv_cache_config`) and each stage its
own layers, so:

* a stage holding more layers of a group than stage 0 has objects larger than the slots the scheduler
  reserves: its worker refuses those saves (a counted failure, the job unconfirmed) and writes nothing;
* each stage names its objects under a namespace of its own layer names.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from sched_harness import GroupDef, build  # noqa: E402
from test_padded_pages import ATTN, BLOCK, NB, PAGE, worker  # noqa: E402  the same attention spec
from vllm.v1.attention.backends.utils import KVCacheLayout  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from umbp.identity import ParallelSizes, RankCoord  # noqa: E402
from umbp.vllm.kv_layout import describe, pipeline_limits  # noqa: E402
from umbp.vllm.metadata import PageMove, SaveJob, UMBPConnectorMetadata  # noqa: E402


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


def test_each_stage_names_its_own_namespace(tmp_path):
    h = build(tmp_path, [GroupDef("fa", BLOCK)], unit=BLOCK)
    first = describe(h.vllm_config, stage_config(["model.layers.0.self_attn.attn"]))
    second = describe(h.vllm_config, stage_config(["model.layers.1.self_attn.attn"]))
    assert first.object_bytes == second.object_bytes == (PAGE,)
    assert first.namespace != second.namespace


def test_a_stage_with_more_layers_than_the_slot_refuses_its_saves(caplog):
    config = stage_config(["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"])
    kv = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    for t in kv.values():
        t.fill_(1.0)
    w = worker(config, kv, rank=RankCoord(pp=1))  # its layout is its own: two layers' pages
    try:
        w.arena.view(0, 3 * PAGE)[:] = 0xAB
        # the scheduler (stage 0: one layer) reserved one page for the object; the next page is another
        # object's slot, which two layers' bytes would overwrite
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


def test_the_warning_is_for_pipeline_parallel_only():
    assert pipeline_limits(ParallelSizes(tp=8, dcp=8)) is None
    text = pipeline_limits(ParallelSizes(tp=2, pp=2))
    assert text is not None and "pipeline_parallel_size=2" in text and "namespace" in text
