"""Scheduler side of the UMBPConnector (embedded mode).

The scheduler process owns the DRAM tier's index and slot allocation; every worker owns an arena whose
slot offsets mirror it. Per step this side decides:

* lookups: the longest boundary at which every group of the prompt is held (``umbp.hybrid``);
* loads: which stored objects go into which freshly allocated GPU blocks (asynchronous; a failed load is
  reported through vLLM's ``failed_recving`` path, so vLLM recomputes);
* saves: what the planner says to store, each into a reserved slot; a key becomes visible to lookups only
  after every rank confirmed its save, and the GPU blocks it reads stay pinned until then.

The lookups live in umbp.vllm.scheduler_lookup, the save planning and save-job bookkeeping in
umbp.vllm.scheduler_saves, the per-request and per-load records in umbp.vllm.scheduler_state; this module
keeps the side's state, the loads and the per-step and finish hooks.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence

from umbp.hybrid import RequestStorePlanner
from umbp.hybrid.groups import FullAttention
from umbp.hybrid.tail import tail_span
from umbp.identity import object_key
from umbp.pool import DramIndex
from umbp.vllm.config import ARENA_PAGE, ConfigError, UMBPConfig
from umbp.vllm.handoff import Consumer, Producer
from umbp.vllm.kv_layout import Layout
from umbp.vllm.metadata import LoadJob, PageMove, UMBPConnectorMetadata, UMBPWorkerMetadata
from umbp.vllm.scheduler_lookup import REMOTE_REUSE_S, LookupMixin
from umbp.vllm.scheduler_saves import SAVE_CONFIRM_STEPS, PendingSave, SaveMixin
from umbp.vllm.scheduler_state import PendingLoad, TrackedRequest, key_head
from umbp.vllm.stages import StageLayouts
from umbp.vllm.stats import UMBPStats
from umbp.vllm.tail_hashes import tail_prefix_hash
from umbp.vllm.tiers import logical_key, renamed, scan_ssd

logger = logging.getLogger("umbp.vllm")

__all__ = [
    "REMOTE_REUSE_S",
    "SAVE_CONFIRM_STEPS",
    "PendingLoad",
    "PendingSave",
    "SchedulerSide",
    "TrackedRequest",
    "key_head",
    "logical_key",
]


class SchedulerSide(LookupMixin, SaveMixin):
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
            max_evict_objects=1024,  # a ~3 ms eviction per step at most, not 10% of 30 M
            expected_objects=most_objects(cfg.dram_bytes, layout.object_bytes),
        )
        self.rank_tags = {r.tag() for r in layout.ranks}
        self.requests: dict[str, TrackedRequest] = {}
        # requests whose planner has nothing left to plan until the request finishes or is preempted (all
        # of the prompt computed and hashed, decode saves off): plan_saves skips them, which at 256
        # requests of 128K tokens was most of umbp's decode-step cost (memory latency per request)
        self.settled: set[str] = set()
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
        # every rank's namespace and object sizes (umbp.vllm.stages): known at once without pipeline
        # parallelism; with it, from the workers' first reports, and until then nothing is offered or saved
        self.stages = StageLayouts(layout)
        # set by _stages_ready; nothing is saved or loaded before it runs
        self.slot_bytes: tuple[int, ...] = ()  # per group: what a DRAM slot takes (largest rank's object)
        self.data_bytes: tuple[int, ...] = ()  # per group: one logical object's bytes over all ranks
        self._rank_heads: list[list[str | None]] = []  # per rank and group (None: holds no layer of it)
        self._aliases: dict[str, str] = {}  # other ranks' namespaces -> this side's (reported keys)
        if self.stages.ready:
            self._stages_ready()
        else:
            logger.info(
                "umbp: pipeline_parallel_size=%d: waiting for every stage's layout (vLLM's start-up handshake, "
                "else the first step's output); requests scheduled before then are neither restored nor saved",
                layout.pp,
            )
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

    def _stages_ready(self) -> None:
        """Every rank's layout is known: size slots for the largest rank's object, name each rank's
        objects under its own namespace, and find what the SSD tiers hold from earlier runs."""
        coords = {r.tag(): r for r in self.layout.ranks}
        ranks = self.stages.ranks()
        self.slot_bytes, self.data_bytes = self.stages.slot_bytes(), self.stages.data_bytes()
        self._aliases = self.stages.aliases()
        groups = range(len(self.layout.groups))
        self._rank_heads = [
            [
                key_head(object_key(r.namespace, coords[tag], g, b"\x00")) if r.object_bytes[g] else None
                for g in groups
            ]
            for tag, r in ranks
        ]
        if self.layout.pp > 1:
            sizes = {tag: r.object_bytes for tag, r in ranks}
            logger.info("umbp: every pipeline stage reported its layout; object bytes per rank %s", sizes)
        if self.cfg.ssd_dirs:
            held = [(coords[tag], r.namespace, [n > 0 for n in r.object_bytes]) for tag, r in ranks]
            self.ssd_keys |= scan_ssd(self.cfg.ssd_dirs, self.layout.namespace, held)
            logger.info("umbp: SSD tier holds %d objects from earlier runs", len(self.ssd_keys))

    def learn_layouts(self, reports: dict) -> None:
        """Ranks' layouts, from vLLM's start-up handshake or from the workers' step output."""
        if self.stages.learn(reports):
            self._stages_ready()

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
                move = PageMove(table[idx], -1, self.slot_bytes[g], self.prefix_hash(request, end))
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

    # ---------------------------------------------------------------- per step
    def build_meta(self, scheduler_output) -> UMBPConnectorMetadata:
        self.step += 1
        self._expire_unconfirmed_saves()
        self.plan_saves(scheduler_output)
        meta = UMBPConnectorMetadata(layouts_known=self.stages.ready)
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
            if meta.layouts:
                self.learn_layouts(meta.layouts)
            self.ssd_keys.difference_update(renamed(meta.ssd_evicted, self._aliases))
            self._confirm_saves(meta)
            # a rank may report a failed load before vLLM reports the request
            self.load_failed |= renamed(meta.load_failed, self._aliases)
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
                if req_id in self.requests:  # else aborted while loading: on_finished already forgot it
                    self.restored[req_id] = load.tokens
                    self.count("restored_tokens", load.new_tokens)
                self.count("loaded_objects", len(load.all_keys))
                for tier, n in load.tiers.items():
                    self.count(f"{tier}_loaded_objects", n)
        if not self.loads:
            self.load_failed.clear()  # nothing left to match them to

    # ---------------------------------------------------------------- finish
    def on_partial_tail(self, request, block_ids, offloads) -> None:
        tracked = self.requests.get(request.request_id)
        if tracked is None:
            return
        self.settled.discard(request.request_id)
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
        self.settled.discard(request.request_id)
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
        return self.producer.begin(request, self._hexes(tracked), complete=not tracked.unsaved)

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


def most_objects(dram_bytes: int, object_bytes: Sequence[int]) -> int:
    """How many objects the DRAM tier can hold at most (all of the smallest kind): the index is sized for
    them at start, so it never grows in the step loop."""
    # a group stage 0 holds no layer of (pipeline parallel) stores objects of another stage's size, not 0
    sizes = [n for n in object_bytes if n]
    smallest = max(1, -(-min(sizes, default=ARENA_PAGE) // ARENA_PAGE))  # arena pages
    return dram_bytes // ARENA_PAGE // smallest
