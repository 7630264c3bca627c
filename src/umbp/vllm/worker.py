"""Worker side of the UMBPConnector (embedded mode): this rank's arena and the copies in and out of it.

Every object written here is remembered with the rank-local key it was saved under and its checksum, so a
load verifies that the slot still holds exactly the object the scheduler asked for; any mismatch is a
failed load (vLLM recomputes), never wrong bytes in the KV cache.
"""

from __future__ import annotations

import atexit
import logging
from collections import Counter

import torch

from umbp.identity import RankCoord, object_key
from umbp.pool import Arena
from umbp.transfer import Moves, make_engine
from umbp.vllm.config import UMBPConfig
from umbp.vllm.layout import Layout
from umbp.vllm.metadata import LoadJob, PageMove, SaveJob, UMBPConnectorMetadata, UMBPWorkerMetadata
from umbp.vllm.pages import GroupPages, group_pages
from umbp.vllm.stats import UMBPStats
from umbp.vllm.tiers import logical_of, rank_dir

logger = logging.getLogger("umbp.vllm")


def current_rank() -> RankCoord:
    """This worker's parallel coordinates (all 0 when vLLM's parallel state is not initialised)."""
    try:
        from vllm.distributed import parallel_state as ps

        tp = ps.get_tensor_model_parallel_rank()
        pp = ps.get_pp_group().rank_in_group
    except Exception:  # noqa: BLE001 - no distributed state (single process tests)
        return RankCoord()
    return RankCoord(tp=tp, pcp=0, dcp=0, pp=pp)


class WorkerSide:
    def __init__(self, cfg: UMBPConfig, layout: Layout, kv_cache_config, rank: RankCoord | None = None):
        self.cfg = cfg
        self.layout = layout
        self.kv_cache_config = kv_cache_config
        self.rank = rank if rank is not None else current_rank()
        self.groups: dict[int, GroupPages] = {}
        self.arena: Arena | None = None
        self.ssd = None  # umbp.pool.SsdTier for this rank, when ssd_dirs is configured
        self.remote = None  # umbp.pool.remote.RedisTier, when a shared tier is configured
        self.ssd_saved: dict[int, set[str]] = {}
        self.slots: dict[int, tuple[str, int]] = {}  # arena offset -> (rank-local key, checksum)
        self.saved: dict[int, set[str]] = {}
        self.failed: dict[int, set[str]] = {}
        self.finished_loads: set[str] = set()
        self.failed_loads: set[str] = set()
        self.stats = UMBPStats()  # this interval's counters, handed to vLLM each step
        self.totals: Counter[str] = Counter()  # since start, for `umbp stats`-style inspection and tests

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
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
        if self.cfg.ssd_dirs:
            from umbp.pool.ssd import SsdTier

            dirs = [rank_dir(d, self.layout.namespace, self.rank) for d in self.cfg.ssd_dirs]
            self.ssd = SsdTier(dirs, self.cfg.ssd_bytes, track_evicted=True, prefault=False)
        self.remote = self.cfg.remote_tier()
        if self.ssd is not None or self.remote is not None:
            atexit.register(self.close)  # queued writes must reach the disk/server without a clean shutdown
        logger.info(
            "umbp: rank %s arena %.2f GiB, groups %s", self.rank.tag(), self.cfg.dram_bytes / 2**30,
            {g: p.object_bytes for g, p in self.groups.items()},
        )

    def rank_key(self, group: int, prefix_hash: bytes) -> str:
        return object_key(self.layout.namespace, self.rank, group, prefix_hash)

    def count(self, key: str, value: int = 1) -> None:
        self.stats.add(key, value)
        self.totals[key] += value

    # ---------------------------------------------------------------- saves
    def save(self, meta: UMBPConnectorMetadata) -> None:
        for job in meta.saves:
            try:
                self._save_job(job)
                self.saved.setdefault(job.job_id, set()).add(self.rank.tag())
            except Exception:  # noqa: BLE001 - a failed save is a future miss, never a crash
                logger.exception("umbp: save job %d failed on rank %s", job.job_id, self.rank.tag())
                for move in job.moves:
                    self.slots.pop(move.offset, None)
                self.failed.setdefault(job.job_id, set()).add(self.rank.tag())
                self.count("save_failures", len(job.moves))

    def _save_job(self, job: SaveJob) -> None:
        pages = self.groups.get(job.group)
        if pages is None:  # this rank holds no layer of the group (pipeline parallel)
            return
        nbytes = pages.object_bytes
        if nbytes > min(m.nbytes for m in job.moves):
            raise ValueError(f"umbp: page of {nbytes} bytes exceeds its slot of {job.moves[0].nbytes}")
        for move in job.moves:
            self.slots.pop(move.offset, None)  # being rewritten: invalid until the copy is done
        moves = Moves(job.group, [m.block_id for m in job.moves], [m.offset for m in job.moves])
        digests = self.engine.save([moves]).result()[0]  # one bulk gather + copy, checksummed
        keys = [self.rank_key(job.group, m.prefix_hash) for m in job.moves]
        for move, key, digest in zip(job.moves, keys, digests):
            self.slots[move.offset] = (key, int(digest))
        self.count("stored_bytes_rank", nbytes * len(job.moves))
        views = [self.arena.view(m.offset, nbytes) for m in job.moves]
        if job.ssd and self.ssd is not None:
            queued = self.ssd.put(keys, views, checksums=[int(d) for d in digests])
            if all(queued):
                self.ssd_saved.setdefault(job.job_id, set()).add(self.rank.tag())
            else:
                self.count("ssd_saves_dropped", queued.count(False))
        if self.remote is not None:
            sent = self.remote.put_async(keys, views)
            self.count("remote_saves_queued", sent.count(True))
            self.count("remote_saves_dropped", sent.count(False))

    def _write(self, move: PageMove, group: int, page: torch.Tensor) -> int:
        if page.numel() > move.nbytes:
            raise ValueError(f"umbp: page of {page.numel()} bytes exceeds its slot of {move.nbytes}")
        self.slots.pop(move.offset, None)  # the slot is being rewritten: invalid until done
        digest = self.arena.write(move.offset, page.numpy())  # copy and checksum in one pass
        self.slots[move.offset] = (self.rank_key(group, move.prefix_hash), digest)
        return digest

    # ---------------------------------------------------------------- loads
    def load(self, meta: UMBPConnectorMetadata) -> None:
        for job in meta.loads:
            ok = not job.poisoned
            if ok:
                try:
                    ok = self._load_job(job)
                except Exception:  # noqa: BLE001 - a failed load is a recompute, never a crash
                    logger.exception("umbp: load for request %s failed on rank %s", job.req_id, self.rank.tag())
                    ok = False
            self.finished_loads.add(job.req_id)
            if not ok:
                self.failed_loads.add(job.req_id)
                self.count("load_failures_rank")

    def _load_job(self, job: LoadJob) -> bool:
        """Verify every object before anything reaches the KV cache; then one bulk load per batch."""
        batch: list[Moves] = []
        unslotted: list[tuple[GroupPages, list[int], torch.Tensor]] = []  # tier reads with no DRAM slot
        for group, moves in sorted(job.moves.items()):
            pages = self.groups.get(group)
            if pages is None:
                continue
            ids, offsets, digests, rows = [], [], [], []
            for move in moves:
                found = self._locate(move, group, pages.object_bytes)
                if found is None:
                    return False
                if isinstance(found, torch.Tensor):
                    rows.append((move.block_id, found))
                else:
                    ids.append(move.block_id)
                    offsets.append(move.offset if move.source == "dram" else move.promote_offset)
                    digests.append(found)
            if ids:
                batch.append(Moves(group, ids, offsets, digests if self.cfg.checksum else None))
            if rows:
                unslotted.append((pages, [b for b, _ in rows], torch.stack([r for _, r in rows])))
        if batch and not self._bulk_load(batch):
            return False
        for pages, block_ids, data in unslotted:
            pages.scatter(block_ids, data)
            self.count("loaded_bytes", data.numel())
        return True

    def _locate(self, move: PageMove, group: int, nbytes: int) -> int | torch.Tensor | None:
        """The checksum of the arena slot holding the object, or its bytes when it was read from a tier
        without a DRAM slot to promote into; None when it cannot be had (a miss)."""
        if move.source in ("ssd", "remote"):
            out = torch.empty(nbytes, dtype=torch.uint8)
            if not self._read_tier(move, group, out):
                return None
            return self.slots[move.promote_offset][1] if move.promote_offset >= 0 else out
        expected = self.rank_key(group, move.prefix_hash)
        held = self.slots.get(move.offset)
        if held is None or held[0] != expected:
            logger.warning("umbp: slot %d does not hold %s; treating as a miss", move.offset, expected)
            return None
        return held[1]

    def _bulk_load(self, batch: list[Moves]) -> bool:
        results = self.engine.load(batch).result()
        for moves, written in zip(batch, results):
            for offset, ok in zip(moves.offsets, written):
                if not ok:
                    logger.warning("umbp: checksum mismatch in slot %d; treating as a miss", offset)
                    self.slots.pop(offset, None)
                    self.count("checksum_failures")
        if not all(all(w) for w in results):
            return False
        self.count("loaded_bytes", sum(len(m.block_ids) * self.groups[m.group].object_bytes for m in batch))
        return True

    def _read_tier(self, move: PageMove, group: int, out: torch.Tensor) -> bool:
        """Read from this rank's SSD or shared tier (both verify the checksum); promote into DRAM."""
        tier = self.ssd if move.source == "ssd" else self.remote
        if tier is None:
            return False
        if not tier.get_into([self.rank_key(group, move.prefix_hash)], [out.numpy()])[0]:
            logger.warning("umbp: %s tier did not return an object it was asked for; a miss", move.source)
            return False
        self.count(f"{move.source}_loaded_bytes", out.numel())
        if move.promote_offset >= 0:
            promoted = PageMove(move.block_id, move.promote_offset, move.nbytes, move.prefix_hash)
            self._write(promoted, group, out)
        return True

    # ---------------------------------------------------------------- reports
    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        finished, failed = self.finished_loads, self.failed_loads
        self.finished_loads, self.failed_loads = set(), set()
        return finished, failed

    def take_worker_meta(self) -> UMBPWorkerMetadata | None:
        evicted = {logical_of(k) for k in self.ssd.drain_evicted()} if self.ssd is not None else set()
        meta = UMBPWorkerMetadata(self.saved, self.failed, self.ssd_saved, evicted)
        self.saved, self.failed, self.ssd_saved = {}, {}, {}
        return None if meta.is_empty() else meta

    def close(self) -> None:
        for name in ("ssd", "remote"):
            tier = getattr(self, name)
            if tier is not None:
                tier.flush(timeout=30)
                tier.close()
                setattr(self, name, None)
