"""The small messages that cross processes between the scheduler-side and worker-side connector.

Only block ids, arena offsets and hashes travel; page bytes never leave the worker that owns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class PageMove:
    """One object of one group: GPU block <-> arena slot."""

    block_id: int
    offset: int  # arena offset (-1: not in DRAM)
    nbytes: int
    prefix_hash: bytes
    source: str = "dram"  # loads: where the object is read from ("dram" | "ssd")
    promote_offset: int = -1  # loads from SSD: arena slot to copy the object into as well (-1: none)


@dataclass
class SaveJob:
    job_id: int
    group: int
    moves: list[PageMove]
    ssd: bool = False  # also write through to this rank's SSD tier
    fence: bool = (
        True  # the next forward may rewrite these pages (boundary page, state): it waits for the copy
    )
    # store-mediated P/D: the objects are in the arena already (moves name their slots, no block): write
    # them to the shared tier again, which lost them (umbp.vllm.handoff.Producer)
    publish: bool = False


@dataclass
class LoadJob:
    req_id: str
    moves: dict[int, list[PageMove]]  # group -> pages to load
    poisoned: bool = False  # the scheduler already knows this load cannot succeed; report it failed


@dataclass
class UMBPOffloadMetadata(KVConnectorMetadata):
    """One step's save and load jobs, scheduler -> workers. Not named UMBPConnectorMetadata: that is the
    class of vLLM's in-tree UMBPStoreConnector (0.33+), a different project (docs/vllm.md)."""

    saves: list[SaveJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    handoffs_done: list[str] = field(
        default_factory=list
    )  # store-mediated P/D: report these finished_sending
    # pipeline parallel: the scheduler knows every rank's layout, its workers stop reporting (umbp.vllm.stages)
    layouts_known: bool = False

    def is_empty(self) -> bool:
        return not self.saves and not self.loads and not self.handoffs_done


UMBPConnectorMetadata = UMBPOffloadMetadata  # the former name, for code that imports it


@dataclass
class UMBPWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-step save confirmations, merged across ranks by vLLM's KVOutputAggregator."""

    saved: dict[int, set[str]] = field(default_factory=dict)  # job id -> rank tags that saved it
    failed: dict[int, set[str]] = field(default_factory=dict)  # job id -> rank tags that could not
    ssd_saved: dict[int, set[str]] = field(default_factory=dict)  # job id -> ranks that queued it to SSD
    ssd_evicted: set[str] = field(default_factory=set)  # logical keys some rank's SSD tier no longer holds
    load_failed: set[str] = field(default_factory=set)  # logical keys a failed load could not use, any rank
    # pipeline parallel, until the scheduler knows them: rank tag -> (its namespace, its object bytes per
    # group) (umbp.vllm.stages)
    layouts: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> UMBPWorkerMetadata:
        assert isinstance(other, UMBPWorkerMetadata)
        merged = UMBPWorkerMetadata(
            ssd_evicted=self.ssd_evicted | other.ssd_evicted,
            load_failed=self.load_failed | other.load_failed,
            layouts={**self.layouts, **other.layouts},
        )
        for name in ("saved", "failed", "ssd_saved"):
            dst = getattr(merged, name)
            for src in (getattr(self, name), getattr(other, name)):
                for job_id, ranks in src.items():
                    dst.setdefault(job_id, set()).update(ranks)
        return merged

    def is_empty(self) -> bool:
        return not (
            self.saved
            or self.failed
            or self.ssd_saved
            or self.ssd_evicted
            or self.load_failed
            or self.layouts
        )


@dataclass
class UMBPLayoutReport(KVConnectorHandshakeMetadata):
    """A pipeline-parallel rank's layout, handed to the scheduler through vLLM's start-up handshake
    (``get_handshake_metadata`` -> ``set_xfer_handshake_metadata_pp_aware``), before the first request;
    umbp.vllm.stages. The same report travels in the worker metadata where the handshake cannot carry it."""

    layouts: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
