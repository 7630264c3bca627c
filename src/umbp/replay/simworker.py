"""Simulated workers: acknowledge umbp's load and save jobs after a modelled transfer time; move no bytes.

Why no bytes: correctness of restored bytes is proven by the scheduler-level tests (tests/vllm); here
only *which* boundaries get restored and *when* matter, and skipping the copies keeps a c70 replay at
minutes on two cores. Each rank moves its shard in parallel, so a job's time is its per-rank bytes over
one link: loads queue on the host-to-device link, saves on the device-to-host link (FIFO each), plus a
fixed per-job latency. A load starts when its step starts (vLLM runs ``start_load_kv`` before or with
the forward); a save starts when its step's forward ends (``wait_for_save``).

The acknowledgements are what real workers send, already aggregated across ranks: ``finished_recving``
(with ``failed_recving`` for a load the scheduler poisoned) and ``UMBPWorkerMetadata.saved``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from vllm.v1.outputs import KVConnectorOutput

from umbp.replay.deployments import TimingConfig
from umbp.vllm.metadata import UMBPConnectorMetadata, UMBPWorkerMetadata


@dataclass
class Link:
    """One direction of the host link of a rank: FIFO, ``gbps`` GB/s, fixed ``latency_s`` per job."""

    gbps: float
    latency_s: float
    free_at: float = 0.0
    busy_s: float = 0.0
    bytes: int = 0

    def submit(self, start: float, nbytes: int) -> float:
        begin = max(start, self.free_at)
        done = begin + self.latency_s + nbytes / (self.gbps * 1e9)
        self.busy_s += done - begin
        self.bytes += nbytes
        self.free_at = done
        return done


@dataclass
class SimWorkers:
    timing: TimingConfig
    rank_tags: frozenset[str]
    h2d: Link = field(init=False)
    d2h: Link = field(init=False)
    _loads: list[tuple[float, int, str, bool]] = field(default_factory=list)  # (done, seq, req, ok)
    _saves: list[tuple[float, int, int]] = field(default_factory=list)  # (done, seq, job id)
    _seq: int = 0
    load_seconds: list[float] = field(default_factory=list)  # per load job: submit -> done

    def __post_init__(self) -> None:
        self.h2d = Link(self.timing.h2d_gbps, self.timing.transfer_latency_s)
        self.d2h = Link(self.timing.d2h_gbps, self.timing.transfer_latency_s)

    def barrier(self, meta: UMBPConnectorMetadata | None, step_start: float) -> float:
        """When the step's forward can start: umbp's workers never hold it back."""
        return step_start

    def dispatch(self, meta: UMBPConnectorMetadata | None, step_start: float, step_end: float) -> None:
        """Queue this step's jobs (vLLM hands every worker the same metadata)."""
        if meta is None:
            return
        for job in meta.loads:
            self._seq += 1
            if job.poisoned:
                heapq.heappush(self._loads, (step_start, self._seq, job.req_id, False))
                continue
            nbytes = sum(m.nbytes for moves in job.moves.values() for m in moves)
            done = self.h2d.submit(step_start, nbytes)
            self.load_seconds.append(done - step_start)
            heapq.heappush(self._loads, (done, self._seq, job.req_id, True))
        for job in meta.saves:
            self._seq += 1
            done = self.d2h.submit(step_end, sum(m.nbytes for m in job.moves))
            heapq.heappush(self._saves, (done, self._seq, job.job_id))

    def next_event(self) -> float | None:
        """When the earliest queued job completes (None: nothing queued)."""
        times = [q[0][0] for q in (self._loads, self._saves) if q]
        return min(times) if times else None

    def collect(self, now: float) -> KVConnectorOutput:
        """Every job done by ``now``, as the aggregated worker output of one step."""
        finished: set[str] = set()
        failed: set[str] = set()
        while self._loads and self._loads[0][0] <= now:
            _, _, req_id, ok = heapq.heappop(self._loads)
            finished.add(req_id)
            if not ok:
                failed.add(req_id)
        saved: dict[int, set[str]] = {}
        while self._saves and self._saves[0][0] <= now:
            _, _, job_id = heapq.heappop(self._saves)
            saved[job_id] = set(self.rank_tags)
        meta = UMBPWorkerMetadata(saved=saved) if saved else None
        return KVConnectorOutput(
            finished_recving=finished or None, failed_recving=failed, kv_connector_worker_meta=meta
        )
