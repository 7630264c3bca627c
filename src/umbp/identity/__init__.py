"""Layer 1a: who an object is (namespace, rank, group, prefix hash). Pure Python, engine-agnostic."""

from umbp.identity.keys import (
    FORMAT_VERSION,
    GroupLayout,
    ModelIdentity,
    ObjectKey,
    ParallelSizes,
    RankCoord,
    all_ranks,
    dcp_rank,
    object_key,
    parse_key,
)

__all__ = [
    "FORMAT_VERSION",
    "GroupLayout",
    "ModelIdentity",
    "ObjectKey",
    "ParallelSizes",
    "RankCoord",
    "all_ranks",
    "dcp_rank",
    "object_key",
    "parse_key",
]
