"""KV-cache layouts like the ones vLLM hands a connector, built with torch alone (tests and benches).

* `attention(...)`: one tensor per layer, either FlashAttention's GPU layout [2, blocks, block_size, H, D]
  (block dim 1: each page is a K half and a V half, far apart) or blocks-first [blocks, 2, block_size, H, D].
* `kernel_split(...)`: [2, blocks * k, block_size / k, H, D] as vLLM allocates it when the attention
  kernel's block is k times smaller than the scheduler's; viewed as umbp does (block dim unflattened).
* `hybrid(...)`: vLLM's hybrid allocator: per layer slot one shared int8 buffer [blocks, page_bytes];
  the attention layer of a slot views it as [blocks, 2, block_size, H, D], each Mamba layer as a raw int8
  page of its real state size, padded to the attention page size (the pad is not part of the object).

`GRANITE_4_0_H_350M` is the public Granite-4.0-H-350M config (the fields that size the caches), and
`granite_hybrid()` builds its vLLM-style layout: 4 attention layers, 28 Mamba2 layers in 7 groups of 4,
block_size 400 (vLLM's rule: the attention page must hold the Mamba page; 16-token alignment).
"""

from __future__ import annotations

import math
from typing import Any

import torch

Groups = dict[int, list[tuple[torch.Tensor, int]]]

GRANITE_4_0_H_350M: dict[str, Any] = dict(
    vocab_size=100352,
    hidden_size=768,
    num_hidden_layers=32,
    layer_types=["attention" if i in (10, 13, 17, 27) else "mamba" for i in range(32)],
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2048,
    shared_intermediate_size=2048,
    num_local_experts=0,
    num_experts_per_tok=0,
    mamba_n_heads=48,
    mamba_d_head=32,
    mamba_d_state=128,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=256,
    position_embedding_type="nope",
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    embedding_multiplier=12.0,
    attention_multiplier=0.015625,
    residual_multiplier=0.246,
    logits_scaling=3.0,
)


def _fill(t: torch.Tensor) -> torch.Tensor:
    """Random bytes from torch's RNG on the tensor's device (never zeros: they hide unwritten outputs)."""
    u8 = t.view(torch.uint8)
    u8.random_(0, 256)
    return t


def attention(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    kv_first: bool = True,
) -> list[tuple[torch.Tensor, int]]:
    shape = (
        (2, num_blocks, block_size, heads, head_dim)
        if kv_first
        else (num_blocks, 2, block_size, heads, head_dim)
    )
    return [
        (_fill(torch.empty(shape, dtype=dtype, device=device)), 1 if kv_first else 0)
        for _ in range(num_layers)
    ]


def kernel_split(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    k: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
) -> list[tuple[torch.Tensor, int]]:
    out = []
    for _ in range(num_layers):
        t = _fill(
            torch.empty((2, num_blocks * k, block_size // k, heads, head_dim), dtype=dtype, device=device)
        )
        out.append((t.unflatten(1, (num_blocks, k)), 1))
    return out


def hybrid(
    num_slots: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    state_bytes: list[int],
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> tuple[Groups, list[torch.Tensor]]:
    """Group 0: the attention layer of every slot; group 1 + j: state layer j of every slot (a raw int8
    view of state_bytes[j] bytes at the start of each padded page). Returns (groups, backing buffers)."""
    page = 2 * block_size * heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    if max(state_bytes, default=0) > page:
        raise ValueError(
            f"state page of {max(state_bytes)} bytes does not fit the {page}-byte attention page"
        )
    raws = [_fill(torch.empty((num_blocks, page), dtype=torch.int8, device=device)) for _ in range(num_slots)]
    groups: Groups = {0: [(r.view(dtype).view(num_blocks, 2, block_size, heads, head_dim), 0) for r in raws]}
    for j, nbytes in enumerate(state_bytes):
        groups[1 + j] = [(r[:, :nbytes], 0) for r in raws]
    return groups, raws


def granite_sizes(cfg: dict[str, Any] = GRANITE_4_0_H_350M, dtype_bytes: int = 2) -> dict[str, int]:
    """Per-layer cache sizes of a GraniteMoeHybrid config as vLLM sizes them (TP=1, bf16 states)."""
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    attn_token = 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    inner = cfg["mamba_expand"] * cfg["hidden_size"]
    conv_dim = inner + 2 * cfg["mamba_n_groups"] * cfg["mamba_d_state"]
    conv = conv_dim * (cfg["mamba_d_conv"] - 1) * dtype_bytes
    ssm = cfg["mamba_n_heads"] * cfg["mamba_d_head"] * cfg["mamba_d_state"] * dtype_bytes
    block_size = 16 * math.ceil((conv + ssm) / (16 * attn_token))
    n_attn = sum(t == "attention" for t in cfg["layer_types"])
    return dict(
        head_dim=head_dim,
        kv_heads=cfg["num_key_value_heads"],
        attn_token_bytes=attn_token,
        state_bytes=conv + ssm,
        block_size=block_size,
        page_bytes=block_size * attn_token,
        attention_layers=n_attn,
        mamba_layers=len(cfg["layer_types"]) - n_attn,
    )


def granite_hybrid(
    num_blocks: int, device: str | torch.device = "cpu", cfg: dict[str, Any] = GRANITE_4_0_H_350M
) -> tuple[Groups, dict[str, int]]:
    """The Granite-4.0-H-350M layout: slots = attention layers; mamba layers / slots state groups."""
    s = granite_sizes(cfg)
    slots = s["attention_layers"]
    groups, _ = hybrid(
        slots,
        num_blocks,
        s["block_size"],
        s["kv_heads"],
        s["head_dim"],
        [s["state_bytes"]] * (s["mamba_layers"] // slots),
        device=device,
    )
    return groups, s
