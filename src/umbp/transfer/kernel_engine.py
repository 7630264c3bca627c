"""The kernel path: one Triton launch per direction moves a whole batch between GPU pages and the
page-locked arena (see triton_kernels.py for why), on the engine's own CUDA streams. This module submits
the work and completes the handles; what each launch is told is planned in plans.py, and how a batch is
split between the paths and cut into rounds in rounds.py.

save:  KV pages --kernel--> arena slots (+ per-piece checksums) -> per-object digests -> host (async)
load:  arena slots --kernel--> KV pages                                       (no digests given)
       arena slots --kernel--> device staging (+ checksums)
                   --kernel--> KV pages of the objects whose checksum matched  (digests given)

Two ways to cross PCIe (`save_path` / `load_path`): "zero-copy" (the kernel reads/writes the mapped arena
directly; any object size) and "dma" (kernel between KV pages and contiguous device staging, then one
copy-engine copy per run of adjacent arena slots, all runs of a round in one batch call where the CUDA
runtime has it (batchcopy.py); good for objects >= 256 KiB or slots in runs; an idle direction's first
objects go early: early.py, head.py). Default "auto" picks by the batch's bytes per run of adjacent slots
(thresholds from the H200 measurements in docs/transfer.md).

Nothing waits on the host until the caller asks (`Handle.done()` polls an event). Verified loads stage
through device memory (at most `max_staging_bytes` per round) so that a slot whose bytes do not match its
digest is never written into the KV cache; the compare happens inside the launch that writes the pages,
which also stores each object's verdict straight into the page-locked result the handle reads. A batch
touching a group whose pieces are not 8-byte aligned runs on the staged path instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from umbp.pool import Arena
from umbp.pool.checksum import LANES, ROW_BYTES, lane_table
from umbp.transfer import batchcopy
from umbp.transfer.api import Handle, Moves, TransferEngine
from umbp.transfer.completion import DeviceHandle
from umbp.transfer.early import EARLY_BYTES, EARLY_OBJECTS, Early, EarlyCopies, early_area, row_step
from umbp.transfer.geometry import PIECE_BYTES
from umbp.transfer.head import SAVE_HEAD_BYTES, SaveHead
from umbp.transfer.plans import (
    Plan,
    TablePool,
    build_plan,
    passed,
    templates,
)
from umbp.transfer.ring import StagingRing
from umbp.transfer.rounds import LOAD, SAVE, BatchRounds, staging_rows
from umbp.transfer.staged import Batch, staged_load, staged_save
from umbp.transfer.streams import EngineStreams

# parts per piece in launches between KV pages and device staging (triton_kernels.copy_objects): a
# restore's last round is a few objects, whose verify ran latency-bound with one program per 64 KiB piece
# (an 8K Granite restore's last verify 14.6 -> 9.6 us on H100s; docs/transfer.md)
HBM_SPLIT = 4
FETCH_BLOCK = 1024  # elements per program of kernels.fetch_words (8 KiB of a plan's int64 words)
# the copy kernel's constexprs, in its signature's order (triton_kernels.copy_objects)
COPY_CONSTEXPRS = ("BLOCK", "SRC_KV", "DST_KV", "CHECKSUM", "GUARD", "ALIGN16", "STORE", "CROWS", "SPLIT")


class KernelEngine(BatchRounds, EarlyCopies, SaveHead, EngineStreams, TransferEngine):
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
        tail_round_bytes: int = 4 << 20,
        hbm_ctas: int | None = None,
        hbm_split: int = HBM_SPLIT,
        batch_copy_min_runs: int = 3,
        save_head_bytes: int = SAVE_HEAD_BYTES,
        early_bytes: int = EARLY_BYTES,
        early_objects: int = EARLY_OBJECTS,
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
        # the caller's stream is looked up by index: by torch.device, each lookup parsed the device
        # again (~25 us of a slow host's time under a profiler, twice per restore)
        self._index = index
        self._launch_copy = kernels.Launcher(kernels.copy_objects, index)
        self._launch_fetch = kernels.Launcher(kernels.fetch_words, index)
        self.block, self.num_warps, self.max_staging_bytes = block, num_warps, max_staging_bytes
        # a ring buffer holds max_staging_bytes of slots plus their runs' alignment pads (plan_runs), so
        # that a batch of exactly 2 x max_staging_bytes is two rounds, not two and a sliver (see _rounds)
        self._ring_bytes = max_staging_bytes + max(4096, max_staging_bytes // 128)
        # a round of a restore or save someone waits for: long enough that its copy outlasts the host
        # time of planning the next round (round_budgets)
        self.min_round_bytes = min_round_bytes
        # a restore's last round: what is left after its last copy is this round's verify and scatter
        self.tail_round_bytes = tail_round_bytes
        for p in (save_path, load_path):
            if p not in ("auto", "zero-copy", "dma"):
                raise ValueError(f"umbp: transfer path must be 'auto', 'zero-copy' or 'dma', got {p!r}")
        self.save_path, self.load_path = save_path, load_path
        # dma copies of scattered runs: one batch call (batchcopy.py) where the CUDA runtime has it
        self._batch_copy = batchcopy.load() if cuda else None
        self._early_copy = batchcopy.load_early() if cuda else None  # a restore's early copies
        self._head_copy = batchcopy.load_head() if cuda else None  # a cold save's head
        self._runs_copy = batchcopy.load_runs() if cuda else None  # a round's copies in one call
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
        # launches between KV pages and device staging run each piece as hbm_split parts (see
        # triton_kernels.copy_objects), their tiles as tall as the longest part's rows (a part that starts
        # inside a row takes two tiles: slower, never wrong)
        if hbm_split < 1:
            raise ValueError(f"umbp: hbm_split must be at least 1, got {hbm_split}")
        self.hbm_split = hbm_split
        part_words = (-(-(longest // 8) // hbm_split) + 63) // 64 * 64  # as the kernel cuts them
        part_rows = -(-part_words * 8 // ROW_BYTES)
        self.hbm_crows = min(self.crows, 1 << (part_rows - 1).bit_length())
        self.tmpl, self.toff = templates(self.groups, self.device)
        self._init_streams(cuda)
        # a cold dma save's first objects: copy-engine copies straight from their KV pages (head.py)
        self.save_head_bytes = save_head_bytes
        # each ring buffer ends in an area for a restore's early copies (early.py), past the rounds' room
        self.early_bytes, self.early_objects = early_bytes, early_objects
        self._early_area = early_area(early_bytes, early_objects)
        self._early_at = row_step(self._ring_bytes)
        extra = self._early_at - self._ring_bytes + self._early_area
        self.ring = StagingRing(self.device, self._ring_bytes, pooled=cuda, extra=extra)
        self._dummy = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._tables = TablePool()
        # the batch, (budgets, objects skipped) and its layout: see BatchRounds._lay_out
        self._last_layouts: tuple[Batch, tuple[tuple[int, ...], int], tuple] | None = None
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
                    if path == "dma":  # a cold save's head digests: their own kernel variant
                        self._warm_head_sums(g, block, offset)
        finally:
            self.save_path, self.load_path = paths
            self.synchronize()
            self.ring.clear()

    def synchronize(self) -> None:
        for s in (*(self.streams or ()), *(self.aux or ())):
            s.synchronize()

    def fence(self, handle: Handle) -> None:
        event = getattr(handle, "_event", None)
        if event is not None:  # recorded after the transfer's last copy (a save's gathers precede it)
            torch.cuda.current_stream(self._index).wait_event(event)

    # ------------------------------------------------------------------ save
    def _save(self, batch: Batch) -> Handle:
        if not self._fast(batch):
            self.synchronize()
            return staged_save(self.arena, self.device, batch)
        keep: list[torch.Tensor] = []
        caller = self._caller()
        try:
            shape = self.flat(batch)[0]
            if self._path(batch, self.save_path, self.dma_min_run_bytes) == "dma":
                # streams named explicitly: each switch costs ~16 us of host time (H200 host)
                out = self._save_dma(batch, keep, caller, self._idle(SAVE))
                return self._track(SAVE, self._finish(batch, out, keep, shape.mix, self._main(SAVE)))
            out = self._host_buffer(shape.nobj)
            with self._on(SAVE, caller):
                self._save_zero_copy(batch, keep, out)
                return self._track(SAVE, self._finish(batch, out, keep, shape.mix, self._main(SAVE)))
        except BaseException:
            self._drain(keep)
            raise

    def _save_zero_copy(self, batch: Batch, keep: list[torch.Tensor], out: torch.Tensor) -> None:
        offs = self.flat(batch)[2]
        plan = self._plan(batch, [offs], sums=True, stream=self._main(SAVE))
        align16 = self._align16(self._wide(batch), offs, self.arena_base)
        self._copy(plan, (0, plan.n), None, (0, self.arena_base), align16, checksum=True)
        self._sm_copy(plan.sums(), out)
        keep.append(plan.buf)

    def _save_dma(self, batch: Batch, keep: list[torch.Tensor], caller, cold: bool) -> torch.Tensor:
        """Per round: KV pages -> staging (kernel on the gather stream, HBM speed, checksums), then
        staging -> arena on the save stream (copy engine, one copy per run of adjacent slots). Round r's
        gather runs while round r-1's copy does; two staging buffers take turns. One plan serves every
        round; after the last gather, all digests go to the host at once, and the save stream waits for
        them, so the handle's event covers them. A cold save leads with its head (head.py): the first
        objects copied from their KV pages while the rest is planned; the first round skips them.
        Returns the digests' host buffer (taken after the head is issued: nothing before needs it)."""
        gather, save = self._side(SAVE), self._main(SAVE)
        queued = self._after(caller, gather)
        head = self._head_count(batch) if cold else 0
        if head:
            self._head(batch, head, save, queued)
        out = self._host_buffer(self.flat(batch)[0].nobj)
        rounds = self._laid_out(batch, SAVE, cold, skip=head)
        rows, wide = staging_rows(rounds), self._wide(batch)
        if head:  # the head objects' rows: unused (their digests' launch stores nothing)
            rows = np.concatenate((np.zeros(head, np.int64), rows))
        with self._stream(gather):  # one switch per call: each costs ~16 us of host time (H200 host)
            plan = self._plan(batch, [rows], sums=True, stream=gather)
            for k, (a, b, layout) in enumerate(rounds):
                stg, runs, slot = self._staging(layout, SAVE)
                StagingRing.acquire(slot, gather)
                base = stg.data_ptr()
                a = max(a, head)
                align16 = self._align16(wide, rows[a:b], base)
                self._copy(plan, plan.span(a, b), None, (0, base), align16, checksum=True, hbm=True)
                gathered = self._event(gather)
                if gathered is not None:
                    save.wait_event(gathered)
                self._copy_runs(runs, stg, to_arena=True, stream=save, lead=k == 0 and not head)
                self._release(slot, save)
                keep.append(stg)
            if head:
                self._head_sums(plan, head, wide)
            self._sm_copy(plan.sums(), out)
            keep.append(plan.buf)
            digests = self._event(gather)
            if digests is not None:
                save.wait_event(digests)
        return out

    # ------------------------------------------------------------------ load
    def _load(self, batch: Batch, early: Early | None = None) -> Handle:
        if not self._fast(batch):
            self.synchronize()
            return staged_load(self.arena, self.device, batch)
        keep: list[torch.Tensor] = []
        dma = early is not None or self._path(batch, self.load_path, self.dma_min_run_bytes) == "dma"
        verify = any(m.digests is not None for _g, m, _i, _o in batch)
        try:
            if dma:  # streams named explicitly (see _save); the handle completes after the last scatter
                cold = early is not None or self._idle(LOAD)
                out = self._load_dma(batch, keep, cold, verify, early)
                return self._track(LOAD, self._finish(batch, out, keep, None, self._side(LOAD)))
            out = self._host_buffer(self.flat(batch)[0].nobj) if verify else None
            with self._on(LOAD, self._caller()):
                if out is None:
                    self._load_direct(batch, keep)
                else:
                    self._load_staged(batch, keep, out)
                return self._track(LOAD, self._finish(batch, out, keep, None, self._main(LOAD)))
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
        offs = self.flat(batch)[2]
        plan = self._plan(batch, [offs], sums=False, stream=self._main(LOAD))
        align16 = self._align16(self._wide(batch), offs, self.arena_base)
        self._copy(plan, (0, plan.n), (0, self.arena_base), None, align16)
        keep.append(plan.buf)

    def _load_staged(self, batch: Batch, keep: list[torch.Tensor], out: torch.Tensor) -> None:
        """Verified zero-copy load, round by round: arena -> device staging by the kernel (with
        checksums), then staging -> KV pages for the objects whose checksum matched (compared inside
        that launch; each verdict into `out`). One plan, with both row columns, serves every round."""
        main, arena = self._main(LOAD), self.arena_base
        offs = self.flat(batch)[2]
        rounds = self._laid_out(batch, LOAD, cold=False)
        rows, wide = staging_rows(rounds), self._wide(batch)
        plan = self._plan(batch, [offs, rows], sums=True, stream=main)
        for a, b, layout in rounds:
            stg, _runs, slot = self._staging(layout, LOAD)
            StagingRing.acquire(slot, main)
            span, base = plan.span(a, b), stg.data_ptr()
            align16 = self._align16(wide, rows[a:b], base)
            both16 = align16 and self._align16(wide, offs[a:b], arena)
            self._copy(plan, span, (0, arena), (1, base), both16, checksum=True)
            self._copy(plan, span, (1, base), None, align16, guard=out, hbm=True)
            self._release(slot, main)
            keep.append(stg)
        keep.append(plan.buf)

    def _load_dma(
        self, batch: Batch, keep: list[torch.Tensor], cold: bool, verify: bool, early: Early | None
    ) -> torch.Tensor | None:
        """Per round: arena -> staging on the load stream (copy engine, one copy per run), then on the
        scatter stream the checksums of the staged bytes (when digests are given) and staging -> KV pages
        for the objects that matched. The host stays one round ahead: round r+1's copy is issued before
        round r's verify and scatter, so the copy engine always has a round queued while the host works
        (issuing a round's kernels in between left it idle ~0.3-0.4 ms per round of an 8K-token restore
        on the H200; bench/probes/restore_timeline_gpu.py). With two staging buffers taking turns, round
        r+2's copy waits for round r's scatter, which is issued by then. The call's one plan is built
        after the first copy is issued (nothing of it is needed before the first scatter).

        Only the scatter stream is ordered after the work queued on the caller's stream: the scatters
        write KV pages that work may still read, while the copies read arena slots (host memory, filled
        before the call) into the engine's own staging, which the ring orders. So the first copy does not
        wait for the caller's stream lookup and event (host time in front of it). Returns the verdicts'
        host buffer (None: no digests given)."""
        copy, work = self._main(LOAD), self._side(LOAD)
        rounds = self._laid_out(batch, LOAD, cold, skip=0 if early is None else early.count)
        a, b, layout = rounds[0]  # its copy first: before the stream switch's host time
        first = self._stage_in(layout, copy, lead=True, early=early)
        self._after(self._caller(), work)
        out = self._host_buffer(self.flat(batch)[0].nobj) if verify else None
        rows, wide = staging_rows(rounds), self._wide(batch)
        if early is not None:  # the early objects' rows as offsets from the first round's buffer
            rows = np.concatenate((early.rows - first[0].data_ptr(), rows))
        with self._stream(work):  # copy-stream work is issued on `copy` explicitly (see _save_dma)
            plan = self._plan(batch, [rows], sums=verify, stream=work)  # its fetch need not wait for a copy
            staged = [(a, b, *first)]
            for a, b, layout in rounds[1:]:
                staged.append((a, b, *self._stage_in(layout, copy)))
                self._verify_scatter(staged.pop(0), plan, rows, wide, work, keep, out)
            for round_ in staged:
                self._verify_scatter(round_, plan, rows, wide, work, keep, out)
            keep.append(plan.buf)
        return out

    def _stage_in(self, layout: tuple, copy, lead: bool = False, early: Early | None = None) -> tuple:
        """Queue a round's copy arena -> staging on `copy`: (staging buffer, ring slots, the copy's
        event). The scatter stream waits for that event only when the round's verify and scatter are
        issued (_verify_scatter): waiting at once would hold the round before's scatter behind this
        copy. `early`: the first round, whose first objects are already in the early copies' slot (the
        round uses that slot too where it fits; both are let go after the round's scatter)."""
        fits = early is not None and self.ring.pooled and layout[2] <= self._ring_bytes
        stg, runs, slot = self._staging(layout, LOAD, early.slot if fits else None)
        slots = [slot]
        if early is not None and not fits:
            slots.append(early.slot)
        if not fits:
            StagingRing.acquire(slot, copy)
        self._copy_runs(runs, stg, to_arena=False, stream=copy, lead=lead)
        return stg, slots, self._event(copy)

    def _verify_scatter(
        self, staged: tuple, plan: Plan, rows: np.ndarray, wide: bool, work, keep: list, out
    ) -> None:
        """A staged round's checksums (when digests are given: `out`, the verdicts' buffer) and scatter
        into the KV pages of the objects that matched, on `work` (the current stream) once its copy is
        done; its staging buffer is free again after them."""
        a, b, stg, slots, copied = staged
        if copied is not None:
            work.wait_event(copied)
        span, base = plan.span(a, b), stg.data_ptr()
        align16 = self._align16(wide, rows[a:b], base)
        if out is not None:
            self._copy(plan, span, (0, base), (0, base), align16, checksum=True, store=False, hbm=True)
            self._copy(plan, span, (0, base), None, align16, guard=out, hbm=True)
        else:
            self._copy(plan, span, (0, base), None, align16, hbm=True)
        done = self._event(work)
        for slot in slots:
            slot[1] = done
            keep.append(slot[0])

    # ------------------------------------------------------------------ staging
    def _staging(
        self, layout: tuple, direction: int, slot: list | None = None
    ) -> tuple[torch.Tensor, tuple[np.ndarray, ...], list]:
        """Device staging laid out like a round's runs of adjacent arena slots, pads included (`layout`:
        from _laid_out), so that each run is one copy. Returns (16-byte aligned uint8 buffer, copy runs as
        arrays (arena offset, staging offset, bytes), its ring slot: see ring.StagingRing)."""
        _pos, runs, total = layout
        slot = slot or self.ring.take(direction, total)
        return slot[0], runs, slot

    def _copy_runs(self, runs: tuple, stg: torch.Tensor, to_arena: bool, stream, lead: bool = False) -> None:
        """Staging <-> arena on `stream`, one copy-engine copy per run: all in one batch call where the
        runtime has it and there are enough runs (scattered slots), else run by run; `lead`: a call's
        first round (batchcopy.issue). One C call where the extension is built (batchcopy.load_runs)."""
        arena, staging, size = runs
        if self._runs_copy is None:  # CPU tensors, or no CUDA runtime to call: torch copies
            with self._stream(stream):
                for a, s, n in zip(arena.tolist(), staging.tolist(), size.tolist()):
                    if to_arena:
                        self.arena_tensor[a : a + n].copy_(stg[s : s + n], non_blocking=True)
                    else:
                        stg[s : s + n].copy_(self.arena_tensor[a : a + n], non_blocking=True)
            return
        a, s = (self.arena_base, arena), (stg.data_ptr(), staging)
        dst, src = (a, s) if to_arena else (s, a)
        handle = stream.cuda_stream if stream is not None else 0  # None: CPU tensors (tests' host copies)
        self._runs_copy(*dst, *src, size, handle, arena.size >= self.batch_copy_min_runs, lead)

    def _release(self, slot: list, stream) -> None:
        slot[1] = self._event(stream)

    def _idle(self, direction: int) -> bool:
        """Nothing of this direction is still running on the device: someone likely waits for this batch
        alone (a restore, a save before eviction), so its rounds are shaped for latency. Per direction:
        when saves and loads start together, the second call's copy engine is idle too (H200, both ways
        87.5/85.6/87.7 -> 87.3/90.1/88.6 GB/s; archive/2026-12-01-transfer-13-ramp-per-direction.txt)."""
        return passed(self._last[direction])

    def _track(self, direction: int, handle: Handle) -> Handle:
        self._last[direction] = getattr(handle, "_event", None)
        return handle

    # ------------------------------------------------------------------ launches
    def _fast(self, batch: Batch) -> bool:
        return all(self.align[m.group] >= 8 for _g, m, _i, _o in batch)

    def _wide(self, batch: Batch) -> bool:
        """Every group of the batch has its pieces 16-byte aligned in its template (once per call)."""
        return all(self.align[m.group] >= 16 for _g, m, _i, _o in batch)

    @staticmethod
    def _align16(wide: bool, rows: np.ndarray, base: int) -> bool:
        """Every piece of a launch 16-byte aligned on one side: the groups' templates (`wide`), the
        base and every row offset of the launch's objects (one reduce)."""
        if not wide or base % 16:
            return False
        return not rows.size or int(np.bitwise_or.reduce(rows)) % 16 == 0

    def _plan(self, batch: Batch, rows: list[np.ndarray], sums: bool, stream) -> Plan:
        """The call's plan (plans.build_plan; rows: per column, one row offset per object in batch
        order), built in place in page-locked memory and brought to the device by _fetch."""
        shape, ids, _offs = self.flat(batch)
        plan = build_plan(shape, batch, ids, rows, sums, self._host_buffer)
        if self.device.type == "cuda":
            plan.buf = self._fetch(plan.host, stream)
        return plan

    def _copy(
        self,
        plan: Plan,
        span: tuple[int, int],
        src: tuple[int, int] | None,
        dst: tuple[int, int] | None,
        align16: bool,
        checksum: bool = False,
        guard: torch.Tensor | None = None,
        store: bool = True,
        hbm: bool = False,
    ) -> None:
        """Run the copy kernel over pieces span[0]:span[1] of a plan (plan.span: a round's objects).
        src / dst: (the plan's row column, the address its rows are offsets from), or None for the KV
        pages. guard: verify against the plan's expected digests, verdicts into this int64 host buffer
        (one per object of the call). hbm: neither side is the arena (more programs, see __init__)."""
        first, end = span
        if end <= first:
            return
        (src_col, src_base), (dst_col, dst_base) = src or (0, 0), dst or (0, 0)
        args = (
            plan.buf,
            plan.nseg,
            first,
            end,
            self.tmpl,
            self.tmpl.shape[1],
            plan.ids_at,
            plan.at(src_col),
            src_base,
            plan.at(dst_col),
            dst_base,
            plan.sums_at(),
            plan.want_at(),
            self.ktab,
            self._dummy if guard is None else guard,
        )
        split = self.hbm_split if hbm else 1
        constexprs = (
            self.block,
            src is None,
            dst is None,
            checksum,
            guard is not None,
            align16,
            store,
            self.hbm_crows if hbm else self.crows,
            split,
        )
        grid = min((end - first) * split, self.hbm_ctas if hbm else self.ctas)
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
