"""Scheduler side of the UMBPConnector (embedded mode).

The scheduler process owns the DRAM tier's index and slot allocation; every worker owns an arena whose
slot offsets mirror it. Per step this side decides:

* lookups: the longest boundary at which every group of the prompt is held (``umbp.hybrid``);
* loads: which stored objects go into which freshly allocated GPU blocks (asynchronous; a failed load is
  reported through vLLM's ``failed_recving`` path, so vLLM recomputes);
* saves: what the planner says to store, each into a reserved slot; a key becomes visible to lookups only
  after every rank confirmed its save, and the GPU blocks it reads stay pinned until then.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from umbp.hybrid import RequestStorePlanner, StorePlan, explain, longest_hit
from umbp.hybrid.groups import FullAttention
from umbp.hybrid.planner import BOUNDARY_PAGE, BOUNDARY_STATE, PROMPT_TAIL
from umbp.hybrid.tail import extend_hit, tail_span
from umbp.identity import object_key
from umbp.pool import DramIndex
from umbp.vllm.config import ARENA_PAGE, ConfigError, UMBPConfig
from umbp.vllm.handoff import Consumer, Producer
from umbp.vllm.kv_layout import Layout, slot_span
from umbp.vllm.metadata import LoadJob, PageMove, SaveJob, UMBPConnectorMetadata, UMBPWorkerMetadata
from umbp.vllm.stats import UMBPStats
from umbp.vllm.tail_hashes import tail_prefix_hash
from umbp.vllm.tiers import logical_key, scan_ssd

logger = logging.getLogger("umbp.vllm")

SAVE_CONFIRM_STEPS = 64
REMOTE_REUSE_S = 0.5  # a request's shared-tier answers are reused this long (see _add_remote)
MUTABLE = (
    BOUNDARY_PAGE,
    BOUNDARY_STATE,
    PROMPT_TAIL,
)  # plans whose pages a running request's next forward may rewrite  # steps after which an unconfirmed save is given up (its keys never become visible)


@dataclass
class PendingLoad:
    req_id: str
    tokens: int  # the resume boundary this load restores
    new_tokens: int  # tokens beyond the local hit
    keys: list[str]
    job: LoadJob
    sent: bool = False
    promoted: list[str] = field(default_factory=list)  # DRAM reservations filled from SSD by this load
    all_keys: list[str] = field(default_factory=list)  # every object this load reads
    tiers: Counter = field(default_factory=Counter)  # objects by the tier they are read from


@dataclass
class PendingSave:
    job: SaveJob
    keys: list[str]
    blocks: list[int]  # GPU blocks pinned until every rank confirmed
    confirmed: set[str] = field(default_factory=set)
    ssd_confirmed: set[str] = field(default_factory=set)
    failed: bool = False
    sent_step: int = -1


@dataclass
class TrackedRequest:
    request: object  # vllm Request (kept for its growing block_hashes)
    planner: RequestStorePlanner
    hit: object | None = None  # last lookup result (umbp.hybrid Hit), consumed at allocation
    hit_local: int = 0
    block_hit: object | None = None  # the lookup's hit before the prompt-tail extension (umbp.hybrid.tail)
    keys: list[list[str]] = field(default_factory=list)  # per group: logical key of each unit boundary
    hexes: list[str] = field(default_factory=list)  # hex of each unit boundary's prefix hash
    remote: dict = field(default_factory=dict)  # (group, token end) -> (time asked, every rank holds it)
    tail_hashes: dict = field(default_factory=dict)  # key end inside a unit -> its prefix hash (tail_hashes)

    def forget_hashes(self) -> None:
        """A resumed request may carry different hashes: nothing derived from the old ones stays."""
        self.keys, self.hexes, self.remote, self.tail_hashes = [], [], {}, {}


class SchedulerSide:
    def __init__(self, cfg: UMBPConfig, layout: Layout, block_pool=None, role: str = "kv_both"):
        self.cfg = cfg
        self.layout = layout
        self.block_pool = block_pool
        self.index = DramIndex(
            cfg.dram_bytes,
            high_watermark=cfg.high_watermark,
            low_watermark=cfg.low_watermark,
            alignment=ARENA_PAGE,
            keep_keys=False,  # evictions are only counted here
            max_evict_objects=1024,
        )  # a ~3 ms eviction per step at most, not 10% of 30 M
        self.rank_tags = {r.tag() for r in layout.ranks}
        self.requests: dict[str, TrackedRequest] = {}
        self.loads: dict[str, PendingLoad] = {}
        self.saves: dict[int, PendingSave] = {}
        self.unsent_saves: list[int] = []
        self.in_flight_keys: set[str] = set()
        self.restored: dict[str, int] = {}  # live request -> boundary it was restored at
        self.ssd_keys: set[str] = set()  # logical objects every rank's SSD tier holds
        self.remote = cfg.remote_tier()  # the shared tier (Redis/Valkey), queried at lookup
        self.quarantine: dict[str, float] = {}  # logical key -> time until which it is not offered
        self.load_failed: set[str] = set()  # logical keys ranks reported unusable, until their load's report
        # keys are a fixed head + the prefix hash's hex (cached per request): built once here
        ns = layout.namespace
        self._logical_heads = [key_head(logical_key(ns, g, b"\x00")) for g in range(len(layout.groups))]
        # block geometry of vLLM's scheduler-side tables: under DCP a sharded attention block spans
        # block_size * dcp tokens (each rank holds its shard of it under its own key)
        self.spans = layout.spans
        # full-attention groups (MLA included) -> span: every hit needs all their whole blocks (_add_remote)
        self._full_blocks = {
            g: spec.block_size for g, spec in enumerate(self.spans) if isinstance(spec, FullAttention)
        }
        self._max_block = max((spec.block_size for spec in self.spans), default=0)
        # attention-only layouts also restore into the prompt's last block (umbp.hybrid.tail); None: off
        # (off with speculative decoding: a tail key covers [0, e) only, not the tokens past e that a
        # drafter's KV at e - 1 was computed from, which vLLM's lookahead block hashes cover)
        spec = layout.identity.speculative_method
        self._tail_unit = cfg.tail_unit if cfg.boundary_page and not spec else 0
        self._tail_span = tail_span(layout.groups, self._tail_unit, layout.dcp, layout.eagle_groups)
        self._rank_heads = [
            [key_head(object_key(ns, r, g, b"\x00")) for g in range(len(layout.groups))] for r in layout.ranks
        ]
        if cfg.ssd_dirs:
            self.ssd_keys = scan_ssd(cfg.ssd_dirs, layout.namespace, layout.ranks)
            logger.info("umbp: SSD tier holds %d objects from earlier runs", len(self.ssd_keys))
        # store-mediated P/D (umbp.vllm.handoff): a producer confirms hand-offs, a consumer waits for them
        if role in ("kv_producer", "kv_consumer") and self.remote is None:
            raise ConfigError(
                f"umbp: kv_role {role!r} is store-mediated P/D and needs the shared tier "
                "('remote' in kv_connector_extra_config); beside a P/D connector use 'kv_both'"
            )
        self.producer = Producer(self, cfg.handoff_timeout_s) if role == "kv_producer" else None
        self.consumer = Consumer(self, cfg.handoff_wait_s) if role == "kv_consumer" else None
        self.job_ids = itertools.count(1)
        self.step = 0
        self.stats = UMBPStats()  # this interval's counters, handed to vLLM each step
        self.totals: Counter[str] = Counter()  # since start, for `umbp stats`-style inspection and tests

    def count(self, key: str, value: int = 1) -> None:
        self.stats.add(key, value)
        self.totals[key] += value

    # ---------------------------------------------------------------- requests
    def track(self, request) -> TrackedRequest:
        tracked = self.requests.get(request.request_id)
        if tracked is None:
            planner = RequestStorePlanner(
                list(self.layout.groups),
                self.layout.unit,
                eagle_groups=self.layout.eagle_groups,
                boundary_page=self.cfg.boundary_page,
                store_limit=None if self.cfg.decode_saves else request.num_prompt_tokens,
                dcp_world_size=self.layout.dcp,
                tail_unit=self._tail_unit,
                prompt_tokens=request.num_prompt_tokens,
            )
            tracked = TrackedRequest(request, planner)
            self.requests[request.request_id] = tracked
        return tracked

    def key(self, group: int, request, token_end: int) -> str:
        return logical_key(self.layout.namespace, group, self.prefix_hash(request, token_end))

    def prefix_hash(self, request, token_end: int) -> bytes:
        """The hash a key of the prefix ``[0, token_end)`` is built from: vLLM's at unit boundaries, umbp's
        own for a prompt-tail page that ends inside a unit (umbp.vllm.tail_hashes)."""
        unit = self.layout.unit
        if token_end % unit == 0:
            return request.block_hashes[token_end // unit - 1]
        tracked = self.requests.get(request.request_id)  # a finished request is no longer tracked
        cache = tracked.tail_hashes if tracked is not None else {}
        if token_end not in cache:
            cache[token_end] = tail_prefix_hash(request, unit, token_end)
        return cache[token_end]

    # ---------------------------------------------------------------- lookup
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
        cut = [(g, hexes[t // unit - 1]) for g, t in asks]
        keys = [heads[g] + hx for heads in self._rank_heads for g, hx in cut]  # rank-major
        held = (
            np.asarray(self.remote.exists(keys), dtype=bool)
            .reshape(len(self._rank_heads), len(asks))
            .all(axis=0)
        )
        for (g, t), ok in zip(asks, held.tolist()):
            tracked.remote[(g, t)] = (now, ok)
            if ok:
                present[g].add(t)

    @staticmethod
    def _contiguous_end(ends: set[int], size: int) -> int:
        """End of the run of whole blocks present from the start."""
        end = 0
        while end + size in ends:
            end += size
        return end

    def _hexes(self, tracked: TrackedRequest) -> list[str]:
        """Hex of each block hash, cached per request. vLLM can cut a request's hashes and hash new tokens
        in their place (a streaming session's next chunk, a connector's truncate_block_hashes, lookahead
        hashes recomputed on readmission): the hashes are chained, so any change shows in the last one
        both lists still share, and a change drops everything derived from the old ones."""
        hashes, hexes = tracked.request.block_hashes, tracked.hexes
        shared = min(len(hexes), len(hashes))
        if len(hexes) > len(hashes) or (shared and hexes[shared - 1] != bytes(hashes[shared - 1]).hex()):
            tracked.forget_hashes()
            self.count("hash_rewrites")
            hexes = tracked.hexes
        hexes.extend(bytes(h).hex() for h in hashes[len(hexes) :])
        return hexes

    def _drop_quarantined(self, all_keys: list[list[str]], present: list[set[int]]) -> None:
        now = time.monotonic()
        self.quarantine = {k: until for k, until in self.quarantine.items() if until > now}
        unit = self.layout.unit
        for g, ends in enumerate(present):
            ends -= {t for t in ends if all_keys[g][t // unit - 1] in self.quarantine}

    def lookup(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self.track(request)
        self.count("lookups")
        max_tokens = request.num_tokens - 1
        hashed = len(request.block_hashes) * self.layout.unit
        present = self.present_sets(request, hashed)
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
        if not self._full_blocks:
            return False
        hexes = self._hexes(self.track(request))
        for g, size in self._full_blocks.items():
            if size > len(hexes) * self.layout.unit:
                return False
            key = self._logical_heads[g] + hexes[size // self.layout.unit - 1]
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
            hexes = [bytes(self.prefix_hash(request, e)).hex() for _, e in asks]
            rank_keys = [heads[g] + hx for heads in self._rank_heads for (g, _), hx in zip(asks, hexes)]
            found = np.asarray(self.remote.exists(rank_keys), dtype=bool).reshape(
                len(self._rank_heads), len(asks)
            )
            held |= {ge for ge, ok in zip(asks, found.all(axis=0).tolist()) if ok}
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

    # ---------------------------------------------------------------- loads
    def on_alloc(self, request, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        tracked = self.track(request)
        if num_external_tokens == 0 or request.request_id in self.loads:
            return
        hit, local = tracked.hit, tracked.hit_local
        if hit is not None and hit.tokens != local + num_external_tokens and tracked.block_hit is not None:
            # vLLM may cut an external hit back to a block boundary (a bounded-replay sliding window):
            # then the block-aligned hit found before the tail extension is the one to load
            if tracked.block_hit.tokens == local + num_external_tokens:
                hit = tracked.block_hit
        tracked.hit = tracked.block_hit = None
        load = PendingLoad(request.request_id, 0, num_external_tokens, [], LoadJob(request.request_id, {}))
        self.loads[request.request_id] = load
        if hit is None or hit.tokens != local + num_external_tokens:
            # vLLM asked for a load we did not offer; never load a boundary we did not check
            load.job.poisoned = True
            return
        load.tokens = hit.tokens
        moves = self._load_moves(request, hit, local, block_ids)
        if moves is None or not self._place_loads(load, moves):
            load.job.poisoned = True
            return
        for g, move, _ in moves:
            load.job.moves.setdefault(g, []).append(move)
        self.count("hit_tokens", num_external_tokens)

    def _load_moves(self, request, hit, local: int, block_ids) -> list[tuple[int, PageMove, str]] | None:
        """(group, move, key) for every object the hit needs beyond the local prefix; None if a needed
        destination block is missing."""
        moves = []
        for g, ends in enumerate(hit.loads):
            spec = self.spans[g]  # block (end - 1) // span of vLLM's (DCP-scaled) table
            for end in sorted(ends):
                idx = (end - 1) // spec.block_size
                if spec.kind != "recurrent_state" and idx * spec.block_size < local:
                    continue  # this block is already held by the local prefix hit
                table = block_ids[g]
                if idx >= len(table) or table[idx] == 0:
                    return None
                move = PageMove(table[idx], -1, self.layout.object_bytes[g], self.prefix_hash(request, end))
                moves.append((g, move, self.key(g, request, end)))
        return moves

    def _place_loads(self, load: PendingLoad, moves) -> bool:
        """Pin DRAM copies; read the rest from SSD, promoting each into a fresh DRAM slot."""
        for _, move, key in moves:
            load.all_keys.append(key)
            slot = self.index.pin([key])[0]
            if slot is not None:
                move.offset = slot.offset
                load.keys.append(key)
                load.tiers["dram"] += 1
            elif key in self.ssd_keys or self.remote is not None:
                move.source = "ssd" if key in self.ssd_keys else "remote"
                load.tiers[move.source] += 1
                if key not in self.in_flight_keys:
                    promoted = self.index.reserve(key, move.nbytes)
                    if promoted is not None:
                        move.promote_offset = promoted.offset
                        self.in_flight_keys.add(key)
                        load.promoted.append(key)
            else:
                return False
        self._count_evictions()
        return True

    # ---------------------------------------------------------------- saves
    def plan_saves(self, scheduler_output) -> None:
        state = scheduler_output.kv_connector_block_state
        if state is None:
            return
        for req_id in sorted(scheduler_output.preempted_req_ids or ()):
            if req_id in self.requests:
                self.requests[req_id].planner.reset()
                self.requests[req_id].forget_hashes()
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens or {}
        offloads_of, scheduled_of, unit = (
            state.boundary_state_offloads,
            scheduler_output.num_scheduled_tokens,
            self.layout.unit,
        )
        busy = []  # most decode steps leave every planner idle: then no block tables are built (vLLM makes
        for req_id in state.req_ids:  # a list per group and request; that was ~3/4 of umbp's step cost)
            tracked = self.requests.get(req_id)
            if tracked is None or req_id in self.loads:
                continue
            request = tracked.request
            computed = (
                request.num_computed_tokens + scheduled_of.get(req_id, 0) - len(spec_tokens.get(req_id, ()))
            )
            hashed = len(request.block_hashes) * unit
            offloads = offloads_of.get(req_id, ())
            if offloads or not tracked.planner.idle(computed, hashed):
                busy.append((req_id, computed, hashed, offloads))
        for req_id, computed, hashed, offloads in sorted(busy):
            block_ids = state.get_block_ids(req_id)
            if block_ids is None:
                continue
            tracked = self.requests[req_id]
            plans = tracked.planner.step(
                computed_tokens=computed, hashed_tokens=hashed, block_ids=block_ids, offloads=offloads
            )
            self.queue_saves(tracked.request, plans)

    def queue_saves(self, request, plans: Sequence[StorePlan]) -> None:
        """One save job per group and kind: pages the next forward may still rewrite (the boundary page
        and the state of a running request) apart from full blocks, so that only the former hold up the
        next forward on the GPU (SaveJob.fence). A job's slots are reserved together, adjacent when the
        arena has a long enough free run: the workers then copy each run in one piece."""
        wanted: dict[tuple[int, bool], dict[str, StorePlan]] = {}
        for plan in plans:
            key = self.key(plan.group, request, plan.key_end)
            if key in self.in_flight_keys or key in self.ssd_keys or self.index.lookup([key])[0]:
                continue
            if any(key in w for w in wanted.values()):
                continue
            wanted.setdefault((plan.group, plan.reason in MUTABLE), {})[key] = plan
        by_job: dict[tuple[int, bool], tuple[list[PageMove], list[str]]] = {}
        for (group, mutable), plan_of in sorted(wanted.items()):
            nbytes = self.layout.object_bytes[group]
            slots = self.index.reserve_many(list(plan_of), nbytes)
            for (key, plan), slot in zip(plan_of.items(), slots):
                if slot is None:
                    self.count("saves_dropped_no_space")
                    continue
                self.in_flight_keys.add(key)
                moves, keys = by_job.setdefault((group, mutable), ([], []))
                moves.append(
                    PageMove(plan.block_id, slot.offset, nbytes, self.prefix_hash(request, plan.key_end))
                )
                keys.append(key)
        self._count_evictions()
        for (group, mutable), (moves, keys) in sorted(by_job.items()):
            job = SaveJob(next(self.job_ids), group, moves, ssd=bool(self.cfg.ssd_dirs), fence=mutable)
            blocks = [m.block_id for m in moves]
            self._pin_gpu_blocks(blocks)
            self.saves[job.job_id] = PendingSave(job, keys, blocks)
            self.unsent_saves.append(job.job_id)

    def _count_evictions(self) -> None:
        evicted = self.index.drain_evicted()
        if evicted:
            self.count("evictions", len(evicted))

    def _pin_gpu_blocks(self, block_ids: list[int]) -> None:
        if self.block_pool is not None:
            self.block_pool.touch([self.block_pool.blocks[b] for b in block_ids])

    def _unpin_gpu_blocks(self, block_ids: list[int]) -> None:
        if self.block_pool is not None:
            self.block_pool.free_blocks([self.block_pool.blocks[b] for b in block_ids])

    # ---------------------------------------------------------------- per step
    def build_meta(self, scheduler_output) -> UMBPConnectorMetadata:
        self.step += 1
        self._expire_unconfirmed_saves()
        self.plan_saves(scheduler_output)
        meta = UMBPConnectorMetadata()
        if self.producer is not None:
            self.producer.poll()
            meta.handoffs_done = self.producer.take_done()
        for job_id in self.unsent_saves:
            meta.saves.append(self.saves[job_id].job)
            self.saves[job_id].sent_step = self.step
        self.unsent_saves = []
        for load in self.loads.values():
            if not load.sent:
                meta.loads.append(load.job)
                load.sent = True
        return meta

    def on_worker_output(self, output) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, UMBPWorkerMetadata):
            self._confirm_saves(meta)
            self.load_failed |= meta.load_failed  # a rank may report before vLLM reports the request
        failed = set(output.failed_recving or ())
        for req_id in output.finished_recving or ():
            load = self.loads.pop(req_id, None)
            if load is None:
                continue
            self.index.unpin(load.keys)
            ok = req_id not in failed and not load.job.poisoned
            for key in load.promoted:
                self.in_flight_keys.discard(key)
                self.index.commit(key) if ok else self.index.abort(key)
            if req_id in failed:
                # a corrupt or vanished object must not be offered again: drop it from every tier's view,
                # and quarantine it so the shared tier's copy is not retried at once either. Only the
                # objects some rank named, when one did: the rest stay offered, and every later load
                # verifies them again; all of them when no rank could tell (an exception, a poisoned load)
                bad = [k for k in load.all_keys if k in self.load_failed] or load.all_keys
                self.index.remove(bad)
                self.ssd_keys.difference_update(bad)
                until = time.monotonic() + self.cfg.quarantine_s
                self.quarantine.update(dict.fromkeys(bad, until))
                self.load_failed.difference_update(load.all_keys)
            if not ok:
                self.count("load_failures")
                logger.warning("umbp: load for request %s failed; vLLM recomputes it", req_id)
            else:
                self.restored[req_id] = load.tokens
                self.count("restored_tokens", load.new_tokens)
                self.count("loaded_objects", len(load.all_keys))
                for tier, n in load.tiers.items():
                    self.count(f"{tier}_loaded_objects", n)
        if not self.loads:
            self.load_failed.clear()  # nothing left to match them to

    def _confirm_saves(self, meta: UMBPWorkerMetadata) -> None:
        self.ssd_keys.difference_update(meta.ssd_evicted)
        for job_id, ranks in meta.ssd_saved.items():
            if job_id in self.saves:
                self.saves[job_id].ssd_confirmed |= ranks
        for job_id, ranks in meta.failed.items():
            if job_id in self.saves:
                self.saves[job_id].failed = True
                self.saves[job_id].confirmed |= ranks
        for job_id, ranks in meta.saved.items():
            if job_id in self.saves:
                self.saves[job_id].confirmed |= ranks
        for job_id in [j for j, s in self.saves.items() if s.confirmed >= self.rank_tags]:
            self._finish_save(self.saves.pop(job_id))

    def _expire_unconfirmed_saves(self) -> None:
        """A save some rank never confirmed (a lost worker) must not pin GPU blocks forever."""
        stale = [j for j, s in self.saves.items() if 0 <= s.sent_step < self.step - SAVE_CONFIRM_STEPS]
        for job_id in stale:
            save = self.saves.pop(job_id)
            save.failed = True
            logger.warning(
                "umbp: save job %d unconfirmed after %d steps; dropped", job_id, SAVE_CONFIRM_STEPS
            )
            self._finish_save(save)

    def _finish_save(self, save: PendingSave) -> None:
        for key in save.keys:
            self.in_flight_keys.discard(key)
            if save.failed:
                self.index.abort(key)
            else:
                self.index.commit(key)
                self.quarantine.pop(key, None)  # freshly written: trustworthy again
        self._unpin_gpu_blocks(save.blocks)
        if save.failed:
            self.count("save_failures", len(save.keys))
            return
        if save.job.ssd and save.ssd_confirmed >= self.rank_tags:
            self.ssd_keys.update(save.keys)
        group = save.job.group
        nbytes = sum(m.nbytes for m in save.job.moves) * len(self.rank_tags)
        self.count("stored_objects", len(save.keys))
        self.count(f"stored_objects_g{group}", len(save.keys))
        self.count("stored_bytes", sum(slot_span(m.nbytes) for m in save.job.moves) * len(self.rank_tags))
        self.count("stored_data_bytes", nbytes)

    # ---------------------------------------------------------------- finish
    def on_partial_tail(self, request, block_ids, offloads) -> None:
        tracked = self.requests.get(request.request_id)
        if tracked is None:
            return
        plans = tracked.planner.step(
            computed_tokens=request.num_computed_tokens,
            hashed_tokens=len(request.block_hashes) * self.layout.unit,
            block_ids=block_ids,
            offloads=offloads,
        )
        self.queue_saves(request, plans)

    def on_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        """Queue the finish-time saves; for a store-mediated hand-off, whether vLLM must wait for it (the
        workers report it finished_sending once visible) and the kv_transfer_params for D."""
        self.restored.pop(request.request_id, None)
        if self.consumer is not None:
            self.consumer.forget(request.request_id)
        tracked = self.requests.pop(request.request_id, None)
        if tracked is None or request.request_id in self.loads:
            return False, None
        plans = tracked.planner.step(
            computed_tokens=request.num_computed_tokens,
            hashed_tokens=len(request.block_hashes) * self.layout.unit,
            block_ids=block_ids,
            finished=True,
        )
        self.queue_saves(request, plans)
        if self.producer is None:
            return False, None
        return self.producer.begin(request, self._hexes(tracked))

    def has_pending_work(self) -> bool:
        """Keep vLLM stepping until every queued save was sent and confirmed by all ranks, and every
        hand-off was confirmed (or given up)."""
        return bool(self.unsent_saves or self.saves) or (self.producer is not None and self.producer.busy())

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_external=True)``: this engine offers nothing it stored before.
        The DRAM tier is emptied and the SSD tier's objects are forgotten by this engine (their files stay, and a
        restarted engine finds them again); the shared tier is left alone, since other instances use it.
        Refused (False, as vLLM expects) while loads or saves are in flight."""
        if self.saves or self.loads:
            return False
        self.index.clear()
        self.ssd_keys.clear()
        return True


def key_head(probe: str) -> str:
    """A key built with the one-byte prefix hash b"\\x00", minus that hash's hex "00": any prefix hash's
    hex completes it into the same key the key function would build."""
    if not probe.endswith(":00"):
        raise RuntimeError(f"umbp: unexpected key layout {probe!r}")
    return probe[:-2]
