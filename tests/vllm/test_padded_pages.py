"""State pages padded by vLLM's hybrid allocator: umbp stores and restores their content, never the padding.

vLLM pads every Mamba/GDN/short-conv state page to the attention page size so all groups share one block
pool. umbp sizes objects by vLLM's ``real_page_size_bytes``, reads the worker's pages through vLLM's own
allocation (``allocate_kv_cache``: a ``[B, 1, 1, C]`` view whose block stride is the padded page) or a raw
padded buffer or a list of state tensors, and writes a restore into the states only: every padding byte
and every other block keeps its value. A padded group's namespace names the stored (unpadded) size, so
objects an earlier version sized by the padded page are a clean miss.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from sched_harness import GroupDef, build  # noqa: E402
from vllm.v1.attention.backends.utils import KVCacheLayout  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from umbp.identity import RankCoord  # noqa: E402
from umbp.vllm.config import UMBPConfig  # noqa: E402
from umbp.vllm.kv_layout import Layout, describe, slot_span, stored_page_bytes  # noqa: E402
from umbp.vllm.metadata import LoadJob, PageMove, SaveJob, UMBPConnectorMetadata  # noqa: E402
from umbp.vllm.pages import group_pages  # noqa: E402
from umbp.vllm.worker import WorkerSide  # noqa: E402

NB, BLOCK = 8, 16
ATTN = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
PAGE = ATTN.page_size_bytes  # 4096: the size vLLM pads the state page to
STATES = ((3, 10), (2, 4, 8))  # a conv state and an SSM state, float32: 120 + 256 bytes
MAMBA = MambaSpec(
    block_size=BLOCK,
    shapes=STATES,
    dtypes=(torch.float32, torch.float32),
    page_size_padded=PAGE,
    mamba_cache_mode="align",
)
CONTENT = 376


def hybrid_config(mamba: MambaSpec = MAMBA) -> KVCacheConfig:
    """One Mamba layer and one attention layer overlaying the same backing bytes, as vLLM lays a hybrid."""
    return KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[
            KVCacheTensor(size=NB * PAGE, layers=["mamba"], layer_stride=NB * PAGE, block_stride=PAGE),
            KVCacheTensor(size=NB * PAGE, layers=["attn"], layer_stride=NB * PAGE, block_stride=PAGE),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["mamba"], mamba), KVCacheGroupSpec(["attn"], ATTN)],
    )


def test_spec_sizes():
    assert MAMBA.page_size_bytes == PAGE and stored_page_bytes(MAMBA) == CONTENT
    assert stored_page_bytes(ATTN) == PAGE


def worker(config: KVCacheConfig, kv_caches: dict, rank: RankCoord | None = None) -> WorkerSide:
    """A registered worker whose layout is its own config's, as each rank builds it."""
    rank = rank or RankCoord()
    layout = Layout(
        groups=(),
        unit=BLOCK,
        eagle_groups=frozenset(),
        identity=None,
        namespace="ab" * 16,
        ranks=(rank,),
        object_bytes=tuple(
            stored_page_bytes(g.kv_cache_spec) * len(g.layer_names) for g in config.kv_cache_groups
        ),
    )
    w = WorkerSide(UMBPConfig(dram_bytes=64 * 4096), layout, config, rank=rank)
    w.register(kv_caches)
    return w


def test_round_trip_through_vllms_own_views_leaves_the_padding_alone():
    config = hybrid_config()
    kv = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    raw = torch.empty(0, dtype=torch.uint8).set_(kv["mamba"].untyped_storage()).view(NB, PAGE)
    gen = torch.Generator().manual_seed(7)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    w = worker(config, kv)
    try:
        assert w.groups[0].object_bytes == CONTENT  # the state bytes, not the padded page
        saved = raw.clone()
        hashes = [b"\x01" * 8, b"\x02" * 8]
        offsets = [0, slot_span(CONTENT)]
        moves = [PageMove(b, off, CONTENT, h) for b, off, h in zip((1, 2), offsets, hashes)]
        w.save(UMBPConnectorMetadata(saves=[SaveJob(1, 0, moves)]))
        meta = w.take_worker_meta()
        assert meta is not None and 1 in meta.saved
        for b, off in zip((1, 2), offsets):
            assert bytes(w.arena.view(off, CONTENT)) == bytes(saved[b, :CONTENT].numpy())

        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))  # poison all
        before = raw.clone()
        load = {0: [PageMove(5, off, CONTENT, h) for off, h in zip(offsets[:1], hashes[:1])]}
        load[0].append(PageMove(6, offsets[1], CONTENT, hashes[1]))
        w.load(UMBPConnectorMetadata(loads=[LoadJob("r", load)]))
        w.poll_loads(wait=True)
        finished, failed = w.take_transfer_results()
        assert finished == {"r"} and not failed
        expected = before.clone()
        expected[5, :CONTENT] = saved[1, :CONTENT]
        expected[6, :CONTENT] = saved[2, :CONTENT]
        # the states of blocks 5 and 6 are restored; their padding and every other byte are untouched
        assert torch.equal(raw, expected)
    finally:
        w.close()


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32])
def test_raw_padded_page_is_narrowed_to_its_states(dtype):
    raw = torch.randint(-128, 127, (NB, PAGE), dtype=torch.int8)
    typed = raw.view(dtype)  # a raw page handed over as int8 bytes, or typed
    pages = group_pages({"mamba": typed.view(-1)}, ["mamba"], NB, CONTENT)
    assert pages.object_bytes == CONTENT
    (layer,) = pages.layers
    assert torch.equal(layer.tensor, raw.view(torch.uint8)[:, :CONTENT])
    before = raw.clone()
    data = torch.randint(0, 256, (2, CONTENT), dtype=torch.uint8)
    pages.scatter([3, 4], data)
    before.view(torch.uint8)[3, :CONTENT] = data[0]
    before.view(torch.uint8)[4, :CONTENT] = data[1]
    assert torch.equal(raw, before)  # the padding of blocks 3 and 4 is untouched


def test_list_of_state_tensors_is_one_object_of_the_packed_states():
    conv = torch.randn(NB, *STATES[0])
    ssm = torch.randn(NB, *STATES[1])
    pages = group_pages({"mamba": [conv, ssm]}, ["mamba"], NB, CONTENT)
    assert pages.object_bytes == CONTENT
    assert [layer.page_bytes for layer in pages.layers] == [120, 256]
    assert [layer.name for layer in pages.layers] == ["mamba[0]", "mamba[1]"]


def test_pages_that_disagree_with_the_spec_are_refused():
    with pytest.raises(ValueError, match="spec says its page holds"):
        group_pages({"mamba": torch.zeros(NB, 3, 10)}, ["mamba"], NB, CONTENT)
    padded_not_contiguous = torch.zeros(NB, 2, PAGE // 8, dtype=torch.float32).transpose(1, 2)
    with pytest.raises(ValueError, match="not contiguous"):
        group_pages({"mamba": padded_not_contiguous}, ["mamba"], NB, CONTENT)


def test_padded_groups_get_a_namespace_of_their_own(tmp_path):
    """Earlier versions named a padded group by its padded page (and reserved that much per object): under
    the stored size the namespace differs, so such objects are never read with a size they do not have.
    An unpadded layout keeps its namespace (its stored objects stay valid)."""
    h = build(tmp_path, [GroupDef("mamba", BLOCK), GroupDef("fa", BLOCK)], unit=BLOCK)
    padded = describe(h.vllm_config, hybrid_config())
    assert padded.object_bytes == (CONTENT, PAGE)

    def earlier(layout):  # the identity as earlier versions built it: every page by page_size_bytes
        groups = tuple(
            dataclasses.replace(g, page_shapes=((spec.page_size_bytes,),))
            for g, spec in zip(layout.identity.groups, (MAMBA, ATTN))
        )
        return dataclasses.replace(layout.identity, groups=groups).namespace()

    assert padded.namespace != earlier(padded)
    plain_mamba = dataclasses.replace(MAMBA, page_size_padded=None)
    plain = describe(h.vllm_config, hybrid_config(plain_mamba))
    assert plain.object_bytes == (CONTENT, PAGE)
    groups = tuple(
        dataclasses.replace(g, page_shapes=((spec.page_size_bytes,),))
        for g, spec in zip(plain.identity.groups, (plain_mamba, ATTN))
    )
    assert dataclasses.replace(plain.identity, groups=groups).namespace() == plain.namespace
