"""Hybrid prefix lookup: the longest boundary at which every cache group can resume.

:func:`longest_hit` answers with the same boundary and the same objects as vLLM 0.32's
``HybridKVCacheCoordinator.find_longest_cache_hit`` (and ``UnitaryKVCacheCoordinator`` for one group) when
fed the same "which objects exist" answers; ``tests/vllm/test_hybrid_differential.py`` proves it.
:func:`explain` says why a restore stopped where it did. Pure Python (layer 1).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Container, Iterable, Sequence
from dataclasses import dataclass

from umbp.hybrid.groups import (
    CacheGroup,
    FullAttention,
    GroupHit,
    Has,
    Need,
    RecurrentState,
    Space,
    resolve_groups,
)


@dataclass(frozen=True)
class Hit:
    """Where a request can resume, and what to load for it.

    ``tokens``: the resume point (0: none). ``loads[g]``: sorted ends of group ``g``'s objects to load;
    the object ending at ``e`` goes into block ``(e - 1) // B`` of the group. ``alignment``: every hit of
    this configuration is a multiple of it.
    """

    tokens: int
    loads: tuple[tuple[int, ...], ...]
    alignment: int


def partial_hits_enabled(groups: Sequence[CacheGroup], unit: int, dcp_world_size: int = 1) -> bool:
    """vLLM's ``partial_hash_hits_enabled``: hits may land on any ``unit`` boundary only if some recurrent
    group has blocks longer than ``unit`` (at least ``unit`` under DCP, which scales the attention blocks
    instead) and every group can probe inside its blocks or has unit-long blocks (DCP spans)."""
    if len(groups) < 2:
        return False
    if dcp_world_size > 1:
        long_state = any(isinstance(g, RecurrentState) and g.block_size >= unit for g in groups)
    else:
        long_state = any(isinstance(g, RecurrentState) and g.block_size > unit for g in groups)
    if not long_state:
        return False
    return all(g.fine_grained or g.span(dcp_world_size) == unit for g in groups)


def hit_alignment(groups: Sequence[CacheGroup], unit: int, dcp_world_size: int = 1) -> int:
    """Granularity of every hit: ``unit`` with partial hits, else the scheduler block size (the lcm of the
    groups' token spans)."""
    spans = [g.span(dcp_world_size) for g in groups]
    if len(groups) == 1:
        return spans[0]
    if partial_hits_enabled(groups, unit, dcp_world_size):
        return unit
    return math.lcm(*spans)


def check_context_parallel(groups: Sequence[CacheGroup], dcp_world_size: int, pcp_world_size: int) -> None:
    """Raise ``ValueError`` for what vLLM 0.32's coordinators and managers refuse under DCP/PCP.

    A hybrid layout takes full attention, recurrent state (DCP only) and replicated attention groups; a
    DCP/PCP-sharded sliding window cannot be looked up at all. With one group, vLLM's unitary coordinator
    hands the raw PCP size to the manager, and only the full-attention lookup accepts PCP > 1.
    """
    if dcp_world_size < 1 or pcp_world_size < 1:
        raise ValueError(
            f"dcp_world_size and pcp_world_size must be >= 1, got {dcp_world_size}, {pcp_world_size}"
        )
    for g, spec in enumerate(groups):
        window = not isinstance(spec, FullAttention | RecurrentState)
        if window and spec.dcp_sharded and (dcp_world_size > 1 or pcp_world_size > 1):
            raise ValueError(
                f"group {g} ({spec.describe()}): vLLM 0.32 does not look up a DCP/PCP-sharded sliding window; "
                "only a replicated one (dcp_sharded=False)"
            )
        if pcp_world_size > 1 and len(groups) == 1 and not isinstance(spec, FullAttention):
            raise ValueError(
                f"group {g} ({spec.describe()}): vLLM 0.32 looks up only full attention under PCP"
            )
        if pcp_world_size > 1 and isinstance(spec, RecurrentState):
            raise ValueError(
                f"group {g} ({spec.describe()}): vLLM 0.32's hybrid coordinator accepts PCP only with full "
                "attention and replicated attention groups"
            )


def resolve_eagle_ids(num_groups: int, eagle: bool, eagle_groups: Iterable[int] | None) -> frozenset[int]:
    """Groups that take EAGLE's drop: the flagged ones, or all when EAGLE is on and none is flagged."""
    flagged = frozenset(eagle_groups or ())
    if any(not 0 <= g < num_groups for g in flagged):
        raise ValueError(f"eagle_groups {sorted(flagged)} out of range for {num_groups} groups")
    if not flagged and eagle:
        return frozenset(range(num_groups))
    return flagged


@dataclass(frozen=True)
class _Lookup:
    """Groups sharing one spec are looked up jointly (every member must hold the object), as in vLLM."""

    spec: CacheGroup
    members: list[int]
    eagle: bool
    has: Has


@dataclass(frozen=True)
class _Request:
    groups: tuple[CacheGroup, ...]  # token spans (DCP resolved)
    space: Space
    max_tokens: int
    lookups: tuple[_Lookup, ...]
    eagle_ids: frozenset[int]
    dcp: int = 1


def _prepare(
    groups: Sequence[CacheGroup],
    unit: int,
    present: Sequence[Container[int]],
    max_tokens: int,
    eagle: bool,
    eagle_groups: Iterable[int] | None,
    hashed_tokens: int | None,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
) -> _Request:
    if not groups:
        raise ValueError("need at least one cache group")
    check_context_parallel(groups, dcp_world_size, pcp_world_size)
    alignment = hit_alignment(groups, unit, dcp_world_size)
    groups = resolve_groups(groups, dcp_world_size)
    if len(present) != len(groups):
        raise ValueError(f"present has {len(present)} entries for {len(groups)} groups")
    if unit <= 0 or any(g.block_size <= 0 or g.block_size % unit for g in groups):
        raise ValueError(f"unit {unit} must divide every block size {[g.block_size for g in groups]}")
    if len(groups) == 1 and groups[0].block_size != unit:
        raise ValueError("with one cache group vLLM hashes per block: unit must equal its block (DCP span)")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if hashed_tokens is None:
        # vLLM: max_tokens = prompt - 1, and the request has one key per full unit of the prompt.
        hashed_tokens = (max_tokens + 1) // unit * unit
    if hashed_tokens % unit or hashed_tokens < max_tokens // unit * unit:
        raise ValueError(f"hashed_tokens {hashed_tokens} must be a multiple of {unit} covering max_tokens")
    for g, ends in enumerate(present):
        if isinstance(ends, Collection) and any(e <= 0 or e % unit for e in ends):
            raise ValueError(f"present[{g}] holds token ends that are not positive multiples of {unit}")
    eagle_ids = resolve_eagle_ids(len(groups), eagle, eagle_groups)
    space = Space(unit, alignment, hashed_tokens)
    return _Request(groups, space, max_tokens, _merge(groups, present, eagle_ids), eagle_ids, dcp_world_size)


def _merge(
    groups: tuple[CacheGroup, ...], present: Sequence[Container[int]], eagle_ids: frozenset[int]
) -> tuple[_Lookup, ...]:
    members: dict[CacheGroup, list[int]] = {}
    for g, spec in enumerate(groups):
        members.setdefault(spec, []).append(g)
    lookups = [
        _Lookup(spec, ids, any(g in eagle_ids for g in ids), _joint([present[g] for g in ids]))
        for spec, ids in members.items()
    ]
    # Full attention first (stable): its one left-to-right lookup bounds the others.
    return tuple(sorted(lookups, key=lambda lk: not lk.spec.downward_closed))


def _joint(sets: list[Container[int]]) -> Has:
    # a Container that is no Collection is a lazy probe (see longest_hit): asked, never enumerated
    sets = [
        s if isinstance(s, set | frozenset) or not isinstance(s, Collection) else frozenset(s) for s in sets
    ]
    if len(sets) == 1:
        return sets[0].__contains__
    return lambda t: all(t in s for s in sets)


def _lookup(lk: _Lookup, limit: int, space: Space, drop: bool) -> GroupHit:
    if drop:
        limit = min(limit + lk.spec.eagle_margin(space), space.hashed_tokens)
    return lk.spec.longest(lk.has, limit, space, drop)


def _coordinate(req: _Request) -> tuple[int, dict[int, GroupHit]]:
    """vLLM's fixed point: each group either accepts the candidate or lowers it, until no group lowers it.

    Downward-closed groups are looked up once and only trimmed afterwards. An EAGLE group drops once, then
    is re-checked without the drop until a non-dropping lookup lowers the candidate (vLLM's
    ``eagle_verified``; docs/hybrid.md, quirk 1).
    """
    space, lookups = req.space, req.lookups
    hits: dict[int, GroupHit] = {}
    target = req.max_tokens
    single_pass = len(lookups) == 2 and lookups[0].spec.downward_closed
    verified: set[int] = set()
    while True:
        curr = target
        for idx, lk in enumerate(lookups):
            if lk.spec.downward_closed and idx in hits:
                curr = min(curr, hits[idx].tokens)
                continue
            drop = lk.eagle and idx not in verified
            hit = _lookup(lk, curr, space, drop)
            if drop:
                verified.add(idx)
            elif hit.tokens < curr:
                verified.clear()
            curr = hit.tokens
            hits[idx] = hit
        if curr >= target:
            break
        target = curr
        if single_pass:
            break
    return target, hits


def _trim(hit: GroupHit, tokens: int, block_size: int) -> GroupHit:
    return GroupHit(tokens, hit.blocks[: -(-tokens // block_size)])


def longest_hit(
    groups: Sequence[CacheGroup],
    unit: int,
    present: Sequence[Container[int]],
    max_tokens: int,
    eagle: bool = False,
    eagle_groups: Iterable[int] | None = None,
    hashed_tokens: int | None = None,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
) -> Hit:
    """The longest point every group can resume at, and per group the objects to load.

    ``groups``: block sizes per rank, as in vLLM's specs. ``present[g]``: ends ``t`` (multiples of
    ``unit``) of group ``g``'s existing objects for ``[0, t)``: a collection, or a lazy container that
    answers ``t in present[g]`` for the boundaries the groups' rules actually probe (a few hundred for a
    stored 8,192-unit prompt, one for a cold one) instead of listing all of them; it is never
    enumerated, so its ends are not validated. ``max_tokens``: the most that may be
    restored (vLLM: prompt length - 1). ``hashed_tokens``: where the request's keys end (vLLM:
    ``len(block_hashes) * unit``); default ``(max_tokens + 1)`` rounded down to ``unit``. ``eagle``:
    EAGLE's drop on every group unless ``eagle_groups`` names the flagged ones. ``dcp_world_size``: a
    sharded attention block spans ``block_size * dcp`` tokens (the object ending at ``e`` goes into block
    ``(e - 1) // span``); ``pcp_world_size`` changes no boundary in vLLM 0.32, only what is accepted.
    """
    return _longest(
        _prepare(
            groups,
            unit,
            present,
            max_tokens,
            eagle,
            eagle_groups,
            hashed_tokens,
            dcp_world_size,
            pcp_world_size,
        )
    )


def _longest(req: _Request) -> Hit:
    if len(req.groups) == 1:
        # vLLM's single-group coordinator: block-aligned hits and no EAGLE margin.
        lk = req.lookups[0]
        one = lk.spec.longest(lk.has, req.max_tokens, req.space, 0 in req.eagle_ids)
        return Hit(one.tokens, (one.loads,), req.space.align)
    tokens, hits = _coordinate(req)
    loads: list[tuple[int, ...]] = [()] * len(req.groups)
    for idx, lk in enumerate(req.lookups):
        hit = hits[idx]
        if lk.spec.downward_closed:
            hit = _trim(hit, tokens, lk.spec.block_size)
        for g in lk.members:
            loads[g] = hit.loads
    return Hit(tokens, tuple(loads), req.space.align)


# ---------------------------------------------------------------------------------------- explanations


@dataclass(frozen=True)
class GroupStatus:
    """One group at one boundary: ready (``has``: the objects it would load) or not (``missing``)."""

    group: int
    ready: bool
    has: tuple[int, ...]
    missing: tuple[Need, ...]
    note: str = ""


@dataclass(frozen=True)
class Boundary:
    """A boundary above the hit that some group could resume at, and every group's status there."""

    tokens: int
    groups: tuple[GroupStatus, ...]


@dataclass(frozen=True)
class Explanation:
    """``boundaries``: the nearest points above the hit some group could resume at. ``at_hit``: groups that
    vLLM accepts at the hit although their own rule is not met there (the EAGLE re-check quirk)."""

    hit: Hit
    max_tokens: int
    boundaries: tuple[Boundary, ...]
    at_hit: tuple[GroupStatus, ...]
    text: str


def _probe(req: _Request, lk: _Lookup, t: int) -> GroupHit:
    """One group's own lookup for resuming at ``t`` (EAGLE groups match past ``t`` first)."""
    limit = t
    if lk.eagle:
        cap = req.max_tokens if len(req.groups) == 1 else req.space.hashed_tokens
        limit = min(t + lk.spec.eagle_margin(req.space), cap)
    return lk.spec.longest(lk.has, limit, req.space, lk.eagle)


def _reaches(req: _Request) -> dict[int, GroupHit]:
    """Downward-closed groups' single lookups, as the coordinator's first pass runs them: each one only up
    to the previous one's hit, so a page past that hit is never seen (vLLM behaviour)."""
    reaches: dict[int, GroupHit] = {}
    limit = req.max_tokens
    for idx, lk in enumerate(req.lookups):
        if lk.spec.downward_closed:
            reaches[idx] = _probe(req, lk, limit)
            limit = reaches[idx].tokens
    return reaches


def _status_at(
    req: _Request, lk: _Lookup, reach: GroupHit | None, t: int, present: Sequence[Collection[int]]
) -> list[GroupStatus]:
    """Every member's status at ``t``; a downward-closed group is ready anywhere up to its reach."""
    if reach is not None:
        ready = reach.tokens >= t
        hit = _trim(reach, t, lk.spec.block_size) if ready else reach
    else:
        hit = _probe(req, lk, t)
        ready = hit.tokens == t
    needs = lk.spec.needs(t, req.space, lk.eagle)
    out = []
    for g in lk.members:
        if ready:
            out.append(GroupStatus(g, True, hit.loads, ()))
            continue
        missing = tuple(n for n in needs if n.end not in present[g] or n.end > req.space.hashed_tokens)
        note = "" if missing else f"its lookup lands at {hit.tokens}"
        out.append(GroupStatus(g, False, (), missing, note))
    return out


def _candidates(
    req: _Request, reaches: dict[int, GroupHit], tokens: int, present: Sequence[Collection[int]]
) -> list[int]:
    """Boundaries above the hit at which at least one group could resume on its own."""
    space, found = req.space, set()
    for idx, lk in enumerate(req.lookups):
        if idx in reaches:
            if reaches[idx].tokens > tokens:
                found.add(reaches[idx].tokens)
            continue
        margin = lk.spec.eagle_margin(space) if lk.eagle else 0
        for top in present[lk.members[0]]:
            t = top - margin
            if tokens < t <= req.max_tokens and t % space.align == 0 and t not in found and lk.has(top):
                if _probe(req, lk, t).tokens == t:
                    found.add(t)
    return sorted(found)


def _ends(ends: Sequence[int]) -> str:
    if len(ends) <= 4:
        return ", ".join(map(str, ends))
    return f"{ends[0]}, {ends[1]}, ..., {ends[-1]} ({len(ends)} objects)"


def _describe(req: _Request, st: GroupStatus) -> str:
    who = f"group {st.group} ({req.groups[st.group].describe()})"
    if st.ready:
        return f"{who} has {_ends(st.has)}"
    parts = []
    hashed = req.space.hashed_tokens
    for n in st.missing[:2]:
        past = f", past the hashed prefix ({hashed})" if n.end > hashed else ""
        parts.append(f"{n.end} ({n.what}{past})")
    more = f" and {len(st.missing) - 2} more" if len(st.missing) > 2 else ""
    if parts:
        noun = "object" if len(st.missing) == 1 else "objects"
        return f"{who} has no {noun} at {', '.join(parts)}{more}"
    return f"{who} cannot resume here: {st.note}"


def explain_hit(
    groups: Sequence[CacheGroup],
    unit: int,
    present: Sequence[Collection[int]],
    max_tokens: int,
    eagle: bool = False,
    eagle_groups: Iterable[int] | None = None,
    hashed_tokens: int | None = None,
    limit: int = 3,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
) -> Explanation:
    """Why the restore stopped where it did: at the nearest boundaries above the hit that some group could
    resume at (at most ``limit``), which group lacks which object. Arguments as :func:`longest_hit`."""
    req = _prepare(
        groups, unit, present, max_tokens, eagle, eagle_groups, hashed_tokens, dcp_world_size, pcp_world_size
    )
    hit, reaches, space = _longest(req), _reaches(req), req.space

    def statuses(t: int) -> list[GroupStatus]:
        found = [
            st for i, lk in enumerate(req.lookups) for st in _status_at(req, lk, reaches.get(i), t, present)
        ]
        return sorted(found, key=lambda st: (st.ready, st.group))

    lines = [
        f"stopped at {hit.tokens} of max {max_tokens} (unit {unit}, hits aligned to {space.align}"
        + (f", EAGLE drop on groups {sorted(req.eagle_ids)}" if req.eagle_ids else "")
        + (f", DCP {req.dcp}: B below is a block's token span over all ranks" if req.dcp > 1 else "")
        + ")"
    ]
    at_hit = tuple(st for st in statuses(hit.tokens) if not st.ready) if hit.tokens else ()
    if at_hit:
        quirk = "vLLM accepts it: an EAGLE group checked with its drop at a higher candidate is re-checked without it"
        lines.append(
            f"  at {hit.tokens} (the hit): " + "; ".join(_describe(req, st) for st in at_hit) + f"; {quirk}"
        )
    points = _candidates(req, reaches, hit.tokens, present)
    nxt = hit.tokens + space.align
    if not points and nxt <= max_tokens:
        points = [nxt]
    boundaries = tuple(Boundary(t, tuple(statuses(t))) for t in points[:limit])
    if not boundaries:
        lines.append(f"  nothing above {hit.tokens} fits: the next boundary {nxt} exceeds max {max_tokens}")
    for b in boundaries:
        if all(st.ready for st in b.groups):
            why = "every group can resume here on its own, but an EAGLE group re-checked without its drop lowered vLLM's candidate"
            lines.append(f"  at {b.tokens}: {why}")
        else:
            lines.append(f"  at {b.tokens}: " + "; ".join(_describe(req, st) for st in b.groups))
    if len(points) > limit:
        lines.append(f"  ({len(points) - limit} more boundaries above {points[limit - 1]} not shown)")
    return Explanation(hit, max_tokens, boundaries, at_hit, "\n".join(lines))


def explain(
    groups: Sequence[CacheGroup],
    unit: int,
    present: Sequence[Collection[int]],
    max_tokens: int,
    eagle: bool = False,
    eagle_groups: Iterable[int] | None = None,
    hashed_tokens: int | None = None,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
) -> str:
    """Human-readable answer to "why did the restore stop at T?" (see :func:`explain_hit`)."""
    return explain_hit(
        groups,
        unit,
        present,
        max_tokens,
        eagle,
        eagle_groups,
        hashed_tokens,
        dcp_world_size=dcp_world_size,
        pcp_world_size=pcp_world_size,
    ).text
