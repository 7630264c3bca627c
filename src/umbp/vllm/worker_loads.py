"""The worker's load path: verified copies from umbp's tiers into vLLM's paged KV cache.

A load's DRAM objects are checked against the slot records the save path left (key and checksum) and copied
in by the transfer engine, which verifies each against its checksum before it writes; SSD and shared-tier
objects are read on I/O threads (a slow disk or server must not stall the engine's step), verified by their
tier, promoted into their reserved DRAM slot when they have one, then copied in the same way. Any missing or
corrupt object fails the whole load: vLLM recomputes, never reads wrong bytes. Split from
:mod:`umbp.vllm.worker` (the save path and the reports), whose :class:`~umbp.vllm.worker.WorkerSide` mixes
this in and owns the state it uses (arena, engine, slots, tiers, counters).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from umbp.pool.checksum import checksum
from umbp.transfer import Handle, Moves
from umbp.vllm.kv_layout import slot_span
from umbp.vllm.metadata import LoadJob, PageMove, UMBPConnectorMetadata
from umbp.vllm.tiers import logical_key, logical_of

logger = logging.getLogger("umbp.vllm")

LOAD_IO_THREADS = 2  # tier reads of loads in parallel (each tier call is itself batched and threaded)


@dataclass
class TierRead:
    group: int
    move: PageMove
    key: str
    data: torch.Tensor
    digest: int | None  # psum64 of the promoted DRAM slot, None when there was no slot to promote into


@dataclass
class PendingLoad:
    job: LoadJob
    ok: bool = True
    reads: Future | None = None  # tier reads in flight on an I/O thread
    handle: Handle | None = None  # device copies in flight
    slotted: dict[int, tuple[list[int], list[int], list[int]]] = field(default_factory=dict)
    unslotted: dict[int, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    batch: list[Moves] = field(default_factory=list)
    first: int = 0  # where `batch` starts in the handle's (a step's DRAM loads share one engine call)
    bad: set[str] = field(default_factory=set)  # logical keys this load found missing or corrupt

    def add(self, group: int, block_id: int, offset: int, digest: int) -> None:
        ids, offs, digs = self.slotted.setdefault(group, ([], [], []))
        ids.append(block_id)
        offs.append(offset)
        digs.append(digest)


class LoadPath:
    """The load half of the worker side (see the module docstring); every attribute it reads is set by
    ``WorkerSide.__init__``."""

    def load(self, meta: UMBPConnectorMetadata) -> None:
        """Start every load; each is reported finished (or failed) by `take_transfer_results` once its
        tier reads (on I/O threads) and device copies are done. vLLM keeps the request waiting meanwhile
        and never frees its blocks before the report."""
        if self.suspended:  # nothing to write into yet: vLLM keeps the request waiting meanwhile
            self.deferred_loads += meta.loads
            return
        ready = []  # loads of DRAM objects only: their copies start now, in one engine call
        for job in meta.loads:
            task = PendingLoad(job)
            self.pending_loads.append(task)
            if job.poisoned:
                task.ok = False
                continue
            self._guard(task, self._start_load, task)
            if task.ok and task.reads is None:
                ready.append(task)
        self._copy_in(ready)
        self.poll_loads()

    def _guard(self, task: PendingLoad, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a failed load is a recompute, never a crash
            logger.exception("umbp: load for request %s failed on rank %s", task.job.req_id, self.rank.tag())
            task.ok = False
            task.bad |= self._keys_of(task)  # which object is at fault is unknown: none is trusted

    def _keys_of(self, task: PendingLoad) -> set[str]:
        return {self._logical(g, m.prefix_hash) for g, moves in task.job.moves.items() for m in moves}

    def _logical(self, group: int, prefix_hash: bytes) -> str:
        return logical_key(self.layout.namespace, group, prefix_hash)

    def _start_load(self, task: PendingLoad) -> None:
        """Verify every DRAM object's slot now; read tier objects on an I/O thread (a slow disk or server
        must not stall the engine's step); the device copies start when all bytes are in the arena."""
        tier_moves = []
        for group, moves in sorted(task.job.moves.items()):
            pages = self.groups.get(group)
            if pages is None:
                continue
            for move in moves:
                if move.source in ("ssd", "remote"):
                    tier_moves.append((group, move, pages.object_bytes))
                    continue
                digest = self._slot_digest(move.offset, self.rank_key(group, move.prefix_hash))
                if digest is None:
                    task.bad.add(self._logical(group, move.prefix_hash))
                    task.ok = False
                    return
                task.add(group, move.block_id, move.offset, digest)
        if tier_moves:
            task.reads = self._io().submit(self._read_tiers, tier_moves)

    def _slot_digest(self, offset: int, expected: str) -> int | None:
        held = self.slots.get(offset)
        if held is None or held[0] != expected:
            logger.warning("umbp: slot %d does not hold %s; treating as a miss", offset, expected)
            return None
        return held[1]

    def _io(self) -> ThreadPoolExecutor:
        if self.io is None:
            self.io = ThreadPoolExecutor(LOAD_IO_THREADS, thread_name_prefix="umbp-load")
        return self.io

    def _read_tiers(self, tier_moves: list[tuple[int, PageMove, int]]) -> tuple[list[TierRead], str | None]:
        """On an I/O thread: every tier object, in one batched read per tier (the SSD tier reads them in
        parallel, the shared tier answers in one pipelined round trip; object by object, a restore waited
        for each in turn), checksum-verified by its tier, then promoted into its reserved DRAM slot when
        it has one (only this load writes that slot). An object with a slot is read straight into it (no
        second copy; aligned, so the SSD tier reads it with O_DIRECT in place) and then summed for the
        slot's record. Returns (reads, the logical key of the first object a tier did not return, or
        None)."""
        keys = [self.rank_key(group, move.prefix_hash) for group, move, _n in tier_moves]
        datas = [
            torch.from_numpy(self.arena.view(move.promote_offset, nbytes))
            if move.promote_offset >= 0
            else torch.empty(nbytes, dtype=torch.uint8)
            for _g, move, nbytes in tier_moves
        ]
        got = [False] * len(tier_moves)
        for source, tier in (("ssd", self.ssd), ("remote", self.remote)):
            idx = [i for i, (_g, move, _n) in enumerate(tier_moves) if move.source == source]
            if idx and tier is not None:
                oks = tier.get_into([keys[i] for i in idx], [datas[i].numpy() for i in idx])
                for i, ok in zip(idx, oks, strict=True):
                    got[i] = ok
        out = []
        for (group, move, _n), key, data, ok in zip(tier_moves, keys, datas, got, strict=True):
            if not ok:
                logger.warning("umbp: %s tier did not return %s; a miss", move.source, key)
                return out, self._logical(group, move.prefix_hash)
            digest = checksum(data.numpy()) if move.promote_offset >= 0 else None
            out.append(TierRead(group, move, key, data, digest))
        return out, None

    def _tiers_read(self, task: PendingLoad) -> None:
        """Back on the engine's thread: record promoted slots, queue the rest for a scatter, copy in."""
        reads, missing = task.reads.result()
        task.reads = None
        if missing is not None:
            task.bad.add(missing)
            task.ok = False
            return
        for r in reads:
            self.count(f"{r.move.source}_loaded_bytes", r.data.numel())
            if r.digest is not None:
                self.slots[r.move.promote_offset] = (r.key, r.digest)
                task.add(r.group, r.move.block_id, r.move.promote_offset, r.digest)
            else:
                task.unslotted.setdefault(r.group, []).append((r.move.block_id, r.data))
        self._copy_in([task])

    def _copy_in(self, tasks: list[PendingLoad]) -> None:
        """One bulk load for every slotted object of these loads (the engine verifies each against its
        digest before it writes): an engine call costs ~0.6 ms of host time on CUDA, and several
        restores can start in one step. Tier objects without a slot are scattered directly (their tier
        verified them). A combined call the engine refuses is retried load by load."""
        live = []
        for task in tasks:
            self._guard(task, self._scatter_unslotted, task)
            if task.ok and task.batch:
                live.append(task)
        together = self._together(self.engine.load, [task.batch for task in live])
        if together is not None:
            handle, firsts = together
            for task, first in zip(live, firsts, strict=True):
                task.handle, task.first = handle, first
            return
        for task in live:
            self._guard(task, self._load_alone, task)

    def _scatter_unslotted(self, task: PendingLoad) -> None:
        for group, rows in task.unslotted.items():
            data = torch.stack([d for _, d in rows])
            self.groups[group].scatter([b for b, _ in rows], data)
            self.count("loaded_bytes", data.numel())
        task.batch = [
            Moves(g, ids, offs, digs if self.cfg.checksum else None, self._reach(task, g))
            for g, (ids, offs, digs) in sorted(task.slotted.items())
        ]

    def _reach(self, task: PendingLoad, group: int) -> int:
        """How far each of the group's slots reaches: the scheduler sizes them for the largest rank's
        object (a pipeline stage may hold fewer layers than another), never less than this rank's."""
        reserved = max((m.nbytes for m in task.job.moves.get(group, ())), default=0)
        return slot_span(max(self.groups[group].object_bytes, reserved))

    def _load_alone(self, task: PendingLoad) -> None:
        task.handle, task.first = self.engine.load(task.batch), 0

    def _copied(self, task: PendingLoad) -> None:
        results = task.handle.result()[task.first : task.first + len(task.batch)]
        task.handle = None
        for moves, written in zip(task.batch, results):
            for offset, ok in zip(moves.offsets, written):
                if not ok:
                    logger.warning("umbp: checksum mismatch in slot %d; treating as a miss", offset)
                    held = self.slots.pop(offset, None)
                    task.bad |= {logical_of(held[0])} if held is not None else self._keys_of(task)
                    self.count("checksum_failures")
        if not all(all(w) for w in results):
            task.ok = False
            return
        self.count(
            "loaded_bytes", sum(len(m.block_ids) * self.groups[m.group].object_bytes for m in task.batch)
        )

    def poll_loads(self, wait: bool = False) -> None:
        """Advance every load as far as it can go without waiting (or to the end, with wait)."""
        keep = []
        for task in self.pending_loads:
            if task.ok and task.reads is not None and (wait or task.reads.done()):
                self._guard(task, self._tiers_read, task)
            if task.ok and task.handle is not None and (wait or task.handle.done()):
                self._guard(task, self._copied, task)
            if not task.ok or (task.reads is None and task.handle is None):
                self._report(task)
            else:
                keep.append(task)
        self.pending_loads = keep

    def _report(self, task: PendingLoad) -> None:
        self.finished_loads.add(task.job.req_id)
        if not task.ok:
            self.failed_loads.add(task.job.req_id)
            self.load_failed |= task.bad or self._keys_of(task)
            self.count("load_failures_rank")
