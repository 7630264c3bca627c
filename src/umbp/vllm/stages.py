"""Every rank's namespace and object sizes, as the scheduler side learns them under pipeline parallelism.

vLLM gives the scheduler stage 0's KV-cache config only (``generate_scheduler_kv_cache_config``); every
stage holds other layers of each cache group, and may hold more of them, fewer, or none. A rank names its
objects under a namespace of its own layers (it must: a namespace without the layer names could hand one
grouping's bytes to another), so the scheduler can derive neither the other stages' names nor their sizes.

Each worker therefore reports its namespace and per-group object sizes: through vLLM's start-up
handshake (``UMBPLayoutReport``), so the scheduler knows every stage before the first request; inside a
MultiConnector, whose handshake belongs to the P/D connector, with its step output
(``UMBPWorkerMetadata.layouts``) until the scheduler's metadata says it knows every rank's
(``UMBPOffloadMetadata.layouts_known``). Until then the scheduler offers no hit and plans no save (both
counted): nothing is stored into a slot too small for it, and nothing is looked up under a name no rank
writes. Then each DRAM slot is sized for the largest rank's object of its group, the SSD and shared tiers
are asked under each rank's own namespace, and a rank that holds no layer of a group is not asked for
that group's objects at all.

Without pipeline parallelism every rank has the scheduler's own layout, known from the start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("umbp.vllm")


@dataclass(frozen=True)
class RankLayout:
    namespace: str
    object_bytes: tuple[int, ...]  # per group; 0 where the rank holds no layer of the group


class StageLayouts:
    """The rank layouts the scheduler knows; ``ready`` once it knows every rank's."""

    def __init__(self, layout) -> None:
        self.expected = [r.tag() for r in layout.ranks]
        self.num_groups = len(layout.groups)
        self.own = RankLayout(layout.namespace, tuple(layout.object_bytes))
        self.of: dict[str, RankLayout] = {}
        self.refused: str | None = None  # why reports were refused: pipeline stages then stay uncached
        if layout.pp <= 1:
            self.of = dict.fromkeys(self.expected, self.own)

    @property
    def ready(self) -> bool:
        return self.refused is None and len(self.of) == len(self.expected)

    def learn(self, reports: dict) -> bool:
        """Take workers' reports (rank tag -> (namespace, object sizes)); True when they completed the set.
        A malformed or contradicting report refuses them all, once and loudly: a stage whose layout is in
        doubt must never be restored into."""
        if self.refused is not None or self.ready:
            return False
        if not isinstance(reports, dict):
            return self._refuse("workers reported layouts in an unknown form")
        for tag, report in reports.items():
            problem = self._problem(tag, report)
            if problem is not None:
                return self._refuse(problem)
            self.of[tag] = RankLayout(report[0], tuple(report[1]))
        return self.ready

    def _refuse(self, problem: str) -> bool:
        self.refused = problem
        logger.warning("umbp: %s; pipeline stages stay uncached", problem)
        return False

    def _problem(self, tag, report) -> str | None:
        if tag not in self.expected:
            return f"a worker reported rank {tag!r}, which the scheduler does not expect"
        ok = (
            isinstance(report, tuple | list)
            and len(report) == 2
            and isinstance(report[0], str)
            and len(report[0]) == 32
            and isinstance(report[1], tuple | list)
            and len(report[1]) == self.num_groups
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in report[1])
        )
        if not ok:
            return f"rank {tag} reported a malformed layout"
        known = self.of.get(tag)
        if known is not None and known != RankLayout(report[0], tuple(report[1])):
            return f"rank {tag} reported two different layouts"
        return None

    def ranks(self) -> list[tuple[str, RankLayout]]:
        """(rank tag, layout) in the scheduler's rank order; only once ready."""
        return [(tag, self.of[tag]) for tag in self.expected]

    def slot_bytes(self) -> tuple[int, ...]:
        """Per group, the bytes a DRAM slot must take: every rank's object of it sits at the same offset."""
        return tuple(max(r.object_bytes[g] for _, r in self.ranks()) for g in range(self.num_groups))

    def data_bytes(self) -> tuple[int, ...]:
        """Per group, the bytes one logical object holds over all ranks (what `stored_data_bytes` counts)."""
        return tuple(sum(r.object_bytes[g] for _, r in self.ranks()) for g in range(self.num_groups))

    def aliases(self) -> dict[str, str]:
        """Each other rank namespace -> the scheduler's: workers report logical keys (failed loads, SSD
        evictions) under their own namespace."""
        return {r.namespace: self.own.namespace for _, r in self.ranks() if r.namespace != self.own.namespace}
