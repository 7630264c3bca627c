"""Lookups of the scheduler side (part of SchedulerSide): the longest boundary at which every group of
a prompt is held in some tier, asked by vLLM every step a request waits.

Cost: a 131,072-token prompt has 8,192 unit boundaries per group. Checking them all per ask (a key string,
a digest and a table probe each) cost 10-20 ms per ask on a 2-core VM; the groups' rules (umbp.hybrid)
only need the full-attention blocks from the start (328 of them at 400-token blocks), a unit-by-unit
probe inside the first missing block, and the recurrent state scanned down from there. So lookups ask
the local tiers lazily (LocalPresence), building keys and hexes only for the boundaries probed.

A mixin rather than a separate object: see umbp.vllm.scheduler_saves.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Container

import numpy as np

from umbp.hybrid import explain, longest_hit
from umbp.hybrid.tail import extend_hit
from umbp.vllm.scheduler_state import TrackedRequest

REMOTE_REUSE_S = 0.5  # a request's shared-tier answers are reused this long (see _add_remote)
PREFETCH = 64  # boundaries fetched in one index call once a scan walks down unit by unit


class LocalPresence:
    """Container of the ends ``t`` whose object of one group a local tier (DRAM index or SSD) holds and
    that is not quarantined, for one lookup. Each answer is fetched on first use and remembered. The
    groups' rules walk boundaries at a fixed stride (full attention up block by block, the recurrent
    state down unit by unit): a second step at the same stride fetches the next PREFETCH boundaries along
    it in one index call. Never enumerated (umbp.hybrid.longest_hit asks it with ``in``)."""

    def __init__(self, side, tracked: TrackedRequest, head: str, count: int) -> None:
        self.side, self.tracked, self.head, self.count = side, tracked, head, count
        self.unit = side.layout.unit
        self.known: dict[int, bool] = {}
        self.last, self.stride = -1, 0

    def __contains__(self, end: object) -> bool:
        if not isinstance(end, int) or end % self.unit:
            return False
        i = end // self.unit - 1
        if not 0 <= i < self.count:
            return False
        stride = i - self.last
        along = stride != 0 and stride == self.stride
        self.last, self.stride = i, stride
        held = self.known.get(i)
        if held is None:
            if along:
                stop = i + stride * PREFETCH
                self._fetch(range(i, min(stop, self.count) if stride > 0 else max(stop, -1), stride))
            else:
                self._fetch(range(i, i + 1))
            held = self.known[i]
        return held

    def _fetch(self, idx: range) -> None:
        side, head, hex_at = self.side, self.head, self.tracked.hex_at
        keys = [head + hex_at(i) for i in idx]
        held = side.index.lookup(keys)
        if side.ssd_keys:
            held = [h or k in side.ssd_keys for h, k in zip(held, keys)]
        if side.quarantine:  # expired entries were dropped by presence()
            held = [h and k not in side.quarantine for h, k in zip(held, keys)]
        self.known.update(zip(idx, held))


class LookupMixin:
    """SchedulerSide's lookups; the attributes it uses are set by SchedulerSide.__init__."""

    def boundary_keys(self, request) -> list[list[str]]:
        """Logical keys of every unit boundary, per group; cached per request (see _hexes)."""
        tracked = self.track(request)
        hexes = self._hexes(tracked)
        if not tracked.keys:
            tracked.keys = [[] for _ in self.layout.groups]
        for head, keys in zip(self._logical_heads, tracked.keys):
            keys.extend(head + hx for hx in hexes[len(keys) :])
        return tracked.keys

    def present_sets(self, request, limit: int) -> list[set[int]]:
        unit = self.layout.unit
        all_keys = self.boundary_keys(request)
        count = min(limit // unit, len(request.block_hashes))
        ends = range(unit, count * unit + 1, unit)
        present: list[set[int]] = []
        for g in range(len(self.layout.groups)):  # C-level loops: vLLM asks again every step a request
            keys = all_keys[g][:count]  # waits, and a 128K-token prompt has 8,000 boundaries per group
            held = set(itertools.compress(ends, self.index.lookup(keys)))
            if self.ssd_keys:
                held.update(itertools.compress(ends, map(self.ssd_keys.__contains__, keys)))
            present.append(held)
        if self.remote is not None:
            self._add_remote(request, ends, present)
        if self.quarantine:
            self._drop_quarantined(all_keys, present)
        return present

    def _add_remote(self, request, ends, present: list[set[int]]) -> None:
        """Pipelined round trips for the (boundary, group) objects the local tiers miss; all ranks must
        hold one. First the full-attention groups' whole blocks: a hit needs every one of them from the
        start (FullAttention.longest), so their first gap caps the hit, and the second round asks only
        up to a block past it; a cold 32K-token prompt then costs two small rounds instead of one over
        every boundary of every group and rank. (A fully stored prompt pays one extra round trip.)

        vLLM asks again every step a request waits for budget or blocks: answers younger than
        REMOTE_REUSE_S are reused (a key that vanished meanwhile is a failed load and a recompute; one that
        appeared is found on a later lookup). Keys are built from cached parts (`key_head`): object_key()
        per key cost 13 ms for 8,192 keys here, more than the round trip itself."""
        tracked = self.track(request)
        now = time.monotonic()
        cached = tracked.remote
        asks = []
        for g in range(len(present)):
            for t in ends:
                if t in present[g]:
                    continue
                hit = cached.get((g, t))
                if hit is not None and now - hit[0] < REMOTE_REUSE_S:
                    if hit[1]:
                        present[g].add(t)
                else:
                    asks.append((g, t))
        if self._full_blocks and asks:
            blocks = [(g, t) for g, t in asks if g in self._full_blocks and t % self._full_blocks[g] == 0]
            if blocks:
                self._ask_remote(tracked, blocks, present, now)
            # every whole block is known now (local, a fresh answer, or just asked). + the largest block: a
            # margin for a group that probes past its hit (EAGLE's, at most a block), cheap insurance that
            # this never changes the answer of asking everything (the tests find the same hits without it;
            # with the cap at the gap itself they do not)
            cap = min(self._contiguous_end(present[g], size) + size for g, size in self._full_blocks.items())
            cap += self._max_block
            asked = set(blocks)
            asks = [(g, t) for g, t in asks if t < cap and (g, t) not in asked]
        if asks:
            self._ask_remote(tracked, asks, present, now)

    def _ask_remote(
        self, tracked: TrackedRequest, asks: list[tuple[int, int]], present: list[set[int]], now: float
    ) -> None:
        """One pipelined exists() for these (group, end) objects of every rank; caches the answers."""
        hexes, unit = self._hexes(tracked), self.layout.unit
        held = self._held_by_every_rank([(g, hexes[t // unit - 1]) for g, t in asks])
        for (g, t), ok in zip(asks, held):
            tracked.remote[(g, t)] = (now, ok)
            if ok:
                present[g].add(t)

    def rank_keys(self, cut: list[tuple[int, str]]) -> tuple[list[str], list[int]]:
        """Every rank's key of each (group, prefix-hash hex) object, rank-major, and which object each key
        is of; a rank that holds no layer of a group (a pipeline stage) has none for it."""
        keys: list[str] = []
        owner: list[int] = []
        for heads in self._rank_heads:
            if None in heads:
                cols = [i for i, (g, _) in enumerate(cut) if heads[g] is not None]
                keys += [heads[cut[i][0]] + cut[i][1] for i in cols]
                owner += cols
            else:  # every rank without pipeline parallelism: one comprehension per rank
                keys += [heads[g] + hx for g, hx in cut]
                owner += range(len(cut))
        return keys, owner

    def _held_by_every_rank(self, cut: list[tuple[int, str]]) -> list[bool]:
        """One pipelined EXISTS: is each object on the shared tier for every rank that stores it? Never,
        before every rank's layout is known (umbp.vllm.stages): no rank's names are known then."""
        if not cut or not self.stages.ready:
            return [False] * len(cut)
        keys, owner = self.rank_keys(cut)
        missing = np.zeros(len(cut), dtype=bool)
        found = np.asarray(self.remote.exists(keys), dtype=bool)
        missing[np.asarray(owner, dtype=np.int64)[~found]] = True
        return (~missing).tolist()

    @staticmethod
    def _contiguous_end(ends: set[int], size: int) -> int:
        """End of the run of whole blocks present from the start."""
        end = 0
        while end + size in ends:
            end += size
        return end

    def _hexes(self, tracked: TrackedRequest) -> list[str]:
        """Hex of each block hash, cached per request; a rewrite of the hashes by vLLM drops everything
        derived from the old ones (TrackedRequest.sync_hashes)."""
        self._sync(tracked)
        return tracked.all_hexes()

    def _sync(self, tracked: TrackedRequest) -> None:
        if tracked.sync_hashes():
            self.count("hash_rewrites")

    def presence(self, request, limit: int) -> list[Container[int]]:
        """What lookup() asks "is the object of group g ending at t held?": the local tiers one boundary
        at a time (LocalPresence), since the groups' rules probe a few hundred of a stored 8,192-unit
        prompt's boundaries and one of a cold prompt's. With the shared tier, every boundary at once
        (present_sets): its answers come in pipelined round trips, which only pay off in batches."""
        if self.remote is not None:
            return self.present_sets(request, limit)
        tracked = self.track(request)
        self._sync(tracked)
        count = min(limit // self.layout.unit, len(tracked.hashes))
        if self.quarantine:
            now = time.monotonic()
            self.quarantine = {k: until for k, until in self.quarantine.items() if until > now}
        return [LocalPresence(self, tracked, head, count) for head in self._logical_heads]

    def _drop_quarantined(self, all_keys: list[list[str]], present: list[set[int]]) -> None:
        now = time.monotonic()
        self.quarantine = {k: until for k, until in self.quarantine.items() if until > now}
        unit = self.layout.unit
        for g, ends in enumerate(present):
            ends -= {t for t in ends if all_keys[g][t // unit - 1] in self.quarantine}

    def lookup(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self.track(request)
        self.count("lookups")
        if not self.stages.ready:  # pipeline parallel, before every stage reported its layout
            self.count("lookups_layout_pending")
            return 0, False
        max_tokens = request.num_tokens - 1
        hashed = len(request.block_hashes) * self.layout.unit
        present = self.presence(request, hashed)
        hit = longest_hit(
            list(self.layout.groups),
            unit=self.layout.unit,
            present=present,
            max_tokens=max_tokens,
            eagle_groups=self.layout.eagle_groups,
            hashed_tokens=hashed,
            dcp_world_size=self.layout.dcp,  # PCP: vLLM's Scheduler builds its coordinator with pcp 1
        )
        tracked.block_hit = hit
        if self._tail_span is not None:
            hit = self._extend_into_tail(tracked, request, hit, num_computed_tokens, max_tokens)
        tracked.hit, tracked.hit_local = hit, num_computed_tokens
        if self.consumer is not None and self.consumer.hold(
            request, tracked, hit.tokens, num_computed_tokens
        ):
            return None, False  # P's hand-off is not visible yet: vLLM asks again next step
        if hit.tokens <= num_computed_tokens:
            return 0, False
        self.count("lookup_hit_requests")
        return hit.tokens - num_computed_tokens, True

    def may_load(self, request) -> bool:
        """Whether a lookup will likely find a load for ``request``: every full-attention group holds its
        first block in a local tier (a hit needs all of them from the start). Cheap, as vLLM asks on
        every entry into its waiting queues; the shared tier is not asked (a round trip), and a layout
        without full attention answers False: both only keep vLLM's ordinary admission order."""
        if not self._full_blocks or not self.stages.ready:
            return False
        tracked = self.track(request)
        self._sync(tracked)
        for g, size in self._full_blocks.items():
            if size > len(tracked.hashes) * self.layout.unit:
                return False
            key = self._logical_heads[g] + tracked.hex_at(size // self.layout.unit - 1)
            if not (self.index.lookup([key])[0] or key in self.ssd_keys):
                return False
        return True

    def _extend_into_tail(self, tracked: TrackedRequest, request, hit, local: int, max_tokens: int):
        """Past the block-aligned hit (or the local GPU hit, if longer), the page ends inside the next block
        that every group holds: one batch of index/SSD checks and at most one shared-tier round trip."""
        span, tail_unit = self._tail_span, self._tail_unit
        base = max(hit.tokens, local)
        ends = [e for e in range(base + tail_unit, base + span + 1, tail_unit) if e <= request.num_tokens]
        held = self._held_everywhere(tracked, request, ends) if ends and base % span == 0 else set()
        return extend_hit(self.spans, hit, base, tail_unit, max_tokens, request.num_tokens, held.__contains__)

    def _held_everywhere(self, tracked: TrackedRequest, request, ends: list[int]) -> set[int]:
        """The ends whose object every group holds in some tier (every rank, for the shared tier) and
        that are not quarantined."""
        groups = range(len(self.layout.groups))
        keys = {(g, e): self.key(g, request, e) for g in groups for e in ends}
        held = {ge for ge, key, ok in zip(keys, keys.values(), self.index.lookup(list(keys.values()))) if ok}
        held |= {ge for ge, key in keys.items() if key in self.ssd_keys}
        asks = [ge for ge in keys if ge not in held]
        if self.remote is not None and asks:
            cut = [(g, bytes(self.prefix_hash(request, e)).hex()) for g, e in asks]
            held |= {ge for ge, ok in zip(asks, self._held_by_every_rank(cut)) if ok}
        now = time.monotonic()
        held -= {ge for ge, key in keys.items() if self.quarantine.get(key, 0) > now}
        return {e for e in ends if all((g, e) in held for g in groups)}

    def explain(self, request) -> str:
        hashed = len(request.block_hashes) * self.layout.unit
        return explain(
            list(self.layout.groups),
            unit=self.layout.unit,
            present=self.present_sets(request, hashed),
            max_tokens=request.num_tokens - 1,
            eagle_groups=self.layout.eagle_groups,
            hashed_tokens=hashed,
            dcp_world_size=self.layout.dcp,
        )
