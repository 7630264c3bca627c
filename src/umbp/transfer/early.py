"""A transfer's first copies, issued before its batch is validated and planned.

Why: a restore someone waits for (or a save before an eviction) starts with an idle copy engine, and
every microsecond of host work in front of its first copy adds to its time. Validating the whole batch,
laying its rounds out in staging and the batch-copy call took ~85 us of the H200 host's time before a
restore's first byte moved (a save's ~180 us, with its first round's plan and gather in front), against
0.84 ms for an 8K-token Granite restore's bytes on the link. The first few large objects of the batch's
first Moves need far less, so they go first:

* a load copies them arena -> staging (one `cudaMemcpyAsync` each) with only their arena offsets checked
  (integers, 8-byte aligned, inside the arena: the copy reads nothing else); the first round's verify
  and scatter read them from there, so they are checked against their digests and written like any
  other object, after the whole batch is validated. A bad batch raises before any KV page is written:
  the early copies only filled the engine's own staging.
* a save gathers them (block ids checked against their group's blocks, slots checked as above and
  against each other) into staging with their checksums and copies them to their slots. A bad batch
  raises as without them, but those slots, which the caller named for this save, may have been
  written: the caller drops the slots of a save that raised, as of any failed save.

They go to an area at the end of a ring buffer (kept for them, past the rounds' room), which the first
round of the rest uses too; the rest of the batch is laid out and copied as usual while they run.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from umbp.transfer.api import Handle, Moves, slot_reach
from umbp.transfer.geometry import GroupGeometry
from umbp.transfer.plans import aligned
from umbp.transfer.ring import StagingRing
from umbp.transfer.rounds import LOAD, SAVE

EARLY_BYTES, EARLY_OBJECTS = 4 << 20, 4  # ~75 us of copy at 55 GB/s: longer than the host work it covers
ROW_ALIGN = 256  # each early object's staging row


def early_area(most_bytes: int = EARLY_BYTES, most: int = EARLY_OBJECTS) -> int:
    """Staging bytes the early copies may take: objects are added while fewer than most_bytes are
    queued, each at most most_bytes, so under twice that plus each row's alignment."""
    return 2 * most_bytes + most * ROW_ALIGN


@dataclass
class Early:
    """What a transfer's early copies left for the rest of the call: the staging slot they went into
    (acquired on the direction's first stream), how many of the batch's first objects they moved, each
    one's staging row, and for a save the call's digest buffer (theirs already on the way) and the
    tensors the device still reads."""

    slot: list
    count: int
    rows: np.ndarray
    out: torch.Tensor | None = None
    keep: list = field(default_factory=list)


class EarlyCopies:
    """The early copies of KernelEngine (see the module docstring)."""

    def load(self, batch: Sequence[Moves]) -> Handle:
        """As TransferEngine.load, with early copies when the load direction is idle."""
        picks = self._early_picks(batch, LOAD)
        if picks is None:
            return super().load(batch)
        early = self._early_load(batch, *picks)
        try:
            checked = self._checked(batch, load=True)
        except BaseException:
            self.synchronize()  # the early copies only filled staging; let them finish all the same
            raise
        return self._load(checked, early)

    def save(self, batch: Sequence[Moves]) -> Handle:
        """As TransferEngine.save, with early copies when the save direction is idle. The whole call
        runs on the gather stream (one switch: each costs ~16 us of the H200 host's time)."""
        picks = self._early_picks(batch, SAVE)
        if picks is None:
            return super().save(batch)
        with self._stream(self._side(SAVE)):
            early = self._early_save(batch, *picks)
            try:
                checked = self._checked(batch, load=False)
            except BaseException:
                self.synchronize()
                raise
            return self._save(checked, early)

    def _early_picks(self, batch: Sequence[Moves], direction: int) -> tuple | None:
        """(geometry, block ids, arena offsets) of the first Moves' objects to move early, or None (the
        call goes the usual way): on the zero-copy path, without the runtime's copy call, for objects
        under the run bar or over early_bytes, for a first Moves of one object (the rest must be laid
        out as a round of its own), when the direction is busy (its copy engine has work anyway), or
        for anything the checks do not accept (the full validation then names the error)."""
        path = self.load_path if direction == LOAD else self.save_path
        if self.early_bytes <= 0 or self._copy_one is None or path == "zero-copy":
            return None
        try:
            picks = self._early_checked(batch, direction)
        except (AttributeError, TypeError, ValueError, IndexError, KeyError):
            return None
        return picks if picks is not None and self._idle(direction) else None

    def _early_checked(self, batch: Sequence[Moves], direction: int) -> tuple | None:
        first = batch[0]
        geom: GroupGeometry = self.groups[first.group]
        nbytes = geom.object_bytes
        if nbytes < self.dma_min_run_bytes or nbytes > self.early_bytes or self.align[first.group] < 8:
            return None
        count = min(len(first.offsets) - 1, len(first.block_ids) - 1, self.early_objects)
        count = min(count, -(-self.early_bytes // nbytes), self._early_room // _row_step(geom))
        if count < 1:
            return None
        offs = [operator.index(v) for v in list(first.offsets[:count])]
        reach, cap = slot_reach(nbytes, first), self.arena.capacity_bytes
        if any(off < 0 or off & 7 or off + nbytes > cap for off in offs):
            return None
        if direction == LOAD:
            return geom, None, offs
        ids = [operator.index(v) for v in list(first.block_ids[:count])]
        if any(not 0 <= b < geom.num_blocks for b in ids):
            return None
        spans = sorted(offs)
        if any(b - a < reach for a, b in zip(spans, spans[1:])) or spans[-1] + reach > cap:
            return None  # a save writes each slot's whole reach: no two may meet
        return geom, ids, offs

    def _early_slot(self, direction: int, stream) -> tuple[list, int]:
        """A ring slot for the early objects (the first round's, as the ring hands slots out in turn)
        and where its early area starts; acquired on `stream`."""
        if self.ring.pooled:
            slot = self.ring.take(direction, self._ring_bytes)
            base = slot[0].data_ptr() + self._early_at
        else:  # CPU (tests): nothing is pooled; the first round gets a buffer of its own
            slot = [aligned(self._early_room, self.device), None]
            base = slot[0].data_ptr()
        StagingRing.acquire(slot, stream)
        return slot, base

    def _early_load(self, batch: Sequence[Moves], geom: GroupGeometry, _ids, offs: list[int]) -> Early:
        copy = self._main(LOAD)
        self._after(self._caller(), copy)
        slot, base = self._early_slot(LOAD, copy)
        rows = base + _row_step(geom) * np.arange(len(offs), dtype=np.int64)
        handle = copy.cuda_stream if copy is not None else 0
        for row, off in zip(rows.tolist(), offs, strict=True):
            self._copy_one(row, self.arena_base + off, geom.object_bytes, handle)
        return Early(slot, len(offs), rows)

    def _early_save(
        self, batch: Sequence[Moves], geom: GroupGeometry, ids: list[int], offs: list[int]
    ) -> Early:
        """Gather the early objects (checksums included) into staging on the gather stream (the
        current one), copy each to its slot on the save stream, and send their digests to the start of
        the call's digest buffer."""
        gather, save = self._side(SAVE), self._main(SAVE)
        self._after(self._caller(), gather)
        slot, base = self._early_slot(SAVE, gather)
        rows = base + _row_step(geom) * np.arange(len(offs), dtype=np.int64)
        first = batch[0]
        ids_a, offs_a = np.array(ids, np.int64), np.array(offs, np.int64)
        part = [(geom, Moves(first.group, ids, offs, None, first.slot_bytes), ids_a, offs_a)]
        self.remember(part, ids_a, offs_a)
        plan = self._plan(part, [rows], sums=True, stream=gather)
        self._copy(plan, None, 0, self._align16(part, [rows]), checksum=True, hbm=True)
        gathered = self._event(gather)
        if gathered is not None:
            save.wait_event(gathered)
        handle = save.cuda_stream if save is not None else 0
        for row, off in zip(rows.tolist(), offs, strict=True):
            self._copy_one(self.arena_base + off, row, geom.object_bytes, handle)
        self._release(slot, save)
        out = self._host_buffer(sum(len(m.block_ids) for m in batch))
        self._sm_copy(plan.sums(), out[: len(offs)])
        return Early(slot, len(offs), rows, out, [plan.buf, slot[0]])


def _row_step(geom: GroupGeometry) -> int:
    return -(-geom.object_bytes // ROW_ALIGN) * ROW_ALIGN
