"""Cache-group specs of a hybrid model, each with its own prefix-hit rule.

One class per cache type, like vLLM's single-type KV-cache managers: each answers "how far can this group
alone resume, given which of its objects exist?" (:meth:`CacheGroup.longest`). ``umbp.hybrid.lookup``
combines the groups the way vLLM 0.32's ``HybridKVCacheCoordinator`` does.

Vocabulary (see docs/hybrid.md):

* an *object* of a group is the page (or state) saved under the key of a prefix ``[0, t)``; ``t`` is its
  *end*, a multiple of the lookup ``unit`` (vLLM's ``prefix_match_unit`` / ``hash_block_size``);
* ``has(t)`` tells whether the object ending at ``t`` exists;
* a lookup returns, per block slot of the group, the end of the object to load there (``None``: a slot the
  resumed request does not need, vLLM's null block).

Pure Python: no vLLM, numpy or torch here (layer 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

Has = Callable[[int], bool]


@dataclass(frozen=True)
class Space:
    """What every group's lookup shares for one request.

    ``unit``: hash granularity; ``align``: every hit is a multiple of it (``unit`` with partial hits, else
    the scheduler block size, the lcm of all block sizes); ``hashed_tokens``: no key ends past it.
    """

    unit: int
    align: int
    hashed_tokens: int

    @property
    def partial_hits(self) -> bool:
        return self.align == self.unit


@dataclass(frozen=True)
class GroupHit:
    """One group's answer: ``tokens`` it can resume at and the object end per block slot (``None``: null)."""

    tokens: int
    blocks: tuple[int | None, ...]

    @property
    def loads(self) -> tuple[int, ...]:
        return tuple(end for end in self.blocks if end is not None)


@dataclass(frozen=True)
class Need:
    """An object a group needs to resume at some boundary, for explanations."""

    end: int
    what: str


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CacheGroup(ABC):
    """Interface of one cache group. Concrete groups are frozen dataclasses with ``block_size`` and ``kind``.

    ``downward_closed``: a hit at ``t`` implies hits at every aligned ``t' < t`` with a prefix of the same
    objects (append-only attention pages), so the coordinator looks it up once and only trims it.
    ``fine_grained``: the group can resume inside one of its blocks (vLLM's
    ``supports_fine_grained_hash_lookup``); a group without it disables partial hits unless its blocks are
    one unit long.
    """

    block_size: int
    kind: str
    tag: str
    downward_closed: ClassVar[bool] = False
    fine_grained: ClassVar[bool] = True
    dcp_sharded: bool = False  # attention groups override this with a field (default True)

    def span(self, dcp_world_size: int = 1) -> int:
        """Tokens one block covers: ``block_size`` is per rank (as in vLLM's specs), and decode context
        parallelism shards a sharded group's block over ``dcp_world_size`` ranks (vLLM
        ``resolve_dcp_kv_block_size``). Recurrent state is never sharded."""
        return self.block_size * (dcp_world_size if self.dcp_sharded else 1)

    def resolved(self, dcp_world_size: int = 1) -> CacheGroup:
        """This group with ``block_size`` = its token span under DCP: what vLLM's manager works with."""
        span = self.span(dcp_world_size)
        return self if span == self.block_size else replace(self, block_size=span)

    @abstractmethod
    def longest(self, has: Has, max_tokens: int, space: Space, drop_eagle: bool) -> GroupHit:
        """Longest resume point ``<= max_tokens`` of this group alone, and the objects it loads there."""

    @abstractmethod
    def needs(self, tokens: int, space: Space, eagle: bool) -> list[Need]:
        """Objects this group needs to resume at ``tokens`` (for :func:`umbp.hybrid.explain`)."""

    def eagle_margin(self, space: Space) -> int:
        """How far past a candidate an EAGLE group must match before dropping back to it."""
        return self.block_size

    def splits_blocks(self, space: Space) -> bool:
        """Whether hits may land inside this group's blocks (one probe per unit rather than per block)."""
        return space.align < self.block_size and self.block_size % space.align == 0

    def describe(self) -> str:
        return f"{self.kind}, B={self.block_size}"


def resolve_groups(groups: Sequence[CacheGroup], dcp_world_size: int = 1) -> tuple[CacheGroup, ...]:
    """Per-rank group specs -> the token spans vLLM's managers use (sharded attention: ``B * dcp``)."""
    if dcp_world_size < 1:
        raise ValueError(f"dcp_world_size must be >= 1, got {dcp_world_size}")
    return tuple(g.resolved(dcp_world_size) for g in groups)


@dataclass(frozen=True)
class FullAttention(CacheGroup):
    """Full attention (incl. MLA): pages covering ``[0, T)``; the partial page of block ``T // B`` if needed.

    The page holding a prompt tail ``[k*B, b)`` is saved under ``b`` and, being append-only, also serves
    any resume point in ``(k*B, b]``.
    """

    block_size: int
    kind: str = field(default="full_attention", init=False, repr=False)
    tag: str = ""
    dcp_sharded: bool = True  # False: a replicated (draft) group, each rank holds every token
    downward_closed: ClassVar[bool] = True

    def eagle_margin(self, space: Space) -> int:
        # One unit when the lookup can stop inside a block, else a whole block (vLLM eagle_proof_margin).
        return space.unit if space.partial_hits and self.block_size > space.unit else self.block_size

    def longest(self, has: Has, max_tokens: int, space: Space, drop_eagle: bool) -> GroupHit:
        size = self.block_size
        # Phase 1: contiguous full blocks from the start; keys are chained, so the first miss ends it.
        ends: list[int | None] = []
        while (len(ends) + 1) * size <= max_tokens and has((len(ends) + 1) * size):
            ends.append((len(ends) + 1) * size)
        tokens = len(ends) * size
        # Phase 2: probe only inside the first block that is not full, highest boundary first.
        if self.splits_blocks(space):
            step = space.align
            top = min(tokens + size - step, max_tokens // step * step, space.hashed_tokens)
            for end in range(top, tokens, -step):
                if has(end):
                    ends.append(end)
                    tokens = end
                    break
        if drop_eagle and tokens > 0:
            tokens -= min(space.align, size)
        tokens -= tokens % space.align
        return GroupHit(tokens, tuple(ends[: _cdiv(tokens, size)]))

    def needs(self, tokens: int, space: Space, eagle: bool) -> list[Need]:
        end = tokens + (self.eagle_margin(space) if eagle else 0)
        size = self.block_size
        out = [Need(j * size, f"full block {j - 1}") for j in range(1, end // size + 1)]
        if end % size:
            out.append(Need(end, f"partial page of block {end // size}"))
        return out


@dataclass(frozen=True)
class SlidingWindow(CacheGroup):
    """Sliding-window attention: only the blocks inside the window before ``T``; block-granular hits.

    ``window`` is the attention window in tokens (vLLM ``sliding_window``): ``ceil((window-1)/B)`` blocks
    ending at ``T`` must exist, one more with EAGLE (matched, then dropped).
    """

    block_size: int
    window: int
    kind: str = field(default="sliding_window", init=False, repr=False)
    tag: str = ""
    dcp_sharded: bool = True  # vLLM 0.32 accepts DCP only for a replicated (False) sliding-window group
    fine_grained: ClassVar[bool] = False

    def splits_blocks(self, space: Space) -> bool:
        return False

    def blocks_needed(self, eagle: bool) -> int:
        return _cdiv(self.window - 1, self.block_size) + (1 if eagle else 0)

    def _aligned(self, num_blocks: int, space: Space) -> bool:
        return num_blocks * self.block_size % space.align == 0

    def longest(self, has: Has, max_tokens: int, space: Space, drop_eagle: bool) -> GroupHit:
        size, need = self.block_size, self.blocks_needed(drop_eagle)
        # Scan right to left for the highest run of `need` blocks whose (post-drop) end is aligned.
        run, first, kept = 0, 0, 0
        for i in range(max_tokens // size - 1, -1, -1):
            if not has((i + 1) * size):
                run = 0
                continue
            if run == 0 and not self._aligned(i if drop_eagle else i + 1, space):
                continue  # a run must start (at its right end) on an aligned boundary
            if run == 0:
                kept = i + 1
            run += 1
            if run >= need:
                first = i
                break
        else:
            # No full window: a run reaching block 0 still counts (the window is clipped at 0).
            first, kept = 0, run
            while kept and not self._aligned(kept, space):
                kept -= 1
        if drop_eagle and kept:
            kept -= 1
            while kept and not self._aligned(kept, space):
                kept -= 1
        blocks = tuple(None if i < first else (i + 1) * size for i in range(kept))
        return GroupHit(kept * size, blocks)

    def needs(self, tokens: int, space: Space, eagle: bool) -> list[Need]:
        size = self.block_size
        top = (tokens // size + (1 if eagle else 0)) * size
        ends = [top - j * size for j in range(self.blocks_needed(eagle))]
        return [Need(e, f"window block {e // size - 1}") for e in sorted(e for e in ends if e > 0)]

    def describe(self) -> str:
        return f"{self.kind}, B={self.block_size}, window={self.window}"


@dataclass(frozen=True)
class RecurrentState(CacheGroup):
    """Recurrent state (Mamba2 / GDN / KDA / short-conv, vLLM ``mamba_cache_mode="align"``): one state
    page after exactly ``T`` tokens.

    EAGLE does not shift it: the engine checkpoints the state one unit earlier instead, so the coordinator
    gives it no margin and its lookup ignores the drop.
    """

    block_size: int
    kind: str = field(default="recurrent_state", init=False, repr=False)
    tag: str = ""

    def eagle_margin(self, space: Space) -> int:
        return 0

    def longest(self, has: Has, max_tokens: int, space: Space, drop_eagle: bool) -> GroupHit:
        size = self.block_size
        if self.splits_blocks(space):
            step = space.align
            for end in range(min(max_tokens, space.hashed_tokens) // step * step, 0, -step):
                if has(end):
                    return GroupHit(end, (None,) * ((end - step) // size) + (end,))
            return GroupHit(0, ())
        for end in range(max_tokens // size * size, 0, -size):
            if has(end) and end % space.align == 0:
                return GroupHit(end, (None,) * (end // size - 1) + (end,))
        return GroupHit(0, ())

    def needs(self, tokens: int, space: Space, eagle: bool) -> list[Need]:
        return [Need(tokens, "state")]
