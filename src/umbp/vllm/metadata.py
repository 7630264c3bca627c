"""The small messages that cross processes between the scheduler-side and worker-side connector.

Only block ids, arena offsets and hashes travel; page bytes never leave the worker that owns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class PageMove:
    """One object of one group: GPU block <-> arena slot."""

    block_id: int
    offset: int
    nbytes: int
    prefix_hash: bytes


@dataclass
class SaveJob:
    job_id: int
    group: int
    moves: list[PageMove]


@dataclass
class LoadJob:
    req_id: str
    moves: dict[int, list[PageMove]]  # group -> pages to load
    poisoned: bool = False  # the scheduler already knows this load cannot succeed; report it failed


@dataclass
class UMBPConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.saves and not self.loads


@dataclass
class UMBPWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-step save confirmations, merged across ranks by vLLM's KVOutputAggregator."""

    saved: dict[int, set[str]] = field(default_factory=dict)  # job id -> rank tags that saved it
    failed: dict[int, set[str]] = field(default_factory=dict)  # job id -> rank tags that could not

    def aggregate(self, other: KVConnectorWorkerMetadata) -> UMBPWorkerMetadata:
        assert isinstance(other, UMBPWorkerMetadata)
        merged = UMBPWorkerMetadata({k: set(v) for k, v in self.saved.items()},
                                    {k: set(v) for k, v in self.failed.items()})
        for src, dst in ((other.saved, merged.saved), (other.failed, merged.failed)):
            for job_id, ranks in src.items():
                dst.setdefault(job_id, set()).update(ranks)
        return merged
