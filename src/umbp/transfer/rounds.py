"""How a transfer batch is split between the kernel engine's two ways across PCIe and cut into rounds:
the per-call decisions made before anything is copied (kernel_engine.py issues the work).

* `_path`: zero-copy or the copy engines ("dma"), by the bytes per run of adjacent arena slots;
* `_budgets` / `_laid_out`: how many rounds, of what size, each laid out in device staging
  (plans.lay_out: one C call where the extension is built);

A mixin of KernelEngine (it reads the engine's `flat`, ring size and round knobs): kept apart
because it decides what is copied when, while the engine decides on which stream and with which launch.
"""

from __future__ import annotations

import numpy as np

from umbp.transfer.plans import RUN_PAD, c_layout, lay_out, round_budgets
from umbp.transfer.staged import Batch

SAVE, LOAD = 0, 1  # directions (the engine's stream index per direction)


class BatchRounds:
    """Round planning for KernelEngine (see the module docstring)."""

    _last_layouts: tuple | None
    _last_order: tuple | None
    _ring_bytes: int
    min_round_bytes: int
    tail_round_bytes: int
    dma_min_batch_bytes: int

    def _path(self, batch: Batch, choice: str, min_run_bytes: int) -> str:
        """'auto': the copy engines when the batch's arena slots form runs of adjacent slots averaging
        >= min_run_bytes (each run is one DMA; in one batch call 256 KiB runs reach 0.96-0.98 of a plain
        copy on the H200 and 64 KiB runs 0.81-0.89; run by run, without that call, ~10 us each), else
        zero-copy (SM-issued PCIe traffic, ~0.9 of a copy engine whatever the object size). Slots come in
        runs when the index hands them out together (DramIndex.reserve_many). A batch under
        dma_min_batch_bytes is zero-copy in any case. Thresholds: docs/transfer.md."""
        if choice != "auto":
            return choice
        shape = self.flat(batch)[0]
        nbytes = shape.total_size
        if nbytes < max(min_run_bytes, self.dma_min_batch_bytes):
            return "zero-copy"
        if nbytes >= min_run_bytes * shape.nobj:  # runs <= objects: no need to count them
            return "dma"
        return "dma" if nbytes >= min_run_bytes * self._run_count(batch) else "zero-copy"

    def _run_count(self, batch: Batch) -> int:
        """How many runs of adjacent slots the batch's slots form (_path). With the C layout, the batch
        laid out as one round, which _laid_out reuses when the batch is one round; else a sort and one
        compare (and the sort is reused)."""
        if c_layout():
            return self._lay_out(batch, ())[1][0][1][0].size
        shape, _ids, offs = self.flat(batch)
        order = np.argsort(offs, kind="stable")
        so = offs[order]
        reach = shape.uniform_reach if shape.uniform_reach is not None else shape.reach[order][:-1]
        self._last_order = (batch, order)
        return 1 + int(np.count_nonzero(so[1:] != so[:-1] + reach))

    def _lay_out(
        self, batch: Batch, budgets: tuple[int, ...], skip: int = 0
    ) -> tuple[list[int], list[tuple]]:
        """plans.lay_out for the batch's objects from `skip` on (bounds counted from there), kept for the
        batch seen last: a call that is one round lays its slots out once for _path and _staging (each
        sort and layout was ~0.1 ms of the H200 host's time per call in numpy)."""
        known = self._last_layouts
        if known is not None and known[0] is batch and known[1] == (budgets, skip):
            return known[2]
        shape, _ids, offs = self.flat(batch)
        known = self._last_order
        whole = not budgets and not skip
        order = known[1] if known is not None and known[0] is batch and whole else None
        result = lay_out(offs[skip:], shape.size[skip:], shape.reach[skip:], budgets, self._ring_bytes, order)
        self._last_layouts = (batch, (budgets, skip), result)
        return result

    def _budgets(self, batch: Batch, direction: int, cold: bool, skip: int = 0) -> tuple[int, ...]:
        """Staging bytes of each round the batch is cut into (plans.round_budgets says how they are
        sized; empty: one round), each round fitting a ring buffer. `cold` (see _idle): nothing of this
        direction is in flight, so someone is likely waiting for this batch alone: loads taper (short
        tail), saves ramp (early first copy); else the rounds are even."""
        shape = self.flat(batch)[0]
        total = shape.total_reach + RUN_PAD * shape.nobj  # each object's slot plus a run's alignment pad
        if skip:  # objects moved another way (early.py's copies, head.py's head)
            total -= int(shape.reach[:skip].sum()) + RUN_PAD * skip
        kind = "even" if not cold else ("taper" if direction == LOAD else "ramp")
        budgets = round_budgets(total, self._ring_bytes, kind, self.min_round_bytes, self.tail_round_bytes)
        if len(budgets) == 1:
            return ()
        if kind == "even":  # plus one object, so that the greedy cut needs no extra round
            biggest = shape.max_reach + RUN_PAD
            budgets = [min(self._ring_bytes, b + biggest) for b in budgets]
        return tuple(budgets)

    def _laid_out(
        self, batch: Batch, direction: int, cold: bool, skip: int = 0
    ) -> list[tuple[int, int, tuple]]:
        """The batch's rounds as (first object, end, staging layout), all laid out in one pass
        (plans.lay_out); a round's launches run its objects' span of the call's one plan. `skip`: the
        first objects move another way (a restore's early copies, early.py, or a save's head, head.py);
        the rest is laid out, and the first round starts at object 0 all the same."""
        bounds, layouts = self._lay_out(batch, self._budgets(batch, direction, cold, skip), skip)
        if skip:
            bounds = [0] + [b + skip for b in bounds[1:]]
        return list(zip(bounds[:-1], bounds[1:], layouts, strict=True))


def staging_rows(rounds: list[tuple[int, int, tuple]]) -> np.ndarray:
    """Each object's offset in its round's staging buffer, in batch order (from _laid_out's rounds): the
    row column of a call's plan, whose launches add their round's buffer address."""
    if len(rounds) == 1:
        return rounds[0][2][0]
    return np.concatenate([layout[0] for _a, _b, layout in rounds])
