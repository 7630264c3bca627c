"""Where each rank's SSD tier lives, and how the scheduler learns what the SSD tiers hold at start-up.

Each worker writes its own shard into `<ssd_dir>/<namespace>/<rank>`; the namespace keeps models and
layouts apart on disk as well as in keys. A restarted scheduler scans those directories (read-only, no
lock: the workers hold the locks) and treats a logical object as present only if every rank holds it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence

from umbp.identity import RankCoord, parse_key

logger = logging.getLogger("umbp.vllm")


def rank_dir(base: str, namespace: str, rank: RankCoord) -> str:
    return os.path.join(base, namespace, rank.tag().replace(":", "-"))


def logical_key(namespace: str, group: int, prefix_hash: bytes) -> str:
    """One index entry per logical object; each rank's shard of it sits at the same arena offset."""
    return f"umbp:v1:{namespace}:all:g{group}:{bytes(prefix_hash).hex()}"


def renamed(keys: set[str], namespaces: dict[str, str]) -> set[str]:
    """Logical keys with each namespace in ``namespaces`` replaced by its value (the others unchanged)."""
    if not namespaces or not keys:
        return keys
    out = set()
    for key in keys:
        parts = key.split(":", 3)  # umbp, v1, namespace, "all:g<group>:<hash>" (logical_key)
        if len(parts) == 4:
            parts[2] = namespaces.get(parts[2], parts[2])
        out.add(":".join(parts))
    return out


def logical_of(rank_key: str) -> str:
    parsed = parse_key(rank_key)
    return logical_key(parsed.namespace, parsed.group, parsed.prefix_hash)


def scan_ssd(
    dirs: Sequence[str], namespace: str, ranks: Iterable[tuple[RankCoord, str, Sequence[bool]]]
) -> set[str]:
    """The logical objects (keys under ``namespace``) that every rank storing their group holds. ``ranks``:
    each rank, the namespace it names its objects under (a pipeline stage's is its own) and which groups
    it stores (a stage may hold no layer of one). A record under another namespace or rank is ignored."""
    from umbp.pool.ssd.format import scan_directory

    held: dict[int, set[str]] = {}
    for rank, rank_ns, stores in ranks:
        found: dict[int, set[str]] = {}
        for base in dirs:
            path = rank_dir(base, rank_ns, rank)
            if not os.path.isdir(path):
                continue
            foreign = 0
            for key in scan_directory(path):
                try:
                    parsed = parse_key(key)
                except ValueError:
                    parsed = None
                if parsed is None or parsed.namespace != rank_ns or parsed.rank != rank:
                    foreign += 1
                    continue
                found.setdefault(parsed.group, set()).add(
                    logical_key(namespace, parsed.group, parsed.prefix_hash)
                )
            if foreign:
                logger.warning("umbp: ignoring %d records with a foreign key in %s", foreign, path)
        for g, yes in enumerate(stores):
            if yes:
                mine = found.get(g, set())
                held[g] = mine if g not in held else held[g] & mine
    return set().union(*held.values())
