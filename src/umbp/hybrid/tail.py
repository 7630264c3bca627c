"""Prompt-tail restores for attention-only layouts: resume inside a block, not only at its start.

vLLM's scheduler takes an external hit of any length and allocates ``ceil(hit / B)`` blocks for it, so a
connector may restore a prefix that ends inside a block as long as the page it loads into that block holds
every token below the hit. For full attention that holds for the page of a prompt's last, partly filled
block: attention pages are append-only, so the page saved after ``[k*B, P)`` was computed serves every
resume point in ``(k*B, P]``. vLLM's own lookup cannot use such a page for an attention-only model (with
one cache group its hashes, and so its hits, are block-granular), which leaves up to ``B - 1`` prompt
tokens to recompute on every repeat.

umbp therefore stores that page under a key of its own, the prefix ``[0, e)`` with ``e`` the prompt's last
whole ``tail_unit``, and its lookup, after the block-aligned hit ``h``, probes the page ends inside block
``h // B`` from the top down. A hit at ``e`` resumes at ``min(e, max_tokens)``.

Only layouts of full-attention and sliding-window groups with one common block span qualify
(:func:`tail_span`): a recurrent state must sit exactly at the boundary (hybrids keep vLLM's boundary
rule), EAGLE needs a drop this path does not model, and under DCP a block is sharded over ranks (the old,
block-aligned behaviour stays there). A sliding window's page is append-only like full attention's; its
window at the later resume point needs a subset of the blocks the block-aligned hit loads. Pure Python (layer 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from umbp.hybrid.groups import CacheGroup, FullAttention, SlidingWindow
from umbp.hybrid.lookup import Hit


def tail_span(
    groups: Sequence[CacheGroup], tail_unit: int, dcp_world_size: int = 1, eagle_groups: Iterable[int] = ()
) -> int | None:
    """The block span ``B`` when prompt-tail restores apply to this layout, else ``None``.

    They apply when ``tail_unit`` is set and splits a block (``0 < tail_unit < B``, ``B % tail_unit == 0``),
    every group is full attention or a sliding window with the same block size, no group takes EAGLE's
    drop, and DCP is off.
    """
    if tail_unit <= 0 or dcp_world_size != 1 or frozenset(eagle_groups) or not groups:
        return None
    if not all(isinstance(g, FullAttention | SlidingWindow) for g in groups):
        return None
    spans = {g.block_size for g in groups}
    if len(spans) != 1:
        return None
    span = spans.pop()
    if span <= tail_unit or span % tail_unit:
        return None
    return span


def tail_page_end(prompt_tokens: int, span: int, tail_unit: int) -> int | None:
    """The key end of the prompt's tail page: the prompt's last whole ``tail_unit``, when it falls inside a
    block (a block-aligned end is a full block, which the full-block path stores)."""
    end = prompt_tokens // tail_unit * tail_unit
    if end <= 0 or end % span == 0:
        return None
    return end


def tail_probe_ends(base: int, span: int, tail_unit: int, max_tokens: int, known_tokens: int) -> list[int]:
    """Page ends a lookup probes past the block-aligned hit ``base``, best first.

    A page ending at ``e`` in ``(base, base + B]`` fills block ``base // B`` up to ``e``; its key covers the
    tokens ``[0, e)``, so ``e`` cannot pass ``known_tokens`` (the request's tokens). Only ends whose resume
    point ``min(e, max_tokens)`` lies past ``base`` are useful.
    """
    if base % span or base >= max_tokens:
        return []
    top = min(base + span, known_tokens // tail_unit * tail_unit)
    return [e for e in range(top, base, -tail_unit) if min(e, max_tokens) > base]


def extend_hit(
    groups: Sequence[CacheGroup],
    hit: Hit,
    base: int,
    tail_unit: int,
    max_tokens: int,
    known_tokens: int,
    has_page: Callable[[int], bool],
) -> Hit:
    """``hit`` extended into block ``base // B`` when every group holds a page there (``has_page(e)``).

    ``base`` is where the block-aligned restore ends: the larger of ``hit.tokens`` and the local GPU hit
    (blocks below it are not loaded). ``groups`` as accepted by :func:`tail_span`. A sliding window needs
    fewer blocks at the later resume point ``t`` (its window ``[t - window + 1, t)`` starts later) and
    vLLM nulls the blocks wholly below it, so those are not loaded. Returns ``hit`` unchanged when no page
    is found.
    """
    span = groups[0].block_size
    for end in tail_probe_ends(base, span, tail_unit, max_tokens, known_tokens):
        if has_page(end):
            tokens = min(end, max_tokens)
            loads = tuple(_kept(g, ends, tokens) + (end,) for g, ends in zip(groups, hit.loads))
            return Hit(tokens, loads, hit.alignment)
    return hit


def _kept(group: CacheGroup, ends: Sequence[int], tokens: int) -> tuple[int, ...]:
    """The objects of ``group`` a resume at ``tokens`` still uses (vLLM ``get_num_skipped_tokens``)."""
    if not isinstance(group, SlidingWindow):
        return tuple(ends)
    first = max(0, tokens - group.window + 1) // group.block_size  # blocks below are null in vLLM's table
    return tuple(e for e in ends if (e - 1) // group.block_size >= first)
