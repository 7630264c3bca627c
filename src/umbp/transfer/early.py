"""A restore's first copies, issued before its batch is validated and planned.

Why: a restore someone waits for starts with an idle copy engine, and every microsecond of host work in
front of its first copy adds to the restore's time. Validating the whole batch, laying its rounds out
in staging and the batch-copy call took ~85 us of the H200 host's time before the first byte moved, 0.1
of the 0.84 ms that an 8K-token Granite restore's bytes take on the link. Copying the first few large
objects of the batch's first Moves needs far less: their arena offsets checked (an integer, 8-byte
aligned, inside the arena: the copy reads nothing else), a staging buffer, and one `cudaMemcpyAsync`
each; not even the caller's stream (a copy into our own staging need not wait for the caller's queued
work: only the scatter into KV pages does, see KernelEngine._load_dma). So those objects go first, into an area
at the end of the staging buffer of the batch's first round; the batch is then validated as any other
(a bad batch raises before anything writes a KV page: the early copies only filled our own staging),
and the rest is laid out and copied while they run. The first round's verify and scatter read the
early objects from that area, so they are checked and written like every other object. The offsets'
checks and the copies are one C call where umbp.transfer._copies is built (batchcopy.load_early; its
Python twin otherwise): on a slow host the Python checks, staging rows and a ctypes call per copy put the
first copy ~50 us into the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from umbp.transfer.api import Handle, Moves
from umbp.transfer.batchcopy import EarlyCopy
from umbp.transfer.plans import aligned
from umbp.transfer.ring import StagingRing
from umbp.transfer.rounds import LOAD

# ~150 us of copy at 55 GB/s: longer than the host work it covers (validation, layout, the first round's
# copy call), which took up to ~190 us on a slow H100 host; there 8 MiB and up to 6 objects restored 8K
# tokens at 0.851 of the link against 0.816 with 4 MiB and 4 objects, 16K at 0.887 against 0.856
# (interleaved, faster in 53 and 59 of 61 calls; bench/results/archive/2026-12-06-restore-tail-split-48/)
EARLY_BYTES, EARLY_OBJECTS = 8 << 20, 6
ROW_ALIGN = 256  # each early object's staging row


def early_area(nbytes: int, objects: int) -> int:
    """Staging bytes kept for the early copies at the end of each ring buffer: objects are added while
    fewer than `nbytes` are queued, each at most `nbytes`, so under twice that plus each row's alignment."""
    return 2 * max(nbytes, 0) + max(objects, 0) * ROW_ALIGN


@dataclass
class Early:
    """What a restore's early copies left for its first round: the staging slot they went into (a ring
    slot whose end area holds them, acquired on the copy stream), how many of the batch's first
    objects they copied, and each one's staging row address."""

    slot: list
    count: int
    rows: np.ndarray


class EarlyCopies:
    """The early copies of KernelEngine (see the module docstring): `early_bytes` / `early_objects` (engine
    arguments; 0 bytes: none) bound how much of a restore goes first; `_early_area`, the staging kept for
    them, is sized from both when the engine is made."""

    early_bytes: int
    early_objects: int
    _early_area: int
    _early_copy: EarlyCopy | None  # batchcopy.load_early's copy (None: no early copies)

    def load(self, batch: Sequence[Moves]) -> Handle:
        """As TransferEngine.load; a restore that finds the load direction idle has its first objects'
        copies issued before the batch is validated and planned."""
        early = self._early(batch)
        if early is None:
            return super().load(batch)
        try:
            checked = self._checked(batch, load=True)
        except BaseException:
            self.synchronize()  # the early copies only filled staging; let them finish all the same
            raise
        return self._load(checked, early)

    def _early(self, batch: Sequence[Moves]) -> Early | None:
        """Issue the first objects' copies of a restore that finds the load direction idle, or return
        None (then the call goes the usual way): on the zero-copy path, without the runtime's copy
        call, for objects under the run bar or over `early_bytes`, for a first Moves of one object (at
        least one object is left for the layout), or where an early object's offset is not an integer,
        8-byte aligned, its object inside the arena (the full validation then names the error)."""
        if self.early_bytes <= 0 or self._early_copy is None or self.load_path == "zero-copy":
            return None
        try:
            first = batch[0]
            nbytes, count = self._early_count(first)
        except (AttributeError, TypeError, ValueError, IndexError, KeyError):
            return None
        if not count or not self._idle(LOAD):
            return None
        copy = self._main(LOAD)  # not ordered after the caller's stream: see KernelEngine._load_dma
        if self.ring.pooled:  # the first round's ring slot: its end area is kept for these copies
            slot = self.ring.take(LOAD, self._ring_bytes)
            base = slot[0].data_ptr() + self._early_at
        else:  # CPU (tests): nothing is pooled; the first round gets a buffer of its own
            slot = [aligned(self._early_area, self.device), None]
            base = slot[0].data_ptr()
        StagingRing.acquire(slot, copy)
        step = row_step(nbytes)
        handle = copy.cuda_stream if copy is not None else 0
        capacity = self.arena.capacity_bytes
        if not self._early_copy(handle, base, step, self.arena_base, first.offsets, nbytes, capacity, count):
            return None  # (the slot taken stays in the ring's turn; nothing was queued into it)
        return Early(slot, count, base + step * np.arange(count, dtype=np.int64))

    def _early_count(self, first: Moves) -> tuple[int, int]:
        """The first Moves' object size and how many of its objects to copy early (0: none)."""
        nbytes = self.groups[first.group].object_bytes
        if nbytes < self.dma_min_run_bytes or nbytes > self.early_bytes or self.align[first.group] < 8:
            return nbytes, 0
        count = min(len(first.offsets) - 1, len(first.block_ids) - 1, self.early_objects)
        # about early_bytes, and never more than the ring's early area holds
        return nbytes, max(
            0, min(count, -(-self.early_bytes // nbytes), self._early_area // row_step(nbytes))
        )


def row_step(nbytes: int) -> int:
    """nbytes rounded up to ROW_ALIGN: the staging bytes between two early objects' rows."""
    return -(-nbytes // ROW_ALIGN) * ROW_ALIGN
