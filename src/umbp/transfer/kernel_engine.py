"""The kernel path: one Triton launch per direction moves a whole batch between GPU pages and the
page-locked arena (see triton_kernels.py for why), on the engine's own CUDA streams. This module submits
the work and completes the handles; what each launch is told, and how a batch is cut and laid out, is
planned in plans.py.

save:  KV pages --kernel--> arena slots (+ per-piece checksums) -> per-object digests -> host (async)
load:  arena slots --kernel--> KV pages                                       (no digests given)
       arena slots --kernel--> device staging (+ checksums)
                   --kernel--> KV pages of the objects whose checksum matched  (digests given)

Two ways to cross PCIe (`save_path` / `load_path`): "zero-copy" (the kernel reads/writes the mapped arena
directly; any object size) and "dma" (kernel between KV pages and contiguous device staging, then one
copy-engine copy per run of adjacent arena slots, all runs of a round in one batch call where the CUDA
runtime has it (batchcopy.py); good for objects >= 256 KiB or slots in runs). Default "auto" picks by the
batch's bytes per run of adjacent slots (thresholds from the H200 measurements in docs/transfer.md).

Nothing waits on the host until the caller asks (`Handle.done()` polls an event). Verified loads stage
through device memory (at most `max_staging_bytes` per round) so that a slot whose bytes do not match its
digest is never written into the KV cache; the compare happens inside the launch that writes the pages,
which also stores each object's verdict straight into the page-locked result the handle reads. A batch
touching a group whose pieces are not 8-byte aligned runs on the staged path instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch

from umbp.pool import Arena
from umbp.pool.checksum import LANES, ROW_BYTES, lane_table
from umbp.transfer import batchcopy
from umbp.transfer.api import Handle, Moves, TransferEngine
from umbp.transfer.completion import DeviceHandle
from umbp.transfer.geometry import PIECE_BYTES
from umbp.transfer.plans import (
    Plan,
    TablePool,
    aligned,
    batch_cost,
    build_plan,
    cut_rounds,
    passed,
    plan_rounds,
    round_budgets,
    templates,
)
from umbp.transfer.staged import Batch, staged_load, staged_save

SAVE, LOAD = 0, 1  # stream index per direction
FETCH_BLOCK = 1024  # elements per program of kernels.fetch_words (8 KiB of a plan's int64 words)
# the copy kernel's constexprs, in its signature's order (triton_kernels.copy_objects)
COPY_CONSTEXPRS = ("BLOCK", "SRC_KV", "DST_KV", "CHECKSUM", "GUARD", "ALIGN16", "STORE", "CROWS")


class KernelEngine(TransferEngine):
    backend = "kernel"

    def __init__(
        self,
        arena: Arena,
        groups: Mapping[int, Sequence[tuple[torch.Tensor, int]]],
        piece_bytes: int = PIECE_BYTES,
        ctas: int | None = None,
        block: int = 1024,
        num_warps: int = 4,
        max_staging_bytes: int = 128 << 20,
        save_path: str = "auto",
        load_path: str = "auto",
        dma_min_run_bytes: int | None = None,
        dma_min_batch_bytes: int = 1 << 20,
        min_round_bytes: int = 16 << 20,
        hbm_ctas: int | None = None,
        batch_copy_min_runs: int = 3,
    ):
        super().__init__(arena, groups, piece_bytes)
        cuda = self.device.type == "cuda"
        if cuda and not arena.pinned:
            raise ValueError("umbp: the kernel path needs a page-locked arena (Arena(pinned=True))")
        from umbp.transfer import triton_kernels as kernels  # imports Triton

        if not cuda and not kernels.interpreting():
            raise ValueError(
                "umbp: the kernel path on CPU tensors runs only under TRITON_INTERPRET=1 (tests); "
                "use backend='staged' on CPU"
            )
        self.kernel, self.fetch = kernels.copy_objects, kernels.fetch_words
        index = (
            (self.device.index if self.device.index is not None else torch.cuda.current_device())
            if cuda
            else None
        )
        self._launch_copy = kernels.Launcher(kernels.copy_objects, index)
        self._launch_fetch = kernels.Launcher(kernels.fetch_words, index)
        self.block, self.num_warps, self.max_staging_bytes = block, num_warps, max_staging_bytes
        # a ring buffer holds max_staging_bytes of slots plus their runs' alignment pads (plan_runs), so
        # that a batch of exactly 2 x max_staging_bytes is two rounds, not two and a sliver (see _rounds)
        self._ring_bytes = max_staging_bytes + max(4096, max_staging_bytes // 128)
        # a round of a restore or save someone waits for: long enough that its copy outlasts the host
        # time of planning the next round (round_budgets)
        self.min_round_bytes = min_round_bytes
        for p in (save_path, load_path):
            if p not in ("auto", "zero-copy", "dma"):
                raise ValueError(f"umbp: transfer path must be 'auto', 'zero-copy' or 'dma', got {p!r}")
        self.save_path, self.load_path = save_path, load_path
        # dma copies of scattered runs: one batch call (batchcopy.py) where the CUDA runtime has it
        self._batch_copy = batchcopy.load() if cuda else None
        self.batch_copy_min_runs = batch_copy_min_runs
        if dma_min_run_bytes is None:  # below the bar zero-copy was faster (H200, docs/transfer.md)
            dma_min_run_bytes = (256 << 10) if self._batch_copy is not None else (4 << 20)
        # 'auto' sends a batch under this many bytes zero-copy whatever its runs: one launch instead of a
        # gather, staging and copies, ~0.2 ms less host time per call, which a step that waits on the host
        # feels; on a GPU-bound step the SM-driven copy of so little cost nothing measurable (H200,
        # archive/2026-12-01-transfer-16-small-batches-step.txt)
        self.dma_min_batch_bytes = dma_min_batch_bytes
        self.dma_min_run_bytes = dma_min_run_bytes  # one bar for both ways: mixing DMA one way with SM
        # traffic the other way ran at half the copy engines' both-ways rate (docs/transfer.md)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 4
        self.ctas = ctas or sms
        # launches between KV pages and device staging touch HBM only: more programs hide its latency
        # (a round's verify and scatter are a restore's tail; see docs/transfer.md)
        self.hbm_ctas = hbm_ctas or 4 * sms
        self.arena_base = self.arena_tensor.data_ptr()
        self.align = {g: geom.alignment() for g, geom in self.groups.items()}
        rows = max((geom.object_bytes for geom in self.groups.values()), default=0) // ROW_BYTES + 2
        ktab = lane_table(LANES * rows)[: LANES * rows]  # psum64's lane weights for every row of an object
        self.ktab = torch.from_numpy(ktab.view(np.int64).copy()).to(self.device)
        # rows of a checksum tile (triton_kernels.py): enough for the longest piece wherever it starts, a
        # power of two, at most 16. A tile is computed whole, so a taller one wastes work on masked rows
        longest = max(
            (int(geom.template.nbytes.max()) for geom in self.groups.values() if geom.template.nbytes.size),
            default=ROW_BYTES,
        )
        span = (longest + ROW_BYTES - 8) // ROW_BYTES + 1
        self.crows = min(16, 1 << (span - 1).bit_length())
        self.tmpl, self.toff = templates(self.groups, self.device)
        self.streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) if cuda else None
        # dma rounds: gathers (save) / verify + scatter (load) run on these, so round r's kernels overlap
        # round r-1's (or r+1's) copy-engine transfer on the direction's main stream
        self.aux = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) if cuda else None
        self._ring: dict[int, list[list]] = {SAVE: [], LOAD: []}  # per direction: [[staging, free event]]
        self._turn = {SAVE: 0, LOAD: 0}
        self._dummy = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._tables = TablePool()
        self._last_layouts: tuple[Batch, tuple[int, ...], list[tuple]] | None = None
        self._last_order: tuple[Batch, np.ndarray] | None = None  # _run_count's sort, for _layouts
        self._last: dict[int, torch.cuda.Event | None] = {SAVE: None, LOAD: None}  # each direction's newest

    def warm_up(self, block: int, offset: int, verify: bool = True) -> None:
        """Compile and load the kernel variants transfers use before serving: a variant first met
        mid-serving compiles (about a second with a cold Triton cache), and loading its module waits for
        all of the GPU's queued work. For each group and both paths, a save of `block` to the arena at
        `offset` and a load back, verified or not as the caller's loads are: the pages get their own
        bytes back. The dma staging rings are let go again (the first dma transfer allocates them, as
        before): held from start-up they would take ~0.5 GiB of GPU memory before vLLM captures its CUDA
        graphs."""
        paths = self.save_path, self.load_path
        try:
            for path in ("zero-copy", "dma"):
                self.save_path = self.load_path = path
                for g in self.groups:
                    digests = self.save([Moves(g, [block], [offset])]).result()[0]
                    self.load([Moves(g, [block], [offset], digests if verify else None)]).result()
        finally:
            self.save_path, self.load_path = paths
            self.synchronize()
            self._ring = {SAVE: [], LOAD: []}

    def synchronize(self) -> None:
        for s in (*(self.streams or ()), *(self.aux or ())):
            s.synchronize()

    def fence(self, handle: Handle) -> None:
        event = getattr(handle, "_event", None)
        if event is not None:  # recorded after the transfer's last copy (a save's gathers precede it)
            torch.cuda.current_stream(self.device).wait_event(event)

    # ------------------------------------------------------------------ save
    def _save(self, batch: Batch) -> Handle:
        if not self._fast(batch):
            self.synchronize()
            return staged_save(self.arena, self.device, batch)
        keep: list[torch.Tensor] = []
        caller = self._caller()
        try:
            with self._on(SAVE, caller):
                shape = self.flat(batch)[0]
                out = self._host_buffer(shape.nobj)
                if self._path(batch, self.save_path, self.dma_min_run_bytes) == "zero-copy":
                    self._save_zero_copy(batch, keep, out)
                else:
                    self._save_dma(batch, keep, caller, self._idle(SAVE), out)
                return self._track(SAVE, self._finish(batch, out, keep, shape.mix, self._main(SAVE)))
        except BaseException:
            self._drain(keep)
            raise

    def _save_zero_copy(self, batch: Batch, keep: list[torch.Tensor], out: torch.Tensor) -> None:
        arena = self.arena_base + self.flat(batch)[2]
        plan = self._plan(batch, [arena], sums=True, stream=self._main(SAVE))
        self._copy(plan, None, 0, self._align16(batch, [arena]), checksum=True)
        self._sm_copy(plan.sums(), out)
        keep.append(plan.buf)

    def _save_dma(
        self, batch: Batch, keep: list[torch.Tensor], caller, cold: bool, out: torch.Tensor
    ) -> None:
        """Per round: KV pages -> staging (kernel on the gather stream, HBM speed, checksums, digests to
        the host), then staging -> arena on the save stream (copy engine, one copy per run of adjacent
        slots). Round r's gather runs while round r-1's copy does; two staging buffers take turns."""
        gather, save = self._side(SAVE), self._main(SAVE)
        if gather is not None:
            gather.wait_stream(caller)
        at = 0
        with self._stream(gather):  # one switch per call: each costs ~16 us of host time (H200 host)
            for r, layout in self._laid_out(batch, SAVE, cold):
                stg, rows, runs, slot = self._staging(layout, SAVE)
                self._acquire(slot, gather)
                plan = self._plan(r, [rows], sums=True, stream=gather)
                self._copy(plan, None, 0, self._align16(r, [rows]), checksum=True, hbm=True)
                self._sm_copy(plan.sums(), out[at : at + plan.nobj])
                gathered = self._event(gather)
                if gathered is not None:
                    save.wait_event(gathered)
                self._copy_runs(runs, stg, to_arena=True, stream=save)
                self._release(slot, save)
                keep += [stg, plan.buf]
                at += plan.nobj

    # ------------------------------------------------------------------ load
    def _load(self, batch: Batch) -> Handle:
        if not self._fast(batch):
            self.synchronize()
            return staged_load(self.arena, self.device, batch)
        keep: list[torch.Tensor] = []
        dma = self._path(batch, self.load_path, self.dma_min_run_bytes) == "dma"
        verify = any(m.digests is not None for _g, m, _i, _o in batch)
        caller, last = self._caller(), self._main(LOAD)
        try:
            with self._on(LOAD, caller):
                out = self._host_buffer(self.flat(batch)[0].nobj) if verify else None
                if dma:
                    self._load_dma(batch, keep, caller, self._idle(LOAD), out)
                    last = self._side(LOAD)
                elif out is None:
                    self._load_direct(batch, keep)
                else:
                    at = 0
                    for r, layout in self._laid_out(batch, LOAD, cold=False):
                        at = self._load_staged(r, layout, keep, out, at)
                with self._stream(last if dma else None):  # the handle completes after the last scatter
                    return self._track(LOAD, self._finish(batch, out, keep, None, last))
        except BaseException:
            self._drain(keep)
            raise

    def _drain(self, keep: list[torch.Tensor]) -> None:
        """A batch that fails half-way (out of memory for a buffer, a failed copy call) may have rounds
        already queued that still write KV blocks (load) or arena slots (save). The caller reports the
        failure and vLLM frees the blocks, which the next forward may write: the rounds must be over
        first, and their buffers (`keep`) alive until then."""
        try:
            self.synchronize()
        finally:
            keep.clear()

    def _load_direct(self, batch: Batch, keep: list[torch.Tensor]) -> None:
        arena = self.arena_base + self.flat(batch)[2]
        plan = self._plan(batch, [arena], sums=False, stream=self._main(LOAD))
        self._copy(plan, 0, None, self._align16(batch, [arena]))
        keep.append(plan.buf)

    def _load_staged(
        self, batch: Batch, layout: tuple, keep: list[torch.Tensor], out: torch.Tensor, at: int
    ) -> int:
        """Verified zero-copy load: arena -> device staging by the kernel (with checksums), then staging
        -> KV pages for the objects whose checksum matched (compared inside that launch). Returns the
        index of the next object's verdict in `out`."""
        stg, rows, _runs, slot = self._staging(layout, LOAD)
        self._acquire(slot, self._main(LOAD))
        arena = self.arena_base + self.flat(batch)[2]
        verify = any(m.digests is not None for _g, m, _i, _o in batch)
        plan = self._plan(batch, [arena, rows], sums=True, stream=self._main(LOAD))
        align16 = self._align16(batch, [rows])
        self._copy(plan, 0, 1, align16 and self._align16(batch, [arena]), checksum=True)
        self._scatter(plan, 1, align16, out, at, verify)
        self._release(slot, self._main(LOAD))
        keep += [stg, plan.buf]
        return at + plan.nobj

    def _load_dma(self, batch: Batch, keep: list[torch.Tensor], caller, cold: bool, out) -> None:
        """Per round: arena -> staging on the load stream (copy engine, one copy per run), issued before
        anything else of the round is planned; then on the scatter stream the checksums of the staged
        bytes (when digests are given) and staging -> KV pages for the objects that matched. Round r's
        verify and scatter run while round r+1's copy does."""
        copy, work = self._main(LOAD), self._side(LOAD)
        if work is not None:
            work.wait_stream(caller)
        at = 0
        with self._stream(work):  # copy-stream work is issued on `copy` explicitly (see _save_dma)
            for r, layout in self._laid_out(batch, LOAD, cold):
                stg, rows, runs, slot = self._staging(layout, LOAD)
                self._acquire(slot, copy)
                self._copy_runs(runs, stg, to_arena=False, stream=copy)
                copied = self._event(copy)
                if copied is not None:
                    work.wait_event(copied)
                verify = any(m.digests is not None for _g, m, _i, _o in r)
                plan = self._plan(r, [rows], sums=verify, stream=work)
                align16 = self._align16(r, [rows])
                if verify:
                    self._copy(plan, 0, 0, align16, checksum=True, store=False, hbm=True)
                self._scatter(plan, 0, align16, out, at, verify)
                self._release(slot, work)
                keep += [stg, plan.buf]
                at += plan.nobj

    def _scatter(self, plan: Plan, column: int, align16: bool, out, at: int, verify: bool) -> None:
        """Staging (the plan's row column) -> KV pages; verified: only the objects whose checksum (already
        in the plan) matches, each verdict stored into out[at:]. A round with no digests writes all."""
        if verify:
            self._copy(plan, column, None, align16, guard=out[at : at + plan.nobj], hbm=True)
            return
        self._copy(plan, column, None, align16, hbm=True)
        if out is not None:
            out.numpy()[at : at + plan.nobj] = 1

    # ------------------------------------------------------------------ rounds and staging
    def _path(self, batch: Batch, choice: str, min_run_bytes: int) -> str:
        """'auto': the copy engines when the batch's arena slots form runs of adjacent slots averaging
        >= min_run_bytes (each run is one DMA; in one batch call 256 KiB runs reach 0.96-0.98 of a plain
        copy on the H200 and 64 KiB runs 0.81-0.89; run by run, without that call, ~10 us each), else
        zero-copy (SM-issued PCIe traffic, ~0.9 of a copy engine whatever the object size). Slots come in
        runs when the index hands them out together (DramIndex.reserve_many). A batch under
        dma_min_batch_bytes is zero-copy in any case. Thresholds: docs/transfer.md."""
        if choice != "auto":
            return choice
        nbytes = sum(ids.size * g.object_bytes for g, _m, ids, _o in batch)
        if nbytes < max(min_run_bytes, self.dma_min_batch_bytes):
            return "zero-copy"
        return "dma" if nbytes >= min_run_bytes * self._run_count(batch) else "zero-copy"

    def _run_count(self, batch: Batch) -> int:
        """How many runs of adjacent slots the batch's slots form (_path): a sort and one compare, not
        a whole layout, which the batch needs only if it is one round (then its sort is reused)."""
        shape, _ids, offs = self.flat(batch)
        order = np.argsort(offs, kind="stable")
        so = offs[order]
        reach = shape.uniform_reach if shape.uniform_reach is not None else shape.reach[order][:-1]
        self._last_order = (batch, order)
        return 1 + int(np.count_nonzero(so[1:] != so[:-1] + reach))

    def _layouts(self, batch: Batch, bounds: tuple[int, ...]) -> list[tuple]:
        """plans.plan_rounds for the batch cut at `bounds`, kept for the batch seen last: a call that is
        one round lays its slots out once for _path and _staging (each sort and layout was ~0.1 ms of
        the H200 host's time per call)."""
        known = self._last_layouts
        if known is not None and known[0] is batch and known[1] == bounds:
            return known[2]
        shape, _ids, offs = self.flat(batch)
        known = self._last_order
        order = known[1] if known is not None and known[0] is batch and len(bounds) == 2 else None
        layouts = plan_rounds(offs, shape.size, shape.reach, list(bounds), order)
        self._last_layouts = (batch, bounds, layouts)
        return layouts

    def _rounds(self, batch: Batch, direction: int, cold: bool) -> list[Batch]:
        """Cut the batch, in order, into rounds that each fit a ring buffer (plans.round_budgets says how
        they are sized). `cold` (see _idle): nothing of this direction is in flight, so someone is likely
        waiting for this batch alone: loads taper (short tail), saves ramp (early first copy); else the
        rounds are even."""
        total, biggest = batch_cost(batch)
        shape = "even" if not cold else ("taper" if direction == LOAD else "ramp")
        budgets = round_budgets(total, self._ring_bytes, shape, self.min_round_bytes)
        if len(budgets) == 1:
            return [batch]
        if shape == "even":  # plus one object, so that the greedy cut needs no extra round
            budgets = [min(self._ring_bytes, b + biggest) for b in budgets]
        return cut_rounds(batch, budgets, self._ring_bytes)

    def _laid_out(self, batch: Batch, direction: int, cold: bool) -> list[tuple[Batch, tuple]]:
        """The batch's rounds (_rounds), each with its staging layout (plans.plan_rounds: all rounds in
        one pass)."""
        rounds = self._rounds(batch, direction, cold)
        bounds = [0]
        for r in rounds:
            bounds.append(bounds[-1] + sum(ids.size for _g, _m, ids, _o in r))
        if len(rounds) > 1:  # each round's ids and offsets: views of the batch's, not joined again
            _shape, ids, offs = self.flat(batch)
            for r, a, b in zip(rounds, bounds[:-1], bounds[1:], strict=True):
                self.remember(r, ids[a:b], offs[a:b])
        return list(zip(rounds, self._layouts(batch, tuple(bounds)), strict=True))

    def _staging(
        self, layout: tuple, direction: int
    ) -> tuple[torch.Tensor, np.ndarray, tuple[np.ndarray, ...], list]:
        """Device staging laid out like a round's runs of adjacent arena slots (pads between objects
        included; `layout`: from _laid_out), so that each run is one copy. Returns (16-byte aligned uint8
        buffer, each object's row address in the round's order, copy runs as arrays (arena offset, staging
        offset, bytes), its ring slot: see _acquire)."""
        pos, runs, total = layout
        slot = self._ring_slot(direction, total)
        return slot[0], slot[0].data_ptr() + pos, runs, slot

    def _copy_runs(self, runs: tuple[np.ndarray, ...], stg: torch.Tensor, to_arena: bool, stream) -> None:
        """Staging <-> arena on `stream` (the current one), one copy-engine copy per run: all in one batch
        call where the runtime has it and there are enough runs (scattered slots), else run by run."""
        arena, staging, size = runs
        if self._batch_copy is not None and arena.size >= self.batch_copy_min_runs:
            a, s = self.arena_base + arena, stg.data_ptr() + staging
            dsts, srcs = (a, s) if to_arena else (s, a)
            self._batch_copy(dsts, srcs, size, stream.cuda_stream)
            return
        with self._stream(stream):
            for a, s, n in zip(arena.tolist(), staging.tolist(), size.tolist()):
                if to_arena:
                    self.arena_tensor[a : a + n].copy_(stg[s : s + n], non_blocking=True)
                else:
                    stg[s : s + n].copy_(self.arena_tensor[a : a + n], non_blocking=True)

    def _ring_slot(self, direction: int, nbytes: int) -> list:
        """[buffer, event after which it is free]: one of two per direction, taken in turn (rounds are cut
        to fit, see _rounds); a one-off buffer on CPU or for a round that does not fit."""
        ring = self._ring[direction]
        if self.streams is None or nbytes > self._ring_bytes:
            return [aligned(nbytes, self.device), None]
        if not ring:  # both at once: never an allocation (which can fail) between a batch's rounds
            ring += [[aligned(self._ring_bytes, self.device), None] for _ in range(2)]
        self._turn[direction] += 1
        return ring[self._turn[direction] % len(ring)]

    @staticmethod
    def _acquire(slot: list, stream) -> None:
        """Order `stream` after the last round that used this staging buffer (on the device)."""
        if slot[1] is not None and stream is not None:
            stream.wait_event(slot[1])

    def _release(self, slot: list, stream) -> None:
        slot[1] = self._event(stream)

    def _idle(self, direction: int) -> bool:
        """Nothing of this direction is still running on the device: someone likely waits for this batch
        alone (a restore, a save before eviction), so _rounds shapes its rounds for latency. Per direction:
        when saves and loads start together, the second call's copy engine is idle too (H200, 16 KiB
        pages, side by side in one process: both ways 87.5/85.6/87.7 -> 87.3/90.1/88.6 GB/s for 1 GiB
        each way, one direction alone unchanged; archive/2026-12-01-transfer-13-ramp-per-direction.txt)."""
        return passed(self._last[direction])

    def _track(self, direction: int, handle: Handle) -> Handle:
        self._last[direction] = getattr(handle, "_event", None)
        return handle

    # ------------------------------------------------------------------ launches
    def _fast(self, batch: Batch) -> bool:
        return all(self.align[m.group] >= 8 for _g, m, _i, _o in batch)

    def _align16(self, batch: Batch, sides: list[np.ndarray]) -> bool:
        """Every piece 16-byte aligned: the groups' templates and every address in `sides` (each one
        flat array of the batch's objects: one reduce each, not one per Moves)."""
        if any(self.align[m.group] < 16 for _g, m, _i, _o in batch):
            return False
        return all(not a.size or int(np.bitwise_or.reduce(a)) % 16 == 0 for a in sides)

    def _plan(self, batch: Batch, rows: list[np.ndarray], sums: bool, stream) -> Plan:
        """The launch's plan (plans.build_plan; rows: per column, one address per object in batch
        order), built in place in page-locked memory and brought to the device by _fetch."""
        shape, ids, _offs = self.flat(batch)
        plan = build_plan(shape, batch, ids, rows, sums, self._host_buffer)
        if self.device.type == "cuda":
            plan.buf = self._fetch(plan.host, stream)
        return plan

    def _copy(
        self,
        plan: Plan,
        src: int | None,
        dst: int | None,
        align16: bool,
        checksum: bool = False,
        guard: torch.Tensor | None = None,
        store: bool = True,
        hbm: bool = False,
    ) -> None:
        """Run the copy kernel over a plan; src / dst: the plan's row column, or None for the KV pages.
        guard: verify against the plan's expected digests, verdicts into this int64 host buffer. hbm:
        neither side is the arena (more programs, see __init__)."""
        if plan.n == 0:
            return
        col = [plan.at(c) if c is not None else 0 for c in (src, dst)]
        args = (
            plan.buf,
            plan.nseg,
            plan.n,
            self.tmpl,
            self.tmpl.shape[1],
            plan.ids_at,
            col[0],
            col[1],
            plan.sums_at(),
            plan.want_at(),
            self.ktab,
            self._dummy if guard is None else guard,
        )
        constexprs = (
            self.block,
            src is None,
            dst is None,
            checksum,
            guard is not None,
            align16,
            store,
            self.crows,
        )
        grid = min(plan.n, self.hbm_ctas if hbm else self.ctas)
        self._launch_copy(grid, args, constexprs, COPY_CONSTEXPRS, self.num_warps)

    def _host_buffer(self, words: int) -> torch.Tensor:
        """int64 host memory for a plan or a call's results: on CUDA page-locked, from the engine's own
        pool (see plans.TablePool), handed back once the device has read it (_fetch) or the handle its
        results (DeviceHandle)."""
        if self.device.type != "cuda":
            return torch.empty(words, dtype=torch.int64)
        return self._tables.take(words)

    def _fetch(self, host: torch.Tensor, stream) -> torch.Tensor:
        """The plan, copied to the device by SM loads from page-locked memory. Not a copy-engine
        copy: that queues behind bulk copies already issued in its direction (H200 timeline, saves and
        loads at once: every gather waited for a whole 128 MiB load copy to finish, ~0.25 ms a round).
        Reading the table in place instead made each gather ~5x slower (one PCIe round trip per piece
        on a saturated link); this is one parallel read. (Plans were tables of pieces then.)"""
        dev = torch.empty_like(host, device=self.device)
        self._sm_copy(host, dev)
        self._tables.give(host, self._event(stream))
        return dev

    def _sm_copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """dst[:] = src[:] by kernels.fetch_words on the current stream (one side may be page-locked host
        memory): no copy-engine queue to wait in. A call's digests reach the host this way too: a load's
        few bytes of results waited ~5 ms behind the saves' bulk D2H copies on a copy engine (H200)."""
        n = src.numel()
        if self.device.type != "cuda":
            dst.copy_(src)
        elif n:
            self._launch_fetch(-(-n // FETCH_BLOCK), (src, dst, n), (FETCH_BLOCK,), ("BLOCK",), 4)

    def _on(self, direction: int, caller) -> AbstractContextManager:
        """Run on this direction's stream, after the work already queued on the caller's stream."""
        if self.streams is None:
            return nullcontext()
        s = self.streams[direction]
        s.wait_stream(caller)
        return torch.cuda.stream(s)

    def _finish(
        self, batch: Batch, out: torch.Tensor | None, keep: list[torch.Tensor], mix: np.ndarray | None, stream
    ) -> Handle:
        """mix: for saves, each object's psum64 length term (xored in on the host: see Plan.sums). Runs on
        `stream` (the current one): the handle completes after everything queued there."""
        sizes = list(self.flat(batch)[0].counts)
        if self.streams is None:
            return DeviceHandle(sizes, None, out, keep, mix, None)
        event = torch.cuda.Event()
        event.record(stream)
        return DeviceHandle(sizes, event, out, keep, mix, self._tables)

    def _caller(self):
        return torch.cuda.current_stream(self.device) if self.streams is not None else None

    def _main(self, direction: int):
        return self.streams[direction] if self.streams is not None else None

    def _side(self, direction: int):
        return self.aux[direction] if self.aux is not None else None

    @staticmethod
    def _stream(stream) -> AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    @staticmethod
    def _event(stream) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event
