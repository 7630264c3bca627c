"""argparse types for the tools' numeric options: a count of 0 or a negative size is refused by the
parser, with the option's name and the allowed range, before any work starts (not a ZeroDivisionError
minutes into a benchmark, nor a traceback from vLLM)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def whole(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer in [lo, hi] (no upper bound when hi is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            upper = f" and <= {hi}" if hi is not None else ""
            raise argparse.ArgumentTypeError(f"{value} is out of range: it must be >= {lo}{upper}")
        return value

    parse.__name__ = "integer"  # argparse names the type in "invalid <name> value" messages
    return parse


def number(positive: bool = False) -> Callable[[str], float]:
    """A finite number >= 0 (> 0 with `positive`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text} must be a finite number {'>' if positive else '>='} 0")
        return value

    parse.__name__ = "number"
    return parse


def counts(lo: int, hi: int | None = None, empty: bool = False) -> Callable[[str], list[int]]:
    """A comma list of integers in [lo, hi] ('1000000,10000000'); at least one unless `empty`."""
    one = whole(lo, hi)

    def parse(text: str) -> list[int]:
        values = [one(part.strip()) for part in text.split(",") if part.strip()]
        if not values and not empty:
            raise argparse.ArgumentTypeError(f"{text!r}: give at least one integer (a comma list)")
        return values

    parse.__name__ = "list"
    return parse


def names(known: tuple[str, ...], everything: str | None = None) -> Callable[[str], tuple[str, ...]]:
    """A comma list of names from `known`, at least one; `everything` (e.g. 'all') stands for all."""

    def parse(text: str) -> tuple[str, ...]:
        if everything is not None and text.strip() == everything:
            return known
        picked = tuple(part.strip() for part in text.split(",") if part.strip())
        unknown = [p for p in picked if p not in known]
        if unknown or not picked:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown)) or 'empty list'}; known: {', '.join(known)}"
                + (f" (or {everything})" if everything else "")
            )
        return picked

    parse.__name__ = "list"
    return parse
