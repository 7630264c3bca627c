"""The replay trace: JSONL, one request (one turn of one session) per line.

    {"session": "s0003", "turn": 2, "think_s": 4.1, "output_tokens": 310,
     "segments": [{"id": "sys1", "len": 9000}, {"id": "s0003/u0", "len": 420}, {"tokens": [17, 4, 99]}]}

* ``segments``: the prompt is their concatenation. ``{"id", "len"}`` stands for the first ``len`` tokens of
  a pseudo-random stream seeded by ``id`` (the same id is the same text, so prefixes are shared exactly
  where ids are); ``{"tokens": [...]}`` gives token ids verbatim (real traces).
* Turns of a session run in order; turn ``i+1`` is submitted ``think_s`` seconds (modelled time) after
  turn ``i`` finished. A session's first turn may carry ``arrival_s``: not before that time.
* ``output_tokens``: what the model replied (it runs on the decode instance in 1P1D; the prefill instance
  replayed here generates one token). The reply's tokens appear as a segment of the next turn's prompt.

Mooncake-style lines (``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``,
512 tokens per hash id) are read as one-turn sessions, with ``arrival_s = timestamp / 1000``.
Stdlib + numpy only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = 1 << 17  # token ids of synthetic segments: [16, VOCAB); random streams never collide in practice
MOONCAKE_BLOCK = 512


class TraceError(ValueError):
    """A malformed trace line; the message names the line."""


@dataclass(frozen=True)
class Segment:
    id: str = ""
    length: int = 0
    tokens: tuple[int, ...] | None = None

    @property
    def size(self) -> int:
        return len(self.tokens) if self.tokens is not None else self.length

    def to_json(self) -> dict[str, Any]:
        if self.tokens is not None:
            return {"tokens": list(self.tokens)}
        return {"id": self.id, "len": self.length}


@dataclass(frozen=True)
class Turn:
    session: str
    turn: int
    segments: tuple[Segment, ...]
    output_tokens: int = 1
    think_s: float = 0.0
    arrival_s: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(s.size for s in self.segments)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"session": self.session, "turn": self.turn}
        if self.arrival_s is not None:
            out["arrival_s"] = round(self.arrival_s, 6)
        out["think_s"] = round(self.think_s, 6)
        out["output_tokens"] = self.output_tokens
        out["segments"] = [s.to_json() for s in self.segments]
        return out


def segment_stream(seg_id: str, length: int) -> list[int]:
    """The first ``length`` tokens of the stream named ``seg_id`` (deterministic across runs/machines)."""
    import numpy as np

    seed = int.from_bytes(hashlib.blake2b(seg_id.encode(), digest_size=8).digest(), "big")
    return np.random.default_rng(seed).integers(16, VOCAB, size=length, dtype=np.int64).tolist()


class TokenCache:
    """Segment id -> tokens, so a system prompt shared by every session is generated once."""

    def __init__(self) -> None:
        self._streams: dict[str, list[int]] = {}

    def tokens(self, seg: Segment) -> list[int]:
        if seg.tokens is not None:
            return list(seg.tokens)
        held = self._streams.get(seg.id)
        if held is None or len(held) < seg.length:
            held = segment_stream(seg.id, seg.length)
            self._streams[seg.id] = held
        return held[: seg.length]

    def prompt(self, turn: Turn) -> list[int]:
        out: list[int] = []
        for seg in turn.segments:
            out.extend(self.tokens(seg))
        return out

    def forget(self, ids: Iterable[str]) -> None:
        for seg_id in ids:
            self._streams.pop(seg_id, None)


# ------------------------------------------------------------------------------------------ JSONL


def write_trace(turns: Iterable[Turn], path: str | Path) -> int:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as f:
        for turn in turns:
            f.write(json.dumps(turn.to_json(), separators=(",", ":")) + "\n")
            n += 1
    return n


def read_trace(path: str | Path) -> list[Turn]:
    turns = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                turns.append(parse_line(line, lineno))
    check_sessions(turns)
    return turns


def parse_line(line: str, lineno: int = 0) -> Turn:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"trace line {lineno}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TraceError(f"trace line {lineno}: expected an object")
    try:
        if "hash_ids" in data:
            return _mooncake(data, lineno)
        return _native(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"trace line {lineno}: {type(exc).__name__}: {exc}") from None


def _segment(data: dict[str, Any]) -> Segment:
    if "tokens" in data:
        return Segment(tokens=tuple(int(t) for t in data["tokens"]))
    length = int(data["len"])
    if length < 0 or not data["id"]:
        raise ValueError("a segment needs a non-empty 'id' and 'len' >= 0")
    return Segment(id=str(data["id"]), length=length)


def _native(data: dict[str, Any]) -> Turn:
    segments = tuple(_segment(s) for s in data["segments"])
    arrival = data.get("arrival_s")
    return Turn(
        session=str(data["session"]),
        turn=int(data.get("turn", 0)),
        segments=segments,
        output_tokens=int(data.get("output_tokens", 1)),
        think_s=float(data.get("think_s", 0.0)),
        arrival_s=None if arrival is None else float(arrival),
    )


def _mooncake(data: dict[str, Any], lineno: int) -> Turn:
    ids = [int(h) for h in data["hash_ids"]]
    total = int(data["input_length"])
    if not ids or total > len(ids) * MOONCAKE_BLOCK or total <= (len(ids) - 1) * MOONCAKE_BLOCK:
        raise ValueError(f"input_length {total} does not fit {len(ids)} hash ids of {MOONCAKE_BLOCK} tokens")
    last = total - (len(ids) - 1) * MOONCAKE_BLOCK
    segments = tuple(
        Segment(id=f"mc{h}", length=MOONCAKE_BLOCK if i < len(ids) - 1 else last) for i, h in enumerate(ids)
    )
    return Turn(
        session=f"mc{lineno}",
        turn=0,
        segments=segments,
        output_tokens=int(data.get("output_length", 1)),
        arrival_s=float(data.get("timestamp", 0)) / 1000.0,
    )


def check_sessions(turns: list[Turn]) -> None:
    """Turns of a session must be numbered 0, 1, 2, ... in file order (the replay submits them so)."""
    nxt: dict[str, int] = {}
    for t in turns:
        want = nxt.get(t.session, 0)
        if t.turn != want:
            raise TraceError(f"session {t.session!r}: turn {t.turn} found where turn {want} was expected")
        nxt[t.session] = want + 1


def sessions(turns: Iterable[Turn]) -> Iterator[list[Turn]]:
    """Turns grouped by session, sessions ordered by first appearance."""
    grouped: dict[str, list[Turn]] = {}
    for t in turns:
        grouped.setdefault(t.session, []).append(t)
    yield from grouped.values()
