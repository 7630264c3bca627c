"""A cold save's head: its first objects copied by the copy engines straight from their KV pages into
their arena slots, while the rest of the save is planned and gathered.

Why: a dma save's first copy needs its first round gathered into staging, and in front of that gather
lie the call's layout, plan, plan upload and launch: with one plan per call, ~170 us of a fast H100
host's time with the copy engine idle, a sixth of an 8K-token Granite save (the link moves its 46 MB in
~0.87 ms; bench/results/archive/2026-12-05-one-plan-per-call-42/4-timeline-*.txt). A KV page is a few
contiguous runs of bytes per layer (K and V halves, a state), 200-400 KiB each on such a model, so the
head is one call of a few dozen copies, issued as soon as the batch is validated (validation comes
first: a bad batch still writes nothing). The copy engine cannot checksum: the head's digests come
from a checksum-only launch of the copy kernel over the same KV pages, on the gather stream after the
rounds' gathers, from the call's one plan (its rows for the head objects are unused); the save's
handle completes after it. The pages are not rewritten before the handle completes (the caller's
contract for every save), so the bytes copied and the bytes checksummed are the same.

Tried before the call had one plan, when the head's digests needed a plan, upload and fetch of their
own: slower than no head on a host-bound H100 at 4-8 MiB (archive 40). Now the head is one copy call and
one launch on top of the call: on a fast H100 host an 8K save's first copy goes out 62 us into the call
instead of 168, and the save reads 0.903 of the link instead of 0.825 (16K 0.928 vs 0.879, 128K 0.976 vs
0.965; interleaved, faster in 31 of 31 calls at every size; archive 43, `4-ab.txt`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from umbp.transfer.api import Moves
from umbp.transfer.batchcopy import HeadCopy
from umbp.transfer.geometry import GroupGeometry
from umbp.transfer.rounds import SAVE
from umbp.transfer.staged import Batch

# ~0.3 ms of copy at 55 GB/s: longer than the host work in front of the first gathered round's copy even on
# a slow host, where 16 MiB beat 4 and 8 MiB at 8K tokens (0.80 vs 0.67 / 0.72 of the link) and came
# within 0.02 of 64 MiB; on a fast host 8, 16 and 32 MiB were within 0.01 (H100 machines, archive 43)
SAVE_HEAD_BYTES = 16 << 20
# a head copy below this runs well under the link rate (64 KiB runs in one batch call: 0.81 D2H, H200)
SAVE_HEAD_MIN_RUN = 64 << 10


@dataclass(frozen=True)
class Runs:
    """An object's bytes as runs of KV memory: run j of block b is `src[j] + b * stride[j]`, `nbytes[j]`
    long, at byte `obj[j]` of the object. Segments of one layer adjacent in memory are merged."""

    src: np.ndarray
    stride: np.ndarray
    obj: np.ndarray
    nbytes: np.ndarray


def object_runs(geom: GroupGeometry) -> Runs:
    """The group's objects as runs of KV memory (see Runs), in object order: its piece template
    (geometry.Template) with each piece that continues the one before it, in KV memory and in the
    object, merged into it."""
    t = geom.template
    new = np.ones(t.src.size, dtype=bool)
    new[1:] = (
        (t.src[1:] != t.src[:-1] + t.nbytes[:-1])
        | (t.obj[1:] != t.obj[:-1] + t.nbytes[:-1])
        | (t.stride[1:] != t.stride[:-1])
    )
    starts = np.flatnonzero(new)
    return Runs(t.src[starts], t.stride[starts], t.obj[starts], np.add.reduceat(t.nbytes, starts))


class SaveHead:
    """The head of KernelEngine's cold dma saves (see the module docstring): a mixin, as EarlyCopies is
    for restores. `save_head_bytes` (an engine argument; 0: no head) bounds the head's bytes;
    `save_head_min_run` is the shortest KV run a head object may have."""

    save_head_bytes: int = SAVE_HEAD_BYTES
    save_head_min_run: int = SAVE_HEAD_MIN_RUN
    _head_copy: HeadCopy | None  # batchcopy.load_head's copy (None: no head)

    @cached_property
    def _head_runs(self) -> dict[int, Runs]:
        return {g: object_runs(geom) for g, geom in self.groups.items()}

    @cached_property
    def _head_shortest(self) -> dict[int, int]:
        """Per group, its shortest run of KV memory (0: none), looked up once instead of per call."""
        return {g: int(r.nbytes.min()) if r.nbytes.size else 0 for g, r in self._head_runs.items()}

    def _head_count(self, batch: Batch) -> int:
        """How many of the first Moves' objects make the head: as many whole objects as fit in
        save_head_bytes (at least one), never every object of the call (the rest keeps the rounds'
        path), none where the runtime's copy call is missing or the group's runs are short."""
        geom, m, ids, _offs = batch[0]
        shortest = self._head_shortest.get(m.group, 0)
        if (
            self.save_head_bytes <= 0
            or self._head_copy is None
            or not shortest
            or shortest < self.save_head_min_run
        ):
            return 0
        fit = max(1, self.save_head_bytes // geom.object_bytes)
        return min(ids.size, self.flat(batch)[0].nobj - 1, fit)

    def _head(self, batch: Batch, count: int, save, queued) -> None:
        """Copy the first `count` objects from their KV pages to their slots on the save stream, after
        the caller's queued work (`queued`: its marker event); their digests are _head_sums'."""
        _geom, m, ids, offs = batch[0]
        runs = self._head_runs[m.group]
        if save is not None:
            save.wait_event(queued)
        handle = save.cuda_stream if save is not None else 0  # None: CPU tensors (tests' host copies)
        batched = count * runs.src.size >= self.batch_copy_min_runs
        self._head_copy(self.arena_base, offs, ids, runs, count, handle, batched)

    def _head_sums(self, plan, count: int, wide: bool) -> None:
        """The head's digests into the plan's sums: the copy kernel reading their KV pages,
        checksumming, storing nothing (on the current stream, the gather stream)."""
        self._copy(plan, plan.span(0, count), None, (0, 0), wide, checksum=True, store=False, hbm=True)

    def _warm_head_sums(self, group: int, block: int, offset: int) -> None:
        """Compile the head digests' kernel variant (warm_up): one object's, on the gather stream."""
        batch = self._checked([Moves(group, [block], [offset])], load=False)
        gather = self._side(SAVE)
        with self._stream(gather):
            plan = self._plan(batch, [np.zeros(1, np.int64)], sums=True, stream=gather)
            self._head_sums(plan, 1, self._wide(batch))
        self.synchronize()
