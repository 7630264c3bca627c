"""What the scheduler side remembers per request and per in-flight load.

A request's keys are derived from vLLM's block hashes (one per unit). A 131,072-token prompt has 8,192 of
them per cache group, so the derived parts (the hex of each hash, the key strings) are built once and
cached per request, and a lookup that needs only a few boundaries builds only those (``hex_at``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from umbp.hybrid import RequestStorePlanner
from umbp.vllm.metadata import LoadJob


@dataclass
class PendingLoad:
    req_id: str
    tokens: int  # the resume boundary this load restores
    new_tokens: int  # tokens beyond the local hit
    keys: list[str]
    job: LoadJob
    sent: bool = False
    promoted: list[str] = field(default_factory=list)  # DRAM reservations filled from SSD by this load
    all_keys: list[str] = field(default_factory=list)  # every object this load reads
    tiers: Counter = field(default_factory=Counter)  # objects by the tier they are read from


@dataclass
class TrackedRequest:
    request: object  # vllm Request (kept for its growing block_hashes)
    planner: RequestStorePlanner
    hit: object | None = None  # last lookup result (umbp.hybrid Hit), consumed at allocation
    hit_local: int = 0
    block_hit: object | None = None  # the lookup's hit before the prompt-tail extension (umbp.hybrid.tail)
    keys: list[list[str]] = field(default_factory=list)  # per group: logical key of each unit boundary
    hexes: list[str] = field(default_factory=list)  # hex of each unit boundary's prefix hash, from 0
    hex_memo: dict[int, str] = field(default_factory=dict)  # hexes built one by one past `hexes`
    hashes: list = field(default_factory=list)  # the block hashes everything above was derived from
    remote: dict = field(default_factory=dict)  # (group, token end) -> (time asked, every rank holds it)
    tail_hashes: dict = field(default_factory=dict)  # key end inside a unit -> its prefix hash (tail_hashes)
    unsaved: bool = False  # some of its saves were dropped (no DRAM slot, or pipeline stages not yet known)

    def forget_hashes(self) -> None:
        """A resumed request may carry different hashes: nothing derived from the old ones stays."""
        self.keys, self.hexes, self.hex_memo, self.hashes = [], [], {}, []
        self.remote, self.tail_hashes = {}, {}

    def sync_hashes(self) -> bool:
        """Catch up with the request's block hashes; True when vLLM rewrote some (everything derived from
        them is dropped). vLLM can cut a request's hashes and hash new tokens in their place (a streaming
        session's next chunk, a connector's truncate_block_hashes, lookahead hashes recomputed on
        readmission): the hashes are chained, so any change shows in the last one both lists share."""
        hashes, seen = self.request.block_hashes, self.hashes
        shared = min(len(seen), len(hashes))
        rewritten = len(seen) > len(hashes) or (shared > 0 and seen[shared - 1] != hashes[shared - 1])
        if rewritten:
            self.forget_hashes()
            seen = self.hashes
        seen.extend(hashes[len(seen) :])
        return rewritten

    def hex_at(self, i: int) -> str:
        """Hex of block hash ``i`` (after sync_hashes), built on first use."""
        if i < len(self.hexes):
            return self.hexes[i]
        hx = self.hex_memo.get(i)
        if hx is None:
            hx = self.hex_memo[i] = bytes(self.hashes[i]).hex()
        return hx

    def all_hexes(self) -> list[str]:
        """Hex of every block hash (after sync_hashes), cached."""
        hexes, memo = self.hexes, self.hex_memo
        start = len(hexes)
        hexes.extend(memo.get(i) or bytes(h).hex() for i, h in enumerate(self.hashes[start:], start))
        memo.clear()
        return hexes


def key_head(probe: str) -> str:
    """A key built with the one-byte prefix hash b"\\x00", minus that hash's hex "00": any prefix hash's
    hex completes it into the same key the key function would build."""
    if not probe.endswith(":00"):
        raise RuntimeError(f"umbp: unexpected key layout {probe!r}")
    return probe[:-2]
