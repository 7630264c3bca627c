"""Store planning: which of a request's GPU pages to save, under which prefix key, and when.

A hybrid hit at boundary ``b`` needs *every* group's object at ``b``: the recurrent state after exactly
``b`` tokens, and for attention the pages covering ``[0, b)``. The engine hands off recurrent states
(``(group, block_id, b)``) but never the attention page that holds the sub-block tail ``[k*B, b)``, so
the planner stores that page itself, keyed where the lookup will probe it (``b``, or ``b + unit`` for
groups that take EAGLE's drop). Without it the hybrid hit falls back to an older boundary, or to 0.

One :class:`RequestStorePlanner` per request; the connector calls :meth:`RequestStorePlanner.step`
every scheduler step (plans execute after that step's forward) and once more with ``finished=True``.
Pure Python, stdlib only (layer 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from umbp.hybrid.groups import CacheGroup, RecurrentState, Space, resolve_groups
from umbp.hybrid.lookup import hit_alignment, resolve_eagle_ids
from umbp.hybrid.tail import tail_page_end, tail_span

NULL_BLOCK = 0  # vLLM's null block: a freed/skipped position, never holds data worth saving

FULL_BLOCK = "full_block"
BOUNDARY_PAGE = "boundary_page"
BOUNDARY_STATE = "boundary_state"
FINISHED_TAIL = "finished_tail"
PROMPT_TAIL = "prompt_tail"  # attention-only: the prompt's partly filled last block (umbp.hybrid.tail)


@dataclass(frozen=True)
class StorePlan:
    """Save ``block_id`` of ``group`` under the key of the prefix ``[0, key_end)``."""

    group: int
    block_id: int
    key_end: int  # key = engine hash of prefix [0, key_end) (vLLM: block_hashes[key_end // unit - 1])
    valid: tuple[int, int]  # token range of the page that is valid
    reason: str  # FULL_BLOCK | BOUNDARY_PAGE | BOUNDARY_STATE | FINISHED_TAIL | PROMPT_TAIL


def resolve_eagle_groups(num_groups: int, eagle: bool, flagged: Iterable[int] = ()) -> frozenset[int]:
    """Groups that take EAGLE's one-unit drop; vLLM 0.32 flags all of them when none is annotated."""
    return resolve_eagle_ids(num_groups, True, flagged) if eagle else frozenset()


def _block_at(block_ids: Sequence[Sequence[int]], group: int, index: int) -> int:
    """The block the request owns at ``index`` of ``group``'s table, or NULL_BLOCK if none."""
    table = block_ids[group] if group < len(block_ids) else ()
    return table[index] if 0 <= index < len(table) else NULL_BLOCK


def _page_shifts(
    groups: Sequence[CacheGroup], unit: int, eagle_groups: frozenset[int], dcp_world_size: int = 1
) -> dict[int, int]:
    """How far past a boundary each attention group's lookup probes: 0, or for EAGLE groups the
    coordinator's margin (one unit with partial hits, else a whole block: then the page is a full block).
    vLLM looks up groups with equal specs jointly and gives all of them the drop if one is flagged."""
    space = Space(unit, hit_alignment(groups, unit, dcp_world_size), hashed_tokens=0)
    spans = resolve_groups(groups, dcp_world_size)
    dropping = {spans[g] for g in eagle_groups}
    return {
        g: spec.eagle_margin(space) if spec in dropping else 0
        for g, spec in enumerate(spans)
        if not isinstance(spec, RecurrentState)
    }


class RequestStorePlanner:
    """Turns one request's progress into store plans; never plans the same ``(group, key_end)`` twice.

    ``groups`` are per-rank specs as for :func:`umbp.hybrid.longest_hit`; with ``dcp_world_size > 1`` a
    sharded attention block spans ``block_size * dcp`` tokens, so block ``i`` of the request's table holds
    tokens ``[i * span, (i + 1) * span)`` (each rank its shard) and a boundary page is keyed where vLLM's
    DCP-aware lookup probes it.

    State kept between steps: what was planned, per-group cursors over complete blocks, and boundary
    pages waiting for their tokens. With ``tail_unit`` and ``prompt_tokens`` on a layout that
    :func:`umbp.hybrid.tail.tail_span` accepts, the prompt's partly filled last block is planned once the
    whole prompt is computed, keyed at the prompt's last whole ``tail_unit`` (``key_end`` then need not be
    a multiple of ``unit``: the caller keys it itself). Block ids are never cached: every attention plan names a block from
    the table passed in that step (a state plan, the hand-off's block), so preemption (new tables) needs
    only :meth:`reset` and no per-block bookkeeping.
    """

    def __init__(
        self,
        groups: Sequence[CacheGroup],
        unit: int,
        eagle_groups: frozenset[int] = frozenset(),
        boundary_page: bool = True,
        store_limit: int | None = None,
        dcp_world_size: int = 1,
        tail_unit: int = 0,
        prompt_tokens: int | None = None,
    ) -> None:
        if unit <= 0:
            raise ValueError(f"unit must be positive, got {unit}")
        for g, spec in enumerate(groups):
            if not isinstance(spec, CacheGroup):
                raise TypeError(f"group {g}: unsupported group spec {spec!r}")
        spans = resolve_groups(groups, dcp_world_size)
        for g, spec in enumerate(spans):
            if spec.block_size <= 0 or spec.block_size % unit:
                raise ValueError(f"group {g}: block span {spec.block_size} is not a multiple of unit {unit}")
        self.groups = spans  # token spans: every index below is into vLLM's (DCP-scaled) block table
        self.unit = unit
        self.eagle_groups = frozenset(eagle_groups)
        self.boundary_page = boundary_page
        self.store_limit = store_limit
        self._attention = tuple(g for g, s in enumerate(groups) if not isinstance(s, RecurrentState))
        self._recurrent = frozenset(g for g, s in enumerate(groups) if isinstance(s, RecurrentState))
        self._page_shift = _page_shifts(groups, unit, self.eagle_groups, dcp_world_size)
        self._planned: set[tuple[int, int]] = set()  # (group, key_end) handed to the connector
        self._pending_pages: set[tuple[int, int]] = set()  # (group, key_end) waiting for tokens
        self._next_block = [0] * len(groups)  # per group: lowest block index that may still need a plan
        self.finished = False
        self._wake_at: int | None = None  # see idle()
        self._tail = self._prompt_tail(groups, tail_unit, prompt_tokens, dcp_world_size)
        reasons = (FULL_BLOCK, BOUNDARY_PAGE, BOUNDARY_STATE, FINISHED_TAIL, PROMPT_TAIL)
        self.counters = dict.fromkeys((*reasons, "dropped_pages", "dropped_states", "ignored_offloads"), 0)

    # ------------------------------------------------------------------ public API

    def step(
        self,
        *,
        computed_tokens: int,
        hashed_tokens: int,
        block_ids: Sequence[Sequence[int]],
        offloads: Sequence[tuple[int, int, int]] = (),
        finished: bool = False,
    ) -> list[StorePlan]:
        """Plans for this step. ``offloads`` are the engine's hand-offs ``(group, block_id, b)``, valid
        only this step; with ``finished=True`` (the finish path) this is the request's last call."""
        if self.finished:
            return []
        self._wake_at = None
        limit = self._key_limit(computed_tokens, hashed_tokens)
        plans = self._full_blocks(limit, block_ids)
        plans += self._states(offloads, hashed_tokens)
        if self.boundary_page:
            plans += self._pages(limit, block_ids, finished)
            plans += self._tail_page(computed_tokens, block_ids)
        self.finished = finished
        if finished:
            self._pending_pages.clear()
        for plan in plans:
            self.counters[plan.reason] += 1
        return plans

    def idle(self, computed_tokens: int, hashed_tokens: int) -> bool:
        """True when :meth:`step` with these counts and no hand-offs would plan nothing and change no
        state: no new complete block, no pending page whose tokens are in. Most decode steps are idle,
        and the caller can then skip building the request's block tables (vLLM makes a list per group)."""
        if self._wake_at is None:  # the fewest tokens at which step() has work; reset by every change
            ends = [(self._next_block[g] + 1) * self.groups[g].block_size for g in self._attention]
            if self.boundary_page:
                ends += [end for _g, end in self._pending_pages]
            self._wake_at = min(ends, default=1 << 62)
        limit = min(computed_tokens, hashed_tokens)  # _key_limit, inlined: once per request and step
        if self.store_limit is not None:
            limit = min(limit, self.store_limit)
        return self.finished or (limit < self._wake_at and not self._tail_due(computed_tokens))

    def mark_failed(self, plans: Iterable[StorePlan]) -> None:
        """Saves that failed: make them plannable again (pages and blocks while the block is still owned;
        a state only if the engine hands it off again, since its block was valid for one step)."""
        self._wake_at = None
        for plan in plans:
            self._planned.discard((plan.group, plan.key_end))
            if plan.reason == FULL_BLOCK:
                index = plan.key_end // self.groups[plan.group].block_size - 1
                self._next_block[plan.group] = min(self._next_block[plan.group], index)
            elif plan.reason == PROMPT_TAIL:
                pass  # released above: planned again while the request still owns its block
            elif plan.reason in (BOUNDARY_PAGE, FINISHED_TAIL) and not self.finished:
                self._pending_pages.add((plan.group, plan.key_end))

    def reset(self) -> None:
        """Preemption: the request's blocks were freed and it restarts with new tables. What was saved
        stays saved; complete blocks are rescanned (SWA blocks nulled before may be recomputed now);
        pending boundary pages stay pending because block k of the new table holds the same tokens."""
        self._wake_at = None
        self._next_block = [0] * len(self.groups)

    @property
    def pending_pages(self) -> frozenset[tuple[int, int]]:
        """Boundary pages ``(group, key_end)`` handed off but not yet computed (for explain/stats)."""
        return frozenset(self._pending_pages)

    # ------------------------------------------------------------------ the three kinds of plan

    def _key_limit(self, *ends: int) -> int:
        """The furthest a key may end: within ``ends`` (tokens computed, hashed) and ``store_limit``."""
        return min(ends if self.store_limit is None else (*ends, self.store_limit))

    def _full_blocks(self, limit: int, block_ids: Sequence[Sequence[int]]) -> list[StorePlan]:
        """Complete attention blocks, in prefix order. Null/absent blocks (SWA out of window) are gone for
        good, so the cursor moves past them; amortised O(new blocks) per step."""
        plans = []
        for g in self._attention:
            size = self.groups[g].block_size
            for i in range(self._next_block[g], limit // size):
                end = (i + 1) * size
                block = _block_at(block_ids, g, i)
                if block != NULL_BLOCK and self._claim(g, end):
                    plans.append(StorePlan(g, block, end, (i * size, end), FULL_BLOCK))
            self._next_block[g] = max(self._next_block[g], limit // size)
        return plans

    def _states(self, offloads: Sequence[tuple[int, int, int]], hashed_tokens: int) -> list[StorePlan]:
        """Recurrent states come only from hand-offs and must be planned in the step they are offered.
        Each accepted boundary also queues the attention pages that make it reachable."""
        plans = []
        for g, block, boundary in offloads:
            if g not in self._recurrent:
                self.counters["ignored_offloads"] += 1
                continue
            # The state is computed by the engine's word; its key must still exist and be allowed.
            if block == NULL_BLOCK or not 0 < boundary <= self._key_limit(hashed_tokens):
                self.counters["dropped_states"] += 1
                continue
            if self._claim(g, boundary):
                plans.append(StorePlan(g, block, boundary, (0, boundary), BOUNDARY_STATE))
            self._queue_pages(boundary)
        return plans

    def _queue_pages(self, boundary: int) -> None:
        """Per attention group, the page the lookup probes for ``boundary``: keyed at ``boundary`` or, for
        EAGLE groups, EAGLE's margin past it. A block-aligned key is a full block: that path has it."""
        if not self.boundary_page:
            return
        for g in self._attention:
            end = boundary + self._page_shift[g]
            if end % self.groups[g].block_size and (g, end) not in self._planned:
                if self.store_limit is None or end <= self.store_limit:
                    self._pending_pages.add((g, end))
                else:
                    self.counters["dropped_pages"] += 1

    def _pages(self, limit: int, block_ids: Sequence[Sequence[int]], finished: bool) -> list[StorePlan]:
        """Pending boundary pages whose tokens are now computed and hashed: block ``end // B`` keyed at
        ``end``, valid ``[k*B, end)``. Dropped if the request no longer owns that block."""
        plans = []
        reason = FINISHED_TAIL if finished else BOUNDARY_PAGE
        for g, end in sorted(p for p in self._pending_pages if p[1] <= limit):
            self._pending_pages.discard((g, end))
            size = self.groups[g].block_size
            block = _block_at(block_ids, g, end // size)
            if block == NULL_BLOCK:
                self.counters["dropped_pages"] += 1
            elif self._claim(g, end):
                plans.append(StorePlan(g, block, end, (end // size * size, end), reason))
        return plans

    def _prompt_tail(
        self, groups: Sequence[CacheGroup], tail_unit: int, prompt_tokens: int | None, dcp_world_size: int
    ) -> tuple[int, int] | None:
        """(key end, block index) of the prompt's tail page, when this layout restores prompt tails."""
        span = tail_span(groups, tail_unit, dcp_world_size, self.eagle_groups)
        if span is None or prompt_tokens is None or not self.boundary_page:
            return None
        end = tail_page_end(prompt_tokens, span, tail_unit)
        if end is None or (self.store_limit is not None and end > self.store_limit):
            return None
        return end, end // span

    def _tail_due(self, computed_tokens: int) -> bool:
        """The tail page is computed (the whole prompt is: the page then holds ``[k*B, prompt)``) and some
        attention group has not planned it yet."""
        if self._tail is None or computed_tokens < self._tail[0]:
            return False
        return any((g, self._tail[0]) not in self._planned for g in self._attention)

    def _tail_page(self, computed_tokens: int, block_ids: Sequence[Sequence[int]]) -> list[StorePlan]:
        """The prompt's tail page of every attention group, once its tokens are computed. Keyed at the
        last whole tail unit ``e``; valid ``[k*B, e)`` (the page holds the rest of the prompt too)."""
        if not self._tail_due(computed_tokens):
            return []
        end, index = self._tail
        start = index * self.groups[self._attention[0]].block_size
        plans = []
        for g in self._attention:
            if (g, end) in self._planned:
                continue
            block = _block_at(block_ids, g, index)
            self._claim(g, end)  # a page the request no longer owns is not asked for again
            if block == NULL_BLOCK:
                self.counters["dropped_pages"] += 1
            else:
                plans.append(StorePlan(g, block, end, (start, end), PROMPT_TAIL))
        return plans

    def _claim(self, group: int, key_end: int) -> bool:
        """True the first time ``(group, key_end)`` is planned (until a failure releases it)."""
        if (group, key_end) in self._planned:
            return False
        self._planned.add((group, key_end))
        return True
