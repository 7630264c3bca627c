"""The oracle: what a local GPU prefix cache of unbounded size would hit.

vLLM registers every prefix-cache entry (full attention blocks, the partial attention tail at a hybrid
boundary, recurrent states it retains) in its ``BlockPool``'s hash map, and forgets them when blocks are
evicted. :class:`EverCachedMap` is that map, recording every key that was ever visible to a lookup;
"unbounded" = nothing is ever evicted. A key inserted and removed within one ``schedule()`` call never was
(vLLM re-keys a Mamba checkpoint block from its block boundary to the prompt-tail boundary inside one
allocation: the first key never named valid state), so keys count once they survive a ``schedule()``
(:meth:`EverCachedMap.end_of_schedule`), or immediately for lookups later in the same call. The oracle for a request is vLLM 0.32's hybrid rule (``umbp.hybrid.longest_hit``, proven
equal to ``HybridKVCacheCoordinator.find_longest_cache_hit``) over the ever-inserted keys, with the same
``max_tokens = prompt - 1`` vLLM uses. Retention still applies: a recurrent state vLLM never kept (e.g.
interior states under ``prefix_cache_retention_interval=0``) is not in the oracle either.
"""

from __future__ import annotations

from vllm.v1.core.block_pool import BlockHashToBlockMap
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from umbp.hybrid import longest_hit
from umbp.vllm.compat import block_hash_map, block_map_keys


class EverCachedMap(BlockHashToBlockMap):
    """vLLM's hash -> block map that also remembers every key a lookup could ever have seen.

    Made by :func:`install`, which adopts the pool's own map's state whatever its representation
    (blocks, or block ids into the pool's block list: vLLM 0.34), or by :meth:`empty`."""

    ever: set[bytes]  # survived a schedule() call
    fresh: set[bytes]  # inserted during the current schedule() call and still present

    @classmethod
    def empty(cls, blocks=None) -> EverCachedMap:
        """An empty recording map; ``blocks``: what block ids index, where vLLM's map stores ids."""
        recording = block_hash_map(cls, blocks)
        recording.ever, recording.fresh = set(), set()
        return recording

    def insert(self, key, block) -> None:
        if key not in self.ever:
            self.fresh.add(key)
        super().insert(key, block)

    def pop(self, key, block_id: int):
        block = super().pop(key, block_id)
        if key in self.fresh and key not in self._cache:
            self.fresh.discard(key)
        return block

    def end_of_schedule(self) -> None:
        self.ever |= self.fresh
        self.fresh.clear()

    def seen(self, key: bytes) -> bool:
        return key in self.ever or key in self.fresh


def install(block_pool) -> EverCachedMap:
    """Swap the pool's map for a recording one holding the same entries (the map's constructor differs
    between vLLM releases; its state is plain attributes in all of them, so they are taken over as is)."""
    current = block_pool.cached_block_hash_to_block
    recording = EverCachedMap.__new__(EverCachedMap)
    recording.__dict__.update(vars(current))
    recording.ever = set(block_map_keys(current))
    recording.fresh = set()
    block_pool.cached_block_hash_to_block = recording
    return recording


def present_sets(seen: EverCachedMap, request, unit: int, num_groups: int) -> list[set[int]]:
    """Per group, the token ends ``t`` whose key vLLM ever cached for this request's prefix [0, t)."""
    hashes = request.block_hashes
    ever, fresh = seen.ever, seen.fresh
    present: list[set[int]] = []
    for g in range(num_groups):
        # vLLM's key is the block hash followed by the group id (make_block_hash_with_group_id)
        suffix = make_block_hash_with_group_id(b"", g)
        keys = [h + suffix for h in hashes]
        present.append({(i + 1) * unit for i, k in enumerate(keys) if k in ever or k in fresh})
    return present


def oracle_hit(seen: EverCachedMap, request, layout) -> int:
    """Tokens an unbounded local GPU prefix cache would hit for ``request`` now (``layout``: umbp's)."""
    groups = list(layout.groups)
    hashed = len(request.block_hashes) * layout.unit
    present = present_sets(seen, request, layout.unit, len(groups))
    hit = longest_hit(
        groups,
        unit=layout.unit,
        present=present,
        max_tokens=request.num_tokens - 1,
        eagle_groups=layout.eagle_groups,
        hashed_tokens=hashed,
        dcp_world_size=layout.dcp,
    )
    return hit.tokens


def local_hit(kv_cache_manager, request) -> int:
    """vLLM's own local hit for ``request`` right now, including a sub-block tail (read-only lookup)."""
    _, tokens, _ = kv_cache_manager.coordinator.find_longest_cache_hit(
        request.block_hashes, request.num_tokens - 1
    )
    return tokens
