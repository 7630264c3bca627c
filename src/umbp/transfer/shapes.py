"""Per-object constants of a batch, computed once per batch shape and reused.

A restore is one Moves per cache group (Granite-4.0-H: 8), most of them one object each, and a serving
engine sends batches of the same few shapes over and over. Every step of a call (validation, run
sorting, plan building, result digests) needed the same per-object arrays expanded from per-Moves values
(object size, slot reach, block-id limit, the psum64 length term, the plan's segment table), each a few
numpy calls of ~1-5 us on a slow host, repeated per call and per round. A `BatchShape` holds them for one
shape: the sequence of (group, objects, slot reach) of the batch's Moves, which is all they depend on
besides the engine's fixed groups.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from umbp.transfer.geometry import GroupGeometry

ShapeKey = tuple[tuple[int, int, int], ...]  # per Moves: (group, objects, slot reach in bytes)


def _u64(v: int) -> int:
    return v & ((1 << 64) - 1)


def length_term(nbytes: int) -> int:
    """psum64's length term for an object of nbytes (umbp.pool.checksum), as an unsigned 64-bit int."""
    from umbp.pool.checksum import GOLDEN

    return _u64(nbytes * GOLDEN)


@dataclass(frozen=True, eq=False)
class BatchShape:
    """Per-object arrays (batch order) and the plan's segment table for one ShapeKey. Read-only: shared
    by every call of this shape."""

    key: ShapeKey
    counts: tuple[int, ...]
    nobj: int
    size: np.ndarray  # int64: each object's bytes
    reach: np.ndarray  # int64: each object's slot reach (>= size)
    limit: np.ndarray  # int64: each object's group's block count (ids must lie below it)
    mix: np.ndarray  # uint64: each object's psum64 length term
    seg: np.ndarray  # int64 [4, nseg]: first piece, first object, pieces per object, template column
    pieces: int  # pieces of the whole batch (the copy kernel's work items)
    distinct_groups: bool  # no group appears in two Moves (then duplicate ids can only repeat within one)
    uniform_reach: int | None  # every slot's reach, if they are all equal
    total_size: int  # bytes of all objects
    total_reach: int  # arena bytes all slots span
    max_reach: int  # the widest slot's reach
    seg_lists: tuple[tuple[int, ...], ...]  # seg's rows as tuples, for piece()

    def piece(self, obj: int) -> int:
        """Index of object `obj`'s first piece (obj == nobj: the batch's piece count): where the launch
        of a round that starts at that object starts."""
        first_piece, first_obj, per, _column = self.seg_lists
        s = bisect_right(first_obj, obj) - 1
        return first_piece[s] + (obj - first_obj[s]) * per[s]


def make_shape(key: ShapeKey, groups: Mapping[int, GroupGeometry], toff: Mapping[int, int]) -> BatchShape:
    counts = tuple(c for _g, c, _r in key)
    geoms = [groups[g] for g, _c, _r in key]
    per = np.array([geom.template.obj.size for geom in geoms], np.int64)
    cnt = np.array(counts, np.int64)
    pieces = cnt * per
    seg = np.empty((4, len(key)), np.int64)
    seg[0] = np.cumsum(pieces) - pieces
    seg[1] = np.cumsum(cnt) - cnt
    seg[2] = per
    seg[3] = [toff[g] for g, _c, _r in key]
    reaches = {r for _g, _c, r in key}
    arrays = [
        np.repeat(np.array(col, np.int64), cnt)
        for col in (
            [geom.object_bytes for geom in geoms],
            [r for _g, _c, r in key],
            [geom.num_blocks for geom in geoms],
        )
    ]
    mix = np.repeat(np.array([length_term(geom.object_bytes) for geom in geoms], np.uint64), cnt)
    for a in (*arrays, mix, seg):
        a.setflags(write=False)
    groups_seen = [g for g, _c, _r in key]
    return BatchShape(
        key=key,
        counts=counts,
        nobj=int(cnt.sum()),
        size=arrays[0],
        reach=arrays[1],
        limit=arrays[2],
        mix=mix,
        seg=seg,
        pieces=int(pieces.sum()),
        distinct_groups=len(set(groups_seen)) == len(groups_seen),
        uniform_reach=reaches.pop() if len(reaches) == 1 else None,
        total_size=int(arrays[0].sum()),
        total_reach=int(arrays[1].sum()),
        max_reach=int(arrays[1].max()) if arrays[1].size else 0,
        seg_lists=tuple(tuple(row) for row in seg.tolist()),
    )


class ShapeCache:
    """BatchShapes by key, least recently used dropped beyond `capacity` (shapes vary with a request's
    block count, so a long-running engine meets many; each entry is a few arrays of its objects)."""

    def __init__(self, groups: Mapping[int, GroupGeometry], toff: Mapping[int, int], capacity: int = 256):
        self.groups, self.toff, self.capacity = groups, toff, capacity
        self._shapes: OrderedDict[ShapeKey, BatchShape] = OrderedDict()
        self.misses = 0

    def get(self, key: ShapeKey) -> BatchShape:
        shape = self._shapes.get(key)
        if shape is None:
            self.misses += 1
            shape = self._shapes[key] = make_shape(key, self.groups, self.toff)
            if len(self._shapes) > self.capacity:
                self._shapes.popitem(last=False)
        else:
            self._shapes.move_to_end(key)
        return shape

    def __len__(self) -> int:
        return len(self._shapes)


def template_offsets(groups: Sequence[tuple[int, GroupGeometry]]) -> dict[int, int]:
    """The column where each group's pieces start in the engine's template table (plans.templates lays
    the groups out in this order)."""
    toff, at = {}, 0
    for g, geom in groups:
        toff[g] = at
        at += geom.template.obj.size
    return toff
