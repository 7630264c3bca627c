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


def logical_of(rank_key: str) -> str:
    parsed = parse_key(rank_key)
    return logical_key(parsed.namespace, parsed.group, parsed.prefix_hash)


def scan_ssd(dirs: Sequence[str], namespace: str, ranks: Iterable[RankCoord]) -> set[str]:
    from umbp.pool.ssd.format import scan_directory

    held: set[str] | None = None
    for rank in ranks:
        keys: set[str] = set()
        for base in dirs:
            path = rank_dir(base, namespace, rank)
            if not os.path.isdir(path):
                continue
            for key in scan_directory(path):
                try:
                    keys.add(logical_of(key))
                except ValueError:
                    logger.warning("umbp: ignoring a record with a foreign key in %s", path)
        held = keys if held is None else held & keys
    return held or set()
