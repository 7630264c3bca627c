"""KV-cache specs whose page at a prefix boundary is not the prefix's alone stop start-up with one clear
error (umbp.vllm.kv_layout.check_restorable): restoring them could hand a request another prompt's KV."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

import torch  # noqa: E402
from sched_harness import GroupDef, build  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from umbp.vllm.kv_layout import UnsupportedLayout, describe, umbp_group  # noqa: E402


def attention(**kw) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32, **kw)


def one_group(spec) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[KVCacheTensor(size=1, layers=["a"], layer_stride=0, block_stride=0)],
        kv_cache_groups=[KVCacheGroupSpec(["a"], spec)],
    )


def test_a_prefix_lm_layer_is_refused(tmp_path):
    """vLLM turns prefix caching off for a non-causal model but still hashes blocks for a connector."""
    h = build(tmp_path, [GroupDef("fa", 16)], unit=16)
    with pytest.raises(UnsupportedLayout, match="non-causally"):
        describe(h.vllm_config, one_group(attention(non_causal=True)))


def test_compressed_or_pooled_states_are_refused():
    with pytest.raises(UnsupportedLayout, match="one state per 4 tokens"):
        umbp_group(attention(tokens_per_state=4))


def test_an_ordinary_attention_page_is_accepted():
    assert type(umbp_group(attention())).__name__ == "FullAttention"
    assert type(umbp_group(attention(sliding_window=64))).__name__ == "FullAttention"  # all blocks kept


def test_the_kv_quantization_mode_is_part_of_the_namespace(tmp_path):
    """Two modes may share a dtype and page size yet mean other values by the same bytes."""
    from vllm.v1.kv_cache_interface import KVQuantMode

    h = build(tmp_path, [GroupDef("fa", 16)], unit=16)

    def namespace(**kw) -> str:
        return describe(h.vllm_config, one_group(attention(**kw))).namespace

    plain = namespace()
    assert namespace(kv_quant_mode=KVQuantMode.NONE) == plain  # unquantized deployments keep theirs
    modes = {namespace(kv_quant_mode=m) for m in (KVQuantMode.NVFP4, KVQuantMode.ULTRAQUANT_4BIT)}
    assert len(modes) == 2 and plain not in modes
