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

What a trace may hold (anything else is a :class:`TraceError` naming the line): a regular file of UTF-8
lines of at most ``MAX_LINE_BYTES``; counts (``len``, ``turn``, ``output_tokens``, ``input_length``) are
integers from 0, a turn's prompt at most ``MAX_TOKENS`` tokens; token ids integers in [0, 2**31); times
(``think_s``, ``arrival_s``, ``timestamp``) finite numbers from 0 (at most 10**12 s).
Stdlib + numpy only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from umbp.regular_file import NotRegularFile, open_regular

VOCAB = 1 << 17  # token ids of synthetic segments: [16, VOCAB); random streams never collide in practice
MOONCAKE_BLOCK = 512
MAX_LINE_BYTES = 16 << 20  # one turn's line: a 1M-token prompt given as token ids is about 7 MiB
MAX_TOKENS = 1 << 24  # a turn's prompt (and its reply): 16.7M tokens, beyond any model's context
MAX_TOKEN_ID = 1 << 31
MAX_SECONDS = 1e12  # think_s, arrival_s: finite and >= 0 (NaN would stall the replay's clock)


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


def check_trace_output(path: str | Path) -> None:
    """Raise TraceError if `path` cannot take a trace (it is a folder, or a file stands where a folder of
    its path should): before the trace is generated, not after."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise TraceError(f"cannot write the trace to {path}: it is a folder; name a file")
    if path.exists() and not path.is_file():
        raise TraceError(f"cannot write the trace to {path}: not a regular file (a FIFO or device)")
    blocker = next((p for p in path.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise TraceError(f"cannot write the trace to {path}: {blocker} is a file, not a folder")


def write_trace(turns: Iterable[Turn], path: str | Path) -> int:
    path = Path(path).expanduser()
    check_trace_output(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as f:
        for turn in turns:
            f.write(json.dumps(turn.to_json(), separators=(",", ":")) + "\n")
            n += 1
    return n


def read_trace(path: str | Path) -> list[Turn]:
    """Every turn of the JSONL trace at `path`; TraceError (naming the file or line) on anything that is
    not one: a FIFO, device or folder is refused unopened, a line longer than MAX_LINE_BYTES unread."""
    turns = []
    with _open_regular(Path(path).expanduser()) as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"trace line {lineno}: longer than {MAX_LINE_BYTES >> 20} MiB")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(f"trace line {lineno}: not UTF-8 (byte {exc.start + 1})") from None
            if line.strip():
                turns.append(parse_line(line, lineno))
    check_sessions(turns)
    return turns


def _open_regular(path: Path):
    """`path` opened for binary reading if it is a regular file; opened without blocking, so a FIFO with
    no writer is refused rather than waited on."""
    try:
        fd = open_regular(path)
    except NotRegularFile:
        raise TraceError(
            f"trace {path}: not a regular file (a FIFO, device or folder); pass a JSONL file"
        ) from None
    except OSError as exc:
        raise TraceError(f"trace {path}: cannot open it: {exc.strerror or exc}") from None
    try:
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def parse_line(line: str, lineno: int = 0) -> Turn:
    try:
        data = json.loads(line)
    except RecursionError:
        raise TraceError(f"trace line {lineno}: not JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python converts
        raise TraceError(f"trace line {lineno}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TraceError(f"trace line {lineno}: expected an object")
    try:
        if "hash_ids" in data:
            turn = _mooncake(data, lineno)
        else:
            turn = _native(data)
    except KeyError as exc:
        raise TraceError(f"trace line {lineno}: missing field {exc}") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise TraceError(f"trace line {lineno}: {exc}") from None
    if turn.prompt_tokens > MAX_TOKENS:
        raise TraceError(
            f"trace line {lineno}: a prompt of {turn.prompt_tokens} tokens (at most {MAX_TOKENS})"
        )
    return turn


def _count(value: Any, what: str, hi: int = MAX_TOKENS) -> int:
    """A whole number in [0, hi] (a JSON integer, or a float with an integral value)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{what} must be a whole number, got {value}")
    if not 0 <= value <= hi:
        shown = value if abs(value) < 1e30 else "(a number of 30 digits or more)"
        raise ValueError(f"{what} {shown} is out of range [0, {hi}]")
    return int(value)


def _seconds(value: Any, what: str, hi: float = MAX_SECONDS) -> float:
    """A time: finite and in [0, hi]."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    out = float(value)
    if not (math.isfinite(out) and 0.0 <= out <= hi):
        raise ValueError(f"{what} must be a finite number in [0, {hi:g}], got {value}")
    return out


def _name(value: Any, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise TypeError(f"{what} must be a non-empty string")
    return str(value)


def _segment(data: Any) -> Segment:
    if not isinstance(data, dict):
        raise TypeError("a segment must be an object")
    if "tokens" in data:
        tokens = data["tokens"]
        if not isinstance(tokens, list):
            raise TypeError("'tokens' must be a list")
        if len(tokens) > MAX_TOKENS:
            raise ValueError(f"'tokens' holds {len(tokens)} tokens (at most {MAX_TOKENS})")
        return Segment(tokens=tuple(_count(t, "a token id", MAX_TOKEN_ID - 1) for t in tokens))
    return Segment(id=_name(data["id"], "a segment's 'id'"), length=_count(data["len"], "'len'"))


def _native(data: dict[str, Any]) -> Turn:
    segments = data["segments"]
    if not isinstance(segments, list):
        raise TypeError("'segments' must be a list")
    arrival = data.get("arrival_s")
    return Turn(
        session=_name(data["session"], "'session'"),
        turn=_count(data.get("turn", 0), "'turn'"),
        segments=tuple(_segment(s) for s in segments),
        output_tokens=_count(data.get("output_tokens", 1), "'output_tokens'"),
        think_s=_seconds(data.get("think_s", 0.0), "'think_s'"),
        arrival_s=None if arrival is None else _seconds(arrival, "'arrival_s'"),
    )


def _mooncake(data: dict[str, Any], lineno: int) -> Turn:
    hash_ids = data["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TypeError("'hash_ids' must be a list")
    if len(hash_ids) > MAX_TOKENS // MOONCAKE_BLOCK:
        raise ValueError(f"{len(hash_ids)} hash ids (at most {MAX_TOKENS // MOONCAKE_BLOCK})")
    ids = [_count(h, "a hash id", 1 << 64) for h in hash_ids]
    total = _count(data["input_length"], "'input_length'")
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
        output_tokens=_count(data.get("output_length", 1), "'output_length'"),
        arrival_s=_seconds(data.get("timestamp", 0), "'timestamp' (ms)", MAX_SECONDS * 1000) / 1000.0,
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
