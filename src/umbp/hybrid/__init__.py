"""Hybrid-model lookup and store planning (layer 1: stdlib only).

* :mod:`umbp.hybrid.groups`: one class per cache type (full attention, sliding window, recurrent state);
* :mod:`umbp.hybrid.lookup`: :func:`longest_hit` (vLLM 0.32's hybrid coordinator rule) and :func:`explain`;
* :mod:`umbp.hybrid.planner`: which pages to store, under which key (:class:`RequestStorePlanner`).
"""

from umbp.hybrid.groups import (
    CacheGroup,
    FullAttention,
    GroupHit,
    Need,
    RecurrentState,
    SlidingWindow,
    Space,
    resolve_groups,
)
from umbp.hybrid.lookup import (
    Boundary,
    Explanation,
    GroupStatus,
    Hit,
    check_context_parallel,
    explain,
    explain_hit,
    hit_alignment,
    longest_hit,
    partial_hits_enabled,
    resolve_eagle_ids,
)
from umbp.hybrid.planner import RequestStorePlanner, StorePlan

__all__ = [
    "Boundary",
    "CacheGroup",
    "Explanation",
    "FullAttention",
    "GroupHit",
    "GroupStatus",
    "Hit",
    "Need",
    "RecurrentState",
    "RequestStorePlanner",
    "SlidingWindow",
    "Space",
    "StorePlan",
    "check_context_parallel",
    "explain",
    "explain_hit",
    "hit_alignment",
    "longest_hit",
    "partial_hits_enabled",
    "resolve_eagle_ids",
    "resolve_groups",
]
