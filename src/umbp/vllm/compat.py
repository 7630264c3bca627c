"""Differences between the vLLM releases umbp supports (0.32, 0.33, 0.34), found by feature detection.

Every place in umbp (and its test harnesses, replay and bench tools) that touches an API which changed
between these releases goes through this module, so supporting another release means changing one file.
Nothing here compares version strings: a vendor build or a backport carries the feature, not the number.

What differs, and what umbp does about it:

* ``ModelRunnerOutput.req_id_to_index`` (0.32, 0.33) is gone in 0.34: :func:`runner_output`.
* ``BlockHashToBlockMap`` holds blocks (0.32, 0.33) or block ids into the pool's block list (0.34), and
  takes that list in its constructor: :func:`block_hash_map`.
* ``KVCacheSpec.is_draft`` (0.33+) is excluded from equality, so vLLM merges a draft model's layers with the
  target's when their geometry matches; it shows up in ``repr(spec)`` though: :func:`group_tag`.
* Lookahead block hashes (0.33 without a connector, 0.34 with a connector that opts in): each block hash
  also covers the tokens EAGLE's drafter reads past the block, and the EAGLE last-block drop is off:
  :func:`hash_lookahead_tokens`, :func:`eagle_block_drop`, :func:`request_block_hasher`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any


def _params(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


# ---------------------------------------------------------------- model runner output
def runner_output(req_ids: Sequence[str], sampled_token_ids: list[list[int]], kv_connector_output=None):
    """A ``ModelRunnerOutput`` for a simulated step (harnesses, replay, bench): ``req_id_to_index`` is
    filled only where the dataclass still has that field."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(req_ids)
    kwargs: dict[str, Any] = {
        "req_ids": ids,
        "sampled_token_ids": sampled_token_ids,
        "kv_connector_output": kv_connector_output,
    }
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        kwargs["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(**kwargs)


# ---------------------------------------------------------------- prefix-cache map
def block_map_takes_blocks() -> bool:
    """True where ``BlockHashToBlockMap`` stores block ids and resolves them through the pool's blocks."""
    from vllm.v1.core.block_pool import BlockHashToBlockMap

    return "blocks" in _params(BlockHashToBlockMap.__init__)


def block_hash_map(cls=None, blocks=None):
    """A new, empty ``BlockHashToBlockMap`` (or subclass ``cls``). ``blocks``: what block ids index where
    the map stores ids (the pool's ``blocks`` list, or any mapping from id to block); ignored where the
    map stores the blocks themselves."""
    from vllm.v1.core.block_pool import BlockHashToBlockMap

    cls = cls or BlockHashToBlockMap
    if block_map_takes_blocks():
        if blocks is None:
            raise ValueError("this vLLM's BlockHashToBlockMap needs the block list its ids index")
        return cls(blocks)
    return cls()


def block_map_keys(block_map) -> list:
    """Every key the map holds (``_cache`` is the key -> block(s) or key -> id dict in every release)."""
    return list(block_map._cache)


# ---------------------------------------------------------------- group tags
def group_tag(spec) -> str:
    """A text that is equal for two specs iff vLLM treats them as equal (and looks their groups up
    jointly): the spec's repr without the fields vLLM excludes from equality (``is_draft``). Where no
    such field exists the tag is exactly ``repr(spec)``, as umbp always derived it."""
    if not dataclasses.is_dataclass(spec):
        return repr(spec)
    fields = dataclasses.fields(spec)
    if all(f.compare for f in fields):
        return repr(spec)
    shown = ", ".join(f"{f.name}={getattr(spec, f.name)!r}" for f in fields if f.compare and f.repr)
    return f"{type(spec).__name__}({shown})"


# ---------------------------------------------------------------- lookahead block hashes
def hash_lookahead_tokens(vllm_config) -> int:
    """Tokens after each block that its hash also covers (0: the plain hashes, and every release without
    lookahead hashing). vLLM resolves it from the speculative and KV-transfer configs."""
    return int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)


def eagle_block_drop(vllm_config) -> bool:
    """Whether vLLM's scheduler drops EAGLE's last matched block on a prefix hit. Lookahead hashes make
    the drop unnecessary (the hash already names the token the drafter's KV depends on), and vLLM turns
    it off whenever they are on."""
    spec = vllm_config.speculative_config
    if spec is None or not spec.use_eagle_block_drop():
        return False
    return hash_lookahead_tokens(vllm_config) == 0


def request_block_hasher(hash_block_size: int, hash_fn, lookahead_tokens: int = 0):
    """vLLM's per-request block hasher, built the way the engine core builds it."""
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    if "num_hash_lookahead_tokens" in _params(get_request_block_hasher):
        return get_request_block_hasher(hash_block_size, hash_fn, lookahead_tokens)
    if lookahead_tokens:
        raise ValueError("this vLLM has no lookahead block hashes")
    return get_request_block_hasher(hash_block_size, hash_fn)


def coordinator_kwargs(lookahead_tokens: int) -> dict[str, int]:
    """Extra keyword arguments of ``get_kv_cache_coordinator`` for lookahead hashes, where it takes them."""
    from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator

    if "num_hash_lookahead_tokens" in _params(get_kv_cache_coordinator):
        return {"num_hash_lookahead_tokens": lookahead_tokens}
    if lookahead_tokens:
        raise ValueError("this vLLM has no lookahead block hashes")
    return {}


def has_lookahead_hashes() -> bool:
    """Whether this vLLM can hash blocks with lookahead tokens at all."""
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    return "num_hash_lookahead_tokens" in _params(get_request_block_hasher)


def connector_lookahead_opt_in() -> bool:
    """Whether vLLM asks a KV connector if it supports lookahead hashes (0.34: a connector keeps the
    plain hashes unless its class says so; 0.33 turns them off under every connector)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "supports_lookahead_block_hashes")


def speculative_lookahead_kwargs(lookahead: bool) -> dict[str, bool]:
    """``SpeculativeConfig`` keyword arguments that turn lookahead hashes off (``lookahead=False``) where
    vLLM has the switch; empty otherwise (no switch: no lookahead hashes to turn off)."""
    from vllm.config import SpeculativeConfig

    names = (
        {f.name for f in dataclasses.fields(SpeculativeConfig)}
        if dataclasses.is_dataclass(SpeculativeConfig)
        else set(getattr(SpeculativeConfig, "model_fields", {}))
    )
    if lookahead or "disable_lookahead_block_hashes" not in names:
        return {}
    return {"disable_lookahead_block_hashes": True}
