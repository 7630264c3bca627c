"""Worker side of the UMBPConnector (embedded mode): this rank's arena and the copies in and out of it.

Every object written here is remembered with the rank-local key it was saved under and its checksum, so a
load verifies that the slot still holds exactly the object the scheduler asked for; any mismatch is a
failed load (vLLM recomputes), never wrong bytes in the KV cache. This module holds registration and the
save path; the load path is :mod:`umbp.vllm.worker_loads`.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from umbp.identity import RankCoord, object_key
from umbp.pool import Arena, Pool
from umbp.pool.composition import TierStack
from umbp.transfer import Handle, Moves, make_engine
from umbp.vllm.config import UMBPConfig
from umbp.vllm.kv_layout import Layout, slot_span, stored_page_bytes
from umbp.vllm.metadata import LoadJob, SaveJob, UMBPConnectorMetadata, UMBPWorkerMetadata
from umbp.vllm.pages import GroupPages, group_pages
from umbp.vllm.stats import UMBPStats
from umbp.vllm.tiers import logical_of, rank_dir
from umbp.vllm.worker_loads import LoadPath, PendingLoad

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


@dataclass
class PendingSave:
    job: SaveJob
    handle: Handle
    started: int  # the worker's poll count when the copies were started
    first: int = 0  # this job's Moves in the handle's batch (a step's jobs share one engine call)
    feed: Future | None = None  # handing its objects to the SSD / shared tiers, on the feeder thread
    finished: bool = False  # confirmed (or failed) in this worker's metadata


class SlotTooSmall(ValueError):
    """This rank's object of a group is larger than the slot the scheduler reserved for it."""


class WorkerSide(LoadPath):
    """One rank's half of the connector: its arena, its lower tiers and the copies between them and the
    KV cache; saves here, loads in :class:`~umbp.vllm.worker_loads.LoadPath`."""

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
        self._slot_warned = False  # SlotTooSmall is logged once, not per save
        # pipeline parallel: this rank reports its layout until the scheduler knows it (umbp.vllm.stages)
        self.layout_known = layout.pp <= 1

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
            # only the content of each page: the padding vLLM adds to state pages is never stored
            page_bytes = stored_page_bytes(group.kv_cache_spec)
            pages = group_pages(kv_caches, list(group.layer_names), num_blocks, page_bytes)
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
            if job.publish:  # no pages involved: the arena's slots go to the shared tier again
                self._publish(job)
                continue
            if self.suspended:  # the pages are not there: never store what the released memory holds
                self._refuse_save(job)
                continue
            try:
                moves = self._start_save(job)
            except SlotTooSmall as exc:  # a layout mismatch, the same every step: one warning, then counts
                if not self._slot_warned:
                    logger.warning("%s; such saves are refused and counted as save_failures", exc)
                    self._slot_warned = True
                self._refuse_save(job)
                continue
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
        nbytes, reserved = pages.object_bytes, min(m.nbytes for m in job.moves)
        if nbytes > reserved:
            raise SlotTooSmall(
                f"umbp: group {job.group}'s objects take {nbytes} bytes on rank {self.rank.tag()} but the "
                f"scheduler reserved {reserved} (a scheduler that does not know this rank's layout; "
                "docs/vllm.md, pipeline parallelism)"
            )
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

    def _publish(self, job: SaveJob) -> None:
        """A store-mediated hand-off needs objects the shared tier lost while the arena still holds them
        (the scheduler pinned their slots): queue them to the shared tier again, verified against the
        digests their saves recorded. A slot that does not hold its object fails the job (never written)."""
        pages = self.groups.get(job.group)
        if pages is None or self.remote is None:  # a pipeline stage without a layer of the group
            self._confirm(job)
            return
        keys = [self.rank_key(job.group, m.prefix_hash) for m in job.moves]
        digests = [self._slot_digest(m.offset, k) for m, k in zip(job.moves, keys, strict=True)]
        if any(d is None for d in digests):
            self.failed.setdefault(job.job_id, set()).add(self.rank.tag())
            return
        views = [self.arena.view(m.offset, pages.object_bytes) for m in job.moves]
        try:
            sent = self.remote.write_behind(keys, views, checksums=digests)
        except Exception:  # noqa: BLE001 - a hand-off that cannot be published times out, never a crash
            logger.exception("umbp: publishing job %d to the shared tier failed", job.job_id)
            sent = [False] * len(keys)
        self.count("remote_saves_queued", sent.count(True))
        self.count("remote_saves_dropped", sent.count(False))
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
        if not self.layout_known and self.arena is not None:
            meta.layouts = {self.rank.tag(): self.reported_layout()}
        return None if meta.is_empty() else meta

    def reported_layout(self) -> tuple[str, tuple[int, ...]]:
        """This rank's namespace and the bytes of its object of each group (0: it holds no layer of it)."""
        sizes = tuple(
            self.groups[g].object_bytes if g in self.groups else 0 for g in range(len(self.layout.groups))
        )
        return self.layout.namespace, sizes

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
