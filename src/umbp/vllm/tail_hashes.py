"""Prefix hashes of key ends that vLLM does not hash: a prompt tail inside a block (umbp.hybrid.tail).

vLLM hashes a request once per ``hash_block_size`` (the lookup ``unit``); for an attention-only model
that is a whole block. A tail page keyed at ``e`` with ``e % unit != 0`` needs a hash of the prefix
``[0, e)``: it chains from vLLM's hash of ``[0, u)`` (``u`` = ``e`` rounded down to the unit), like vLLM's
own chain, and covers the tokens ``[u, e)`` with the same extra keys vLLM would fold in for them (LoRA,
multimodal inputs, prompt embeddings), so two prompts whose tails differ only in an image never share a
key. A domain tag keeps these hashes apart from vLLM's.
"""

from __future__ import annotations

import hashlib

import numpy as np
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

TAIL_DOMAIN = b"umbp:prompt-tail:v1\x00"


def tail_prefix_hash(request, unit: int, end: int) -> bytes:
    """The key hash of the prefix ``[0, end)`` of ``request`` for an ``end`` inside a hash unit."""
    start = end // unit * unit
    if end == start or end > request.num_tokens:
        raise ValueError(f"umbp: no tail hash for end {end} (unit {unit}, {request.num_tokens} tokens)")
    parent = bytes(request.block_hashes[start // unit - 1]) if start else b""
    tokens = np.asarray(request.all_token_ids[start:end], dtype="<i8").tobytes()
    extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
    digest = hashlib.sha256(TAIL_DOMAIN)
    for part in (parent, tokens, repr(extra).encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()
