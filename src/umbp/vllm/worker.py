"""Worker side of the UMBPConnector (embedded mode): this rank's arena and the copies in and out of it.

Every object written here is remembered with the rank-local key it was saved under and its checksum, so a
load verifies that the slot still holds exactly the object the scheduler asked for; any mismatch is a
failed load (vLLM recomputes), never wrong bytes in the KV cache.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from umbp.identity import RankCoord, object_key
from umbp.pool import Arena, Pool
from umbp.pool.checksum import checksum
from umbp.pool.composition import TierStack
from umbp.transfer import Handle, Moves, make_engine
from umbp.vllm.config import ARENA_PAGE, UMBPConfig
from umbp.vllm.kv_layout import Layout
from umbp.vllm.metadata import LoadJob, PageMove, SaveJob, UMBPConnectorMetadata, UMBPWorkerMetadata
from umbp.vllm.pages import GroupPages, group_pages
from umbp.vllm.stats import UMBPStats
from umbp.vllm.tiers import logical_key, logical_of, rank_dir

logger = logging.getLogger("umbp.vllm")


def current_rank() -> RankCoord:
    """This worker's parallel coordinates from vLLM's parallel state (all 0 when it is not initialised).

    The DCP and PCP ranks are read from their own groups, never derived: the shard a rank's attention page
    holds is decided by its DCP rank (vLLM's slot mapping), so its key must carry exactly that one."""
    try:
        from vllm.distributed import parallel_state as ps

        tp = ps.get_tensor_model_parallel_rank()
        pp = ps.get_pp_group().rank_in_group
    except Exception:  # noqa: BLE001 - no distributed state (single process tests)
        return RankCoord()
    return RankCoord(tp=tp, pcp=_group_rank(ps, "get_pcp_group"), dcp=_group_rank(ps, "get_dcp_group"), pp=pp)


def _group_rank(ps, getter: str) -> int:
    """Rank in a DCP/PCP group; 0 when vLLM did not build that group (its size is then 1)."""
    try:
        return getattr(ps, getter)().rank_in_group
    except (AssertionError, AttributeError):
        return 0


LOAD_IO_THREADS = 2  # tier reads of loads in parallel (each tier call is itself batched and threaded)


@dataclass
class PendingSave:
    job: SaveJob
    handle: Handle
    started: int  # the worker's poll count when the copies were started
    first: int = 0  # this job's Moves in the handle's batch (a step's jobs share one engine call)
    feed: Future | None = None  # handing its objects to the SSD / shared tiers, on the feeder thread
    finished: bool = False  # confirmed (or failed) in this worker's metadata


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


def slot_span(nbytes: int) -> int:
    """How far a slot the scheduler reserved for nbytes reaches: whole arena pages, pad included. Slots
    reserved together touch end to start, and the transfer engine copies such a run in one piece."""
    return -(-nbytes // ARENA_PAGE) * ARENA_PAGE


class WorkerSide:
    def __init__(self, cfg: UMBPConfig, layout: Layout, kv_cache_config, rank: RankCoord | None = None):
        self.cfg = cfg
        self.layout = layout
        self.kv_cache_config = kv_cache_config
        self.rank = rank if rank is not None else current_rank()
        self.groups: dict[int, GroupPages] = {}
        self.arena: Arena | None = None
        self.lower = TierStack([])  # the tiers below the arena: this rank's SSD tier, the shared tier
        self.ssd_saved: dict[int, set[str]] = {}
        self.slots: dict[int, tuple[str, int]] = {}  # arena offset -> (rank-local key, checksum)
        self.saved: dict[int, set[str]] = {}
        self.failed: dict[int, set[str]] = {}
        self.finished_loads: set[str] = set()
        self.delivered: set[str] = set()  # store-mediated hand-offs the scheduler confirmed: finished_sending
        self.failed_loads: set[str] = set()
        self.load_failed: set[str] = set()  # logical keys of failed loads, for the next worker metadata
        self.pending_saves: list[PendingSave] = []  # copies started, not yet finished
        self.pending_loads: list[PendingLoad] = []  # reads or copies in flight, not yet reported
        self.polls = 0  # steps seen (take_worker_meta calls): bounds how late a confirmation may be
        self.suspended = False  # the KV cache's memory is released (sleep mode): no copy may touch it
        self.deferred_loads: list[LoadJob] = []  # asked for while suspended: started by resume()
        self.io: ThreadPoolExecutor | None = None  # tier reads of loads
        self.feeder: ThreadPoolExecutor | None = None  # hands saved objects to the SSD / shared tiers
        self.stats = UMBPStats()  # this interval's counters, handed to vLLM each step
        self.totals: Counter[str] = Counter()  # since start, for `umbp stats`-style inspection and tests

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.rank not in self.layout.ranks:
            # the scheduler waits for a confirmation from every rank it expects: a rank it does not know
            # would make every save of this deployment unconfirmable
            raise RuntimeError(
                f"umbp: this worker's parallel rank {self.rank.tag()} is not one the scheduler expects "
                f"({', '.join(r.tag() for r in self.layout.ranks)}); check the TP/PCP/DCP/PP sizes"
            )
        num_blocks = self.kv_cache_config.num_blocks
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
            pages = group_pages(kv_caches, list(group.layer_names), num_blocks)
            if pages is None:
                continue
            if pages.object_bytes > self.layout.object_bytes[g]:
                raise ValueError(
                    f"umbp: group {g}'s pages take {pages.object_bytes} bytes on this rank but the scheduler "
                    f"reserves {self.layout.object_bytes[g]}; this KV-cache layout is not supported yet"
                )
            self.groups[g] = pages
        pinned = {"auto": "auto", "on": True, "off": False}[self.cfg.pinned]
        self.arena = Arena(self.cfg.dram_bytes, pinned=pinned, prefault=False)
        layers = {g: [(layer.tensor, layer.block_dim) for layer in p.layers] for g, p in self.groups.items()}
        self.engine = make_engine(self.arena, layers)  # Triton kernels on CUDA, staged copies on CPU
        self._warm_up()
        ssd = None
        if self.cfg.ssd_dirs:
            from umbp.pool.ssd.tier import SsdTier

            dirs = [rank_dir(d, self.layout.namespace, self.rank) for d in self.cfg.ssd_dirs]
            ssd = SsdTier(dirs, self.cfg.ssd_bytes, track_evicted=True, prefault=False)
        self.lower = TierStack([ssd, self.cfg.remote_tier()])
        if self.lower:
            self.feeder = ThreadPoolExecutor(1, thread_name_prefix="umbp-tier-feed")
            atexit.register(self.close)  # queued writes must reach the disk/server without a clean shutdown
        logger.info(
            "umbp: rank %s arena %.2f GiB, groups %s",
            self.rank.tag(),
            self.cfg.dram_bytes / 2**30,
            {g: p.object_bytes for g, p in self.groups.items()},
        )

    def _warm_up(self) -> None:
        """Compile the transfer kernels before serving, not at the first save or load of a request. Block 0
        is vLLM's null block, never a request's, and the arena holds nothing yet; the block gets its own
        bytes back. A failure here only costs that stall later."""
        if not self.groups or self.arena.capacity_bytes < max(p.object_bytes for p in self.groups.values()):
            return
        t0 = time.perf_counter()
        try:
            self.engine.warm_up(block=0, offset=0, verify=self.cfg.checksum)
        except Exception:  # noqa: BLE001 - serving works without it
            logger.warning("umbp: transfer warm-up failed; kernels compile at first use", exc_info=True)
            return
        if self.engine.backend == "kernel":
            logger.info("umbp: transfer kernels ready in %.2f s", time.perf_counter() - t0)

    @property
    def ssd(self) -> Pool | None:
        """This rank's own restart-surviving tier (the SSD tier), when one is configured."""
        return self.lower.persistent

    @property
    def remote(self) -> Pool | None:
        """The tier every rank and instance shares (Redis/Valkey), when one is configured."""
        return self.lower.shared

    def rank_key(self, group: int, prefix_hash: bytes) -> str:
        return object_key(self.layout.namespace, self.rank, group, prefix_hash)

    def count(self, key: str, value: int = 1) -> None:
        self.stats.add(key, value)
        self.totals[key] += value

    # ---------------------------------------------------------------- saves
    def before_forward(self) -> None:
        """Called before each forward: it must not rewrite a page a save started earlier still reads. Only
        jobs of such pages (SaveJob.fence) make it wait; full blocks copy on beside the forward."""
        fenced = {id(p.handle): p.handle for p in self.pending_saves if p.job.fence}
        for handle in fenced.values():
            self.engine.fence(handle)

    def save(self, meta: UMBPConnectorMetadata) -> None:
        """Start every job's copies; each is finished (slots recorded, tiers fed, confirmed) once its
        copies are done: at once on CPU, on a later poll on CUDA so the copies overlap the host's work.
        The step's jobs go to the engine in one call per fence kind: each call costs ~0.6 ms of host
        time on CUDA whatever its size (docs/vllm.md), and a step can carry a dozen jobs."""
        ready: dict[bool, list[tuple[SaveJob, Moves]]] = {True: [], False: []}
        for job in meta.saves:
            if self.suspended:  # the pages are not there: never store what the released memory holds
                self._refuse_save(job)
                continue
            try:
                moves = self._start_save(job)
            except Exception:  # noqa: BLE001 - a failed save is a future miss, never a crash
                self._save_failed(job)
                continue
            if moves is None:
                self._confirm(job)
            else:
                ready[job.fence].append((job, moves))
        for part in ready.values():
            if part:
                self._submit_saves(part)
        self.poll_saves()

    def _submit_saves(self, part: list[tuple[SaveJob, Moves]]) -> None:
        together = self._together(self.engine.save, [[moves] for _job, moves in part])
        if together is not None:
            handle, firsts = together
            self.pending_saves += [
                PendingSave(job, handle, self.polls, first)
                for (job, _moves), first in zip(part, firsts, strict=True)
            ]
            return
        for job, moves in part:
            try:
                handle = self.engine.save([moves])  # one bulk gather + copy, checksummed
            except Exception:  # noqa: BLE001 - a failed save is a future miss, never a crash
                self._save_failed(job)
                continue
            self.pending_saves.append(PendingSave(job, handle, self.polls))

    def _together(self, call, batches: list[list[Moves]]) -> tuple[Handle, list[int]] | None:
        """Start several jobs' copies in one engine call (`call`: engine.save or engine.load): a call costs
        ~0.6 ms of host time on CUDA whatever its size, and a step can carry a dozen jobs. Returns the
        handle and where each job's Moves start in its batch; None for fewer than two jobs, or when the
        engine refuses the combined call: the caller then starts each job alone, so a bad job fails alone."""
        if len(batches) < 2:
            return None
        try:
            handle = call([moves for batch in batches for moves in batch])
        except Exception:  # noqa: BLE001 - find the bad job alone: the others must still run
            logger.warning("umbp: a combined transfer failed; retrying job by job", exc_info=True)
            return None
        return handle, list(itertools.accumulate((len(b) for b in batches[:-1]), initial=0))

    def _start_save(self, job: SaveJob) -> Moves | None:
        """The job's copies, checked; None when this rank holds no layer of its group (pipeline
        parallel). Its slots are invalid from here until the copy is done."""
        pages = self.groups.get(job.group)
        if pages is None:
            return None
        nbytes = pages.object_bytes
        if nbytes > min(m.nbytes for m in job.moves):
            raise ValueError(f"umbp: page of {nbytes} bytes exceeds its slot of {job.moves[0].nbytes}")
        for move in job.moves:
            self.slots.pop(move.offset, None)  # being rewritten: invalid until the copy is done
        return Moves(
            job.group,
            [m.block_id for m in job.moves],
            [m.offset for m in job.moves],
            slot_bytes=slot_span(max(m.nbytes for m in job.moves)),
        )

    def poll_saves(self, wait_older: bool = False) -> None:
        """Finish the saves whose copies (then tier writes) are done; with wait_older, wait for those
        started before this step's poll, so a confirmation is at most one step late (the scheduler pins
        GPU blocks till then)."""
        for pending in self.pending_saves:
            self._advance_save(pending, wait=wait_older and pending.started < self.polls)
        self.pending_saves = [p for p in self.pending_saves if not p.finished]

    def _advance_save(self, pending: PendingSave, wait: bool) -> None:
        """Take a save as far as it can go: past its copies, then past its tier writes (to confirmation);
        with wait, to the end."""
        if pending.feed is None and not pending.finished and (wait or pending.handle.done()):
            self._save_copied(pending)
        if pending.feed is not None and not pending.finished and (wait or pending.feed.done()):
            self._save_fed(pending)

    def _save_copied(self, pending: PendingSave) -> None:
        """The copies are done: record the slots; then confirm, or first hand the objects to the tiers.
        Copying them into the SSD staging buffer or the shared tier's queue (a memcpy and a checksum of
        every byte saved) runs on the feeder thread, beside the next forward, not in the engine's step;
        the save is confirmed after it, so the scheduler does not reuse the arena slots before then."""
        job = pending.job
        try:
            digests = [int(d) for d in pending.handle.result()[pending.first]]
            keys, views = self._record_save(job, digests)
        except Exception:  # noqa: BLE001 - a failed save is a future miss, never a crash
            self._save_failed(job)
            pending.finished = True
            return
        if self.feeder is None or not ((job.ssd and self.ssd is not None) or self.remote is not None):
            self._confirm(job)
            pending.finished = True
            return
        pending.feed = self.feeder.submit(self._feed_tiers, job.ssd, keys, views, digests)

    def _save_fed(self, pending: PendingSave) -> None:
        job = pending.job
        try:
            ssd_queued, remote_sent = pending.feed.result()
        except Exception:  # noqa: BLE001 - the tiers missed these objects (counted); DRAM still has them
            logger.exception("umbp: handing save job %d to the SSD / shared tier failed", job.job_id)
            missed = [False] * len(job.moves)
            ssd_queued = missed if job.ssd and self.ssd is not None else None
            remote_sent = missed if self.remote is not None else None
        if ssd_queued is not None:
            if all(ssd_queued):
                self.ssd_saved.setdefault(job.job_id, set()).add(self.rank.tag())
            else:
                self.count("ssd_saves_dropped", ssd_queued.count(False))
        if remote_sent is not None:
            self.count("remote_saves_queued", remote_sent.count(True))
            self.count("remote_saves_dropped", remote_sent.count(False))
        pending.finished = True
        self._confirm(job)

    def _confirm(self, job: SaveJob) -> None:
        self.saved.setdefault(job.job_id, set()).add(self.rank.tag())

    def _refuse_save(self, job: SaveJob) -> None:
        for move in job.moves:
            self.slots.pop(move.offset, None)
        self.failed.setdefault(job.job_id, set()).add(self.rank.tag())
        self.count("save_failures", len(job.moves))

    def _save_failed(self, job: SaveJob) -> None:
        logger.exception("umbp: save job %d failed on rank %s", job.job_id, self.rank.tag())
        self._refuse_save(job)

    def _record_save(self, job: SaveJob, digests: list[int]) -> tuple[list[str], list]:
        nbytes = self.groups[job.group].object_bytes
        keys = [self.rank_key(job.group, m.prefix_hash) for m in job.moves]
        for move, key, digest in zip(job.moves, keys, digests):
            self.slots[move.offset] = (key, digest)
        self.count("stored_bytes_rank", nbytes * len(job.moves))
        return keys, [self.arena.view(m.offset, nbytes) for m in job.moves]

    def _feed_tiers(
        self, ssd: bool, keys: list[str], views: list, digests: list[int]
    ) -> tuple[list[bool] | None, list[bool] | None]:
        """On the feeder thread: queue the objects' writes (each tier copies and checks the bytes against
        the digests the save computed). Touches only the tiers, which are thread-safe."""
        disk, remote = self.ssd, self.remote
        ssd_queued = disk.write_behind(keys, views, checksums=digests) if ssd and disk is not None else None
        remote_sent = remote.write_behind(keys, views, checksums=digests) if remote is not None else None
        return ssd_queued, remote_sent

    # ---------------------------------------------------------------- loads
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
            Moves(g, ids, offs, digs if self.cfg.checksum else None, slot_span(self.layout.object_bytes[g]))
            for g, (ids, offs, digs) in sorted(task.slotted.items())
        ]

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

    # ---------------------------------------------------------------- reports
    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        self.poll_loads()
        finished, failed = self.finished_loads, self.failed_loads
        self.finished_loads, self.failed_loads = set(), set()
        return finished, failed

    def take_worker_meta(self) -> UMBPWorkerMetadata | None:
        self.poll_saves(wait_older=True)
        self.polls += 1
        evicted = {logical_of(k) for k in self.ssd.drain_evicted()} if self.ssd is not None else set()
        meta = UMBPWorkerMetadata(self.saved, self.failed, self.ssd_saved, evicted, self.load_failed)
        self.saved, self.failed, self.ssd_saved, self.load_failed = {}, {}, {}, set()
        return None if meta.is_empty() else meta

    def suspend(self) -> None:
        """The KV cache's memory is about to be released (vLLM's sleep mode, a weight update): finish every
        copy in flight while the mapping is valid; until :meth:`resume`, refuse saves (a counted failure,
        so a future miss: the pages are gone) and hold loads back. Idempotent."""
        for pending in self.pending_saves:
            self._advance_save(pending, wait=True)
        self.pending_saves = [p for p in self.pending_saves if not p.finished]
        self.poll_loads(wait=True)
        if not self.suspended:
            logger.info("umbp: rank %s KV cache released; transfers paused", self.rank.tag())
        self.suspended = True

    def resume(self) -> None:
        """The KV cache is mapped again at the same addresses (vLLM keeps them across sleep): the
        registered views stay valid; only what vLLM recomputes or umbp restores will be in them."""
        if self.suspended:
            logger.info("umbp: rank %s KV cache restored; transfers resumed", self.rank.tag())
        self.suspended = False
        deferred, self.deferred_loads = self.deferred_loads, []
        if deferred:
            self.load(UMBPConnectorMetadata(loads=deferred))

    def close(self) -> None:
        """Finish the saves in flight (so their tier writes are queued), wait for the loads in flight and
        drop them (nobody will read them), then flush the tiers."""
        for pending in self.pending_saves:
            self._advance_save(pending, wait=True)  # its copies, and its tier writes queued
        self.pending_saves = []
        if self.feeder is not None:
            self.feeder.shutdown(wait=True)
            self.feeder = None
        for task in self.pending_loads:
            if task.reads is not None and not task.reads.cancel():
                task.reads.exception()  # wait: that thread may be writing into the arena
            if task.handle is not None:
                task.handle.wait()
        self.pending_loads = []
        if self.io is not None:
            self.io.shutdown(wait=True)
            self.io = None
        self.lower.close(flush_timeout=30)
