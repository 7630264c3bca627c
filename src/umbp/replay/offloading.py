"""vLLM's own ``OffloadingConnector`` (CPU backend) as a peer in `umbp replay`: its real scheduler side, and
a simulated worker side.

What runs unchanged: ``OffloadingConnector``'s scheduler role with ``CPUOffloadingSpec`` (lookup, partial-tail
rule, store selection, the CPU manager's LRU eviction), inside the same vLLM Scheduler, on the same trace,
under the same DRAM budget in bytes as umbp (umbp's ``dram_bytes`` per rank x the ranks vLLM is configured
with = ``cpu_bytes_to_use``, which vLLM divides among its world's ranks).

What is simulated, in this benchmark harness only: the worker side. vLLM's CPU offloading worker copies
with CUDA streams between real GPU and pinned CPU tensors (``CPUOffloadingSpec.get_worker`` refuses any
other platform), so here every load and store job is acknowledged after the same modelled delay umbp's
simulated workers get (:mod:`umbp.replay.simworker`: FIFO per direction, per-rank bytes over the link
bandwidth, plus a fixed per-job latency), in the form vLLM's workers report it, already aggregated across
ranks: ``finished_recving`` for loads and ``OffloadingWorkerMetadata.completed_jobs`` with one count per
rank. A job's bytes are its content: for every group, blocks x that group's layers x page bytes per rank
(what umbp's jobs are charged). ``jobs_to_flush`` is honoured as vLLM's worker does it: the step waits for
those jobs. Stores start when their step's forward ends, as umbp's saves do (vLLM defers them to the next
step's start: the same instant while the engine is busy).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.outputs import KVConnectorOutput

from umbp.replay.connector import LookupObserver
from umbp.replay.deployments import ReplayLayout, TimingConfig
from umbp.replay.engine import Engine, kv_cache_config, make_scheduler, make_vllm_config
from umbp.replay.simworker import Link


class OffloadingReplayConnector(OffloadingConnector):
    """vLLM's OffloadingConnector with a read-only observer of its lookups (the replay records the local
    hit, the oracle and the connector's answer at the same moment, as it does for umbp)."""

    observer: LookupObserver | None = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        ext, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self.observer is not None:
            self.observer.on_lookup(self, request, num_computed_tokens, ext)
        return ext, is_async


@dataclass
class StoreCounter:
    """Counts what the CPU manager admitted and evicted (wraps its ``prepare_store``; behaviour unchanged)."""

    stored_keys: int = 0
    evicted_keys: int = 0
    refused: int = 0  # prepare_store returned None: no evictable room
    # every key ever admitted, and every key the connector ever asked to store (tells "evicted", "refused"
    # and "never offered" apart)
    admitted: set = field(default_factory=set)
    offered: set = field(default_factory=set)

    def install(self, manager) -> None:
        prepare = manager.prepare_store

        def counting_prepare_store(keys, req_context):
            keys = list(keys)
            self.offered.update(keys)
            out = prepare(keys, req_context)
            if out is None:
                self.refused += 1
            else:
                self.stored_keys += len(out.keys_to_store)
                self.admitted.update(out.keys_to_store)
                self.evicted_keys += len(out.evicted_keys)
            return out

        manager.prepare_store = counting_prepare_store


def cpu_bytes(layout: ReplayLayout) -> int:
    """The DRAM budget umbp gets, in the unit vLLM's CPU spec takes: bytes for all ranks of its world
    (vLLM's world = TP = the layout's DCP; umbp is given ``dram_gb_per_rank`` on each of them)."""
    return int(layout.dram_gb_per_rank * 1e9) * layout.dcp


def build_offloading_engine(layout: ReplayLayout, *, retention: int, workdir: Path) -> Engine:
    """vLLM's Scheduler with ``OffloadingConnector`` + ``CPUOffloadingSpec`` at umbp's DRAM budget. Raises
    whatever vLLM raises for a layout the connector refuses (the caller reports it verbatim)."""
    transfer = KVTransferConfig(
        kv_connector="OffloadingReplayConnector",
        kv_connector_module_path="umbp.replay.offloading",
        kv_role="kv_both",
        kv_connector_extra_config={"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": cpu_bytes(layout)},
    )
    vllm_config = make_vllm_config(layout, retention, workdir, transfer)
    kv_config = kv_cache_config(layout, retention, sized=True)
    sched, hasher = make_scheduler(vllm_config, kv_config)
    built = sched.connector
    if not isinstance(built, OffloadingReplayConnector):
        raise RuntimeError(f"expected the OffloadingReplayConnector, vLLM built {type(built).__name__}")
    return Engine(sched, built, hasher, vllm_config, kv_config)


@dataclass
class SimOffloadWorkers:
    """The simulated worker side of the OffloadingConnector (see the module docstring: benchmark harness
    only). ``object_bytes``: per KV-cache group, one block's bytes on one rank (layers x page bytes)."""

    timing: TimingConfig
    object_bytes: tuple[int, ...]
    num_workers: int
    h2d: Link = field(init=False)
    d2h: Link = field(init=False)
    _queue: list[tuple[float, int, int, str | None]] = field(default_factory=list)  # done, seq, job, load req
    _done_at: dict[int, float] = field(default_factory=dict)  # queued job -> completion time
    _seq: int = 0
    load_seconds: list[float] = field(default_factory=list)
    loaded: set[str] = field(default_factory=set)  # requests whose load was acknowledged
    stored_bytes: int = 0  # content bytes of acknowledged stores, all ranks

    def __post_init__(self) -> None:
        self.h2d = Link(self.timing.h2d_gbps, self.timing.transfer_latency_s)
        self.d2h = Link(self.timing.d2h_gbps, self.timing.transfer_latency_s)

    def job_bytes(self, gpu_spec) -> int:
        """Per-rank content bytes of a job touching ``gpu_spec``'s blocks (group_sizes: blocks per group)."""
        sizes = gpu_spec.group_sizes or (len(gpu_spec.block_ids),)
        return sum(n * self.object_bytes[g] for g, n in enumerate(sizes))

    def barrier(self, meta: OffloadingConnectorMetadata | None, step_start: float) -> float:
        """When the step can start: vLLM's worker waits for ``jobs_to_flush`` before the forward."""
        if meta is None or not meta.jobs_to_flush:
            return step_start
        return max([step_start] + [self._done_at[j] for j in meta.jobs_to_flush if j in self._done_at])

    def dispatch(self, meta: OffloadingConnectorMetadata | None, step_start: float, step_end: float) -> None:
        if meta is None:
            return
        for job_id, job in meta.load_jobs.items():
            done = self.h2d.submit(step_start, self.job_bytes(job.dst_spec))
            self.load_seconds.append(done - step_start)
            self._push(done, job_id, job.req_id)
        for job_id, job in meta.store_jobs.items():
            nbytes = self.job_bytes(job.src_spec)
            self.stored_bytes += nbytes * self.num_workers
            self._push(self.d2h.submit(step_end, nbytes), job_id, None)

    def _push(self, done: float, job_id: int, load_req: str | None) -> None:
        self._seq += 1
        self._done_at[job_id] = done
        heapq.heappush(self._queue, (done, self._seq, job_id, load_req))

    def next_event(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def collect(self, now: float) -> KVConnectorOutput:
        """Every job done by ``now``, as the aggregated worker output of one step (each of
        ``num_workers`` ranks reports every job once, as vLLM's executor sums them)."""
        finished: set[str] = set()
        completed: dict[int, int] = {}
        while self._queue and self._queue[0][0] <= now:
            _, _, job_id, req_id = heapq.heappop(self._queue)
            del self._done_at[job_id]
            completed[job_id] = self.num_workers
            if req_id is not None:
                finished.add(req_id)
        self.loaded |= finished
        meta = OffloadingWorkerMetadata(completed_jobs=completed) if completed else None
        return KVConnectorOutput(finished_recving=finished or None, kv_connector_worker_meta=meta)
