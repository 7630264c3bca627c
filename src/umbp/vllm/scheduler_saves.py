"""Save planning and save-job bookkeeping of the scheduler side (part of SchedulerSide).

Per step the planner of every busy request says what to store; each object gets a reserved DRAM slot and
goes out in one save job per group and kind. A key becomes visible to lookups only after every rank
confirmed its save, and the GPU blocks a job reads stay pinned until then. A job some rank never confirms
is given up after SAVE_CONFIRM_STEPS steps (its keys never become visible, its blocks are unpinned).

A mixin rather than a separate object: the saves share the side's index, key derivation, counters and
request table with the lookups and loads, and every one of them is touched on the same single-threaded
scheduler step; the split is by responsibility, so each module reads on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from umbp.hybrid import StorePlan
from umbp.hybrid.planner import BOUNDARY_PAGE, BOUNDARY_STATE, PROMPT_TAIL
from umbp.vllm.kv_layout import slot_span
from umbp.vllm.metadata import PageMove, SaveJob, UMBPWorkerMetadata

logger = logging.getLogger("umbp.vllm")

SAVE_CONFIRM_STEPS = 64  # steps after which an unconfirmed save is given up (its keys never become visible)
# plans whose pages a running request's next forward may rewrite
MUTABLE = (BOUNDARY_PAGE, BOUNDARY_STATE, PROMPT_TAIL)


@dataclass
class PendingSave:
    job: SaveJob
    keys: list[str]
    blocks: list[int]  # GPU blocks pinned until every rank confirmed
    confirmed: set[str] = field(default_factory=set)
    ssd_confirmed: set[str] = field(default_factory=set)
    failed: bool = False
    sent_step: int = -1


class SaveMixin:
    """SchedulerSide's saves; the attributes it uses are set by SchedulerSide.__init__."""

    def plan_saves(self, scheduler_output) -> None:
        state = scheduler_output.kv_connector_block_state
        if state is None:
            return
        for req_id in sorted(scheduler_output.preempted_req_ids or ()):
            if req_id in self.requests:
                self.requests[req_id].planner.reset()
                self.requests[req_id].forget_hashes()
                self.settled.discard(req_id)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens or {}
        offloads_of, scheduled_of, unit = (
            state.boundary_state_offloads,
            scheduler_output.num_scheduled_tokens,
            self.layout.unit,
        )
        busy = []  # most decode steps leave every planner idle: then no block tables are built (vLLM makes
        settled = self.settled  # a list per group and request; that was ~3/4 of umbp's step cost)
        for req_id in state.req_ids:
            if req_id in settled and req_id not in offloads_of:
                continue  # one set lookup per decoding request (see settled in SchedulerSide)
            tracked = self.requests.get(req_id)
            if tracked is None or req_id in self.loads:
                continue
            request = tracked.request
            computed = (
                request.num_computed_tokens + scheduled_of.get(req_id, 0) - len(spec_tokens.get(req_id, ()))
            )
            hashed = len(request.block_hashes) * unit
            offloads = offloads_of.get(req_id, ())
            planner = tracked.planner
            if offloads or not planner.idle(computed, hashed):
                settled.discard(req_id)
                busy.append((req_id, computed, hashed, offloads))
            elif planner.store_limit is not None and min(computed, hashed) >= planner.store_limit:
                # idle with every key limit at the store limit: idle() can only change through step()
                # or reset(), so until one of them runs this request is skipped
                settled.add(req_id)
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
        if not self.stages.ready:
            if plans:  # pipeline parallel, before every stage reported its layout (umbp.vllm.stages)
                self.count("saves_dropped_layout_pending", len(plans))
                tracked = self.requests.get(request.request_id)
                if tracked is not None:
                    tracked.unsaved = True  # a store-mediated hand-off of it would never complete
            return
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
            nbytes = self.slot_bytes[group]
            slots = self.index.reserve_many(list(plan_of), nbytes)
            for (key, plan), slot in zip(plan_of.items(), slots):
                if slot is None:
                    self.count("saves_dropped_no_space")
                    tracked = self.requests.get(request.request_id)
                    if tracked is not None:
                        tracked.unsaved = True  # a store-mediated hand-off of it would never complete
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

    def _confirm_saves(self, meta: UMBPWorkerMetadata) -> None:
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

    def publish(self, keys: list[str], group: int, hashes: list[bytes]) -> bool:
        """Write objects this side holds in DRAM to the shared tier again (store-mediated P/D: it lost
        them, and no save writes them while DRAM has them): a job of their slots, pinned until every rank
        confirmed. False (nothing queued) when one of them is not in DRAM."""
        slots = self.index.pin(keys)
        if any(s is None for s in slots):
            self.index.unpin([k for k, s in zip(keys, slots, strict=True) if s is not None])
            return False
        nbytes = self.slot_bytes[group]
        moves = [PageMove(-1, s.offset, nbytes, h) for s, h in zip(slots, hashes, strict=True)]
        job = SaveJob(next(self.job_ids), group, moves, fence=False, publish=True)
        self.saves[job.job_id] = PendingSave(job, keys, [])
        self.unsent_saves.append(job.job_id)
        self.count("republished_objects", len(keys))
        return True

    def _finish_save(self, save: PendingSave) -> None:
        if save.job.publish:  # the slots were only read: they stay committed
            self.index.unpin(save.keys)
            return
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
        if self.producer is not None:  # their shared-tier writes may still be queued (handoff.Producer)
            self.producer.saved(save.keys)
        if save.job.ssd and save.ssd_confirmed >= self.rank_tags:
            self.ssd_keys.update(save.keys)
        group, objects = save.job.group, len(save.job.moves)
        self.count("stored_objects", len(save.keys))
        self.count(f"stored_objects_g{group}", len(save.keys))
        self.count("stored_bytes", sum(slot_span(m.nbytes) for m in save.job.moves) * len(self.rank_tags))
        self.count("stored_data_bytes", self.data_bytes[group] * objects)
