"""The kernel path: one Triton launch per direction moves a whole batch between GPU pages and the
page-locked arena (see triton_kernels.py for why), on the engine's own CUDA streams.

save:  KV pages --kernel--> arena slots (+ per-piece checksums) -> per-object digests -> host (async)
load:  arena slots --kernel--> KV pages                                       (no digests given)
       arena slots --kernel--> device staging (+ checksums) -> compare on the GPU
                   --kernel--> KV pages of the objects that matched            (digests given)

Two ways to cross PCIe (`save_path` / `load_path`): "zero-copy" (the kernel reads/writes the mapped arena
directly; any object size) and "dma" (kernel between KV pages and contiguous device staging, then one
copy-engine copy per run of adjacent arena slots, all runs of a round in one batch call where the CUDA
runtime has it (batchcopy.py); good for objects >= 256 KiB or slots in runs). Default
"auto" picks by the batch's bytes per run of adjacent slots (thresholds from the H200 measurements in
docs/transfer.md).

Nothing waits on the host until the caller asks (`Handle.done()` polls an event). Verified loads stage
through device memory (at most `max_staging_bytes` per round) so that a slot whose bytes do not match its
digest is never written into the KV cache; the extra device-to-device pass runs at HBM speed. A batch
touching a group whose pieces are not 8-byte aligned runs on the staged path instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from umbp.pool import Arena
from umbp.pool.checksum import LANES, ROW_BYTES, lane_table
from umbp.transfer import batchcopy
from umbp.transfer.api import Handle, Moves, TransferEngine, digest_mix, slot_reach
from umbp.transfer.geometry import PIECE_BYTES
from umbp.transfer.staged import Batch, staged_load, staged_save

SAVE, LOAD = 0, 1  # stream index per direction
FETCH_BLOCK = 1024  # elements per program of kernels.fetch_words (8 KiB of a plan's int64 words)


class DeviceHandle(Handle):
    """Completes when its CUDA event does; values come from a small page-locked tensor."""

    def __init__(
        self,
        sizes: list[int],
        event: torch.cuda.Event | None,
        host: torch.Tensor,
        keep: list[torch.Tensor],
        mix: np.ndarray | None,
    ):
        super().__init__(sizes)
        self._event, self._host, self._keep, self._mix = event, host, keep, mix

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        self._keep = []

    def _flat(self) -> list:
        vals = self._host.numpy()
        if self._mix is None:
            return [bool(v) for v in vals]
        return (vals.view(np.uint64) ^ self._mix).tolist()  # digests: the length term goes in here


class KernelEngine(TransferEngine):
    backend = "kernel"
    RAMP = 4  # a dma batch that finds its direction idle: its first round is 1/RAMP of a buffer (see _rounds)

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
        self.block, self.num_warps, self.max_staging_bytes = block, num_warps, max_staging_bytes
        # a ring buffer holds max_staging_bytes of slots plus their runs' alignment pads (_plan_runs), so
        # that a batch of exactly 2 x max_staging_bytes is two rounds, not two and a sliver (see _rounds)
        self._ring_bytes = max_staging_bytes + max(4096, max_staging_bytes // 128)
        for p in (save_path, load_path):
            if p not in ("auto", "zero-copy", "dma"):
                raise ValueError(f"umbp: transfer path must be 'auto', 'zero-copy' or 'dma', got {p!r}")
        self.save_path, self.load_path = save_path, load_path
        # dma copies of scattered runs: one batch call (batchcopy.py) where the CUDA runtime has it
        self._batch_copy = batchcopy.load() if cuda else None
        if dma_min_run_bytes is None:  # below the bar zero-copy was faster (H200, docs/transfer.md)
            dma_min_run_bytes = (256 << 10) if self._batch_copy is not None else (4 << 20)
        # 'auto' sends a batch under this many bytes zero-copy whatever its runs: one launch instead of a
        # gather, staging and copies, ~0.2 ms less host time per call, which a step that waits on the host
        # feels; on a GPU-bound step the SM-driven copy of so little cost nothing measurable (H200,
        # archive/2026-12-01-transfer-16-small-batches-step.txt)
        self.dma_min_batch_bytes = dma_min_batch_bytes
        self.dma_min_run_bytes = dma_min_run_bytes  # one bar for both ways: mixing DMA one way with SM
        # traffic the other way ran at half the copy engines' both-ways rate (docs/transfer.md)
        self.ctas = ctas or (
            torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 4
        )
        self.arena_base = self.arena_tensor.data_ptr()
        self.align = {g: geom.alignment() for g, geom in self.groups.items()}
        rows = max((geom.object_bytes for geom in self.groups.values()), default=0) // ROW_BYTES + 2
        ktab = lane_table(LANES * rows)[: LANES * rows]  # psum64's lane weights for every row of an object
        self.ktab = torch.from_numpy(ktab.view(np.int64).copy()).to(self.device)
        # rows of a checksum tile (triton_kernels.py): enough for the longest piece wherever it starts, a power of
        # two, at most 16. A tile is computed whole, so a taller one than needed wastes work on masked rows
        longest = max(
            (int(geom.template.nbytes.max()) for geom in self.groups.values() if geom.template.nbytes.size),
            default=ROW_BYTES,
        )
        span = (longest + ROW_BYTES - 8) // ROW_BYTES + 1
        self.crows = min(16, 1 << (span - 1).bit_length())
        self.tmpl, self.toff = _templates(self.groups, self.device)
        self.streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) if cuda else None
        # dma rounds: gathers (save) / verify + scatter (load) run on these, so round r's kernels overlap
        # round r-1's (or r+1's) copy-engine transfer on the direction's main stream
        self.aux = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) if cuda else None
        self._ring: dict[int, list[list]] = {SAVE: [], LOAD: []}  # per direction: [[staging, free event]]
        self._turn = {SAVE: 0, LOAD: 0}
        self._dummy = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._tables = _TablePool()
        self._last_sorted: tuple[Batch, tuple[np.ndarray, ...]] | None = None
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

    # ------------------------------------------------------------------ save / load
    def _save(self, batch: Batch) -> Handle:
        if not self._fast(batch):
            self.synchronize()
            return staged_save(self.arena, self.device, batch)
        keep: list[torch.Tensor] = []
        caller = self._caller()
        try:
            with self._on(SAVE, caller):
                if self._path(batch, self.save_path, self.dma_min_run_bytes) == "zero-copy":
                    digests = self._save_zero_copy(batch, keep)
                else:
                    digests = self._save_dma(batch, keep, caller, self._idle(SAVE))
                return self._track(SAVE, self._finish(batch, digests, keep, _mix(batch), self._main(SAVE)))
        except BaseException:
            self._drain(keep)
            raise

    def _save_zero_copy(self, batch: Batch, keep: list[torch.Tensor]) -> torch.Tensor:
        arena = [self.arena_base + offs for _g, _m, _i, offs in batch]
        plan = self._plan(batch, [arena], sums=True, stream=self._main(SAVE))
        self._copy(plan, None, 0, self._align16(batch, arena), checksum=True)
        keep.append(plan.buf)
        return plan.sums()

    def _save_dma(self, batch: Batch, keep: list[torch.Tensor], caller, cold: bool) -> torch.Tensor:
        """Per round: KV pages -> staging (kernel on the gather stream, HBM speed, checksums), then
        staging -> arena on the save stream (copy engine, one copy per run of adjacent slots). Round r's
        gather runs while round r-1's copy does; two staging buffers take turns."""
        gather, save = self._side(SAVE), self._main(SAVE)
        if gather is not None:
            gather.wait_stream(caller)
        digests = []
        for r in self._rounds(batch, cold):
            stg, rows, runs, slot = self._staging(r, SAVE)
            with self._stream(gather):
                self._acquire(slot, gather)
                plan = self._plan(r, [rows], sums=True, stream=gather)
                self._copy(plan, None, 0, self._align16(r, rows), checksum=True)
                gathered = self._event(gather)
            if gathered is not None:
                save.wait_event(gathered)
            self._copy_runs(runs, stg, to_arena=True, stream=save)
            digests.append(plan.sums())
            self._release(slot, save)
            if save is not None:
                plan.buf.record_stream(save)  # made on the gather stream, read on this one
            keep += [stg, plan.buf]
        return _cat(digests)

    def _load(self, batch: Batch) -> Handle:
        if not self._fast(batch):
            self.synchronize()
            return staged_load(self.arena, self.device, batch)
        keep: list[torch.Tensor] = []
        dma = self._path(batch, self.load_path, self.dma_min_run_bytes) == "dma"
        caller, last = self._caller(), self._main(LOAD)
        try:
            with self._on(LOAD, caller):
                if dma:
                    oks, last = self._load_dma(batch, keep, caller, self._idle(LOAD)), self._side(LOAD)
                elif all(m.digests is None for _g, m, _i, _o in batch):
                    oks = [self._load_direct(batch, keep)]
                else:
                    oks = [self._load_staged(r, keep) for r in self._rounds(batch)]
                with self._stream(last if dma else None):  # the handle completes after the last scatter
                    return self._track(LOAD, self._finish(batch, _cat(oks), keep, None, last))
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

    def _load_direct(self, batch: Batch, keep: list[torch.Tensor]) -> torch.Tensor:
        arena = [self.arena_base + offs for _g, _m, _i, offs in batch]
        plan = self._plan(batch, [arena], sums=False, stream=self._main(LOAD))
        self._copy(plan, 0, None, self._align16(batch, arena))
        keep.append(plan.buf)
        return torch.ones(plan.nobj, dtype=torch.int8, device=self.device)

    def _load_staged(self, batch: Batch, keep: list[torch.Tensor]) -> torch.Tensor:
        """Verified zero-copy load: arena -> device staging by the kernel (with checksums), checksums
        compared on the GPU, then staging -> KV pages for the objects that matched."""
        stg, rows, _runs, slot = self._staging(batch, LOAD)
        self._acquire(slot, self._main(LOAD))
        arena = [self.arena_base + offs for _g, _m, _i, offs in batch]
        want = self._expected(batch)
        plan = self._plan(batch, [arena, rows], sums=True, stream=self._main(LOAD))
        self._copy(plan, 0, 1, self._align16(batch, arena + rows), checksum=True)
        ok = self._verify(plan.sums(), want)
        self._copy(plan, 1, None, self._align16(batch, rows), ok=ok)
        self._release(slot, self._main(LOAD))
        keep += [stg, plan.buf]
        return ok

    def _load_dma(self, batch: Batch, keep: list[torch.Tensor], caller, cold: bool) -> list[torch.Tensor]:
        """Per round: arena -> staging on the load stream (copy engine, one copy per run), then on the
        scatter stream the checksums compared on the GPU (when digests are given) and staging -> KV
        pages for the objects that matched. Round r's scatter runs while round r+1's copy does."""
        copy, work = self._main(LOAD), self._side(LOAD)
        if work is not None:
            work.wait_stream(caller)
        oks = []
        for r in self._rounds(batch, cold):
            stg, rows, runs, slot = self._staging(r, LOAD)
            self._acquire(slot, copy)
            want = self._expected(r)  # uploaded ahead of the bulk copy: see _upload
            self._copy_runs(runs, stg, to_arena=False, stream=copy)
            copied = self._event(copy)
            with self._stream(work):
                if copied is not None:
                    work.wait_event(copied)
                ok = None
                plan = self._plan(r, [rows], sums=want is not None, stream=work)
                if want is not None:
                    self._copy(plan, 0, 0, self._align16(r, rows), checksum=True, store=False)
                    ok = self._verify(plan.sums(), want)
                    if work is not None:
                        want.record_stream(work)  # made on the copy stream, read on this one
                    keep.append(want)
                self._copy(plan, 0, None, self._align16(r, rows), ok=ok)
                self._release(slot, work)
                if ok is None:  # made on this stream, which the handle's event follows
                    ok = torch.ones(plan.nobj, dtype=torch.int8, device=self.device)
            keep += [stg, plan.buf]
            oks.append(ok)
        return oks

    def _expected(self, batch: Batch) -> torch.Tensor | None:
        """The given digests on the device as [2, objects] int64: digest (as _Plan.sums gives it), and 1 where
        none was given (the object is then not checked); None when no object of the batch has one."""
        if all(m.digests is None for _g, m, _i, _o in batch):
            return None
        want = np.concatenate(
            [
                np.stack([np.zeros(ids.size, np.uint64), np.ones(ids.size, np.uint64)])
                if m.digests is None
                else np.stack(
                    [np.asarray(m.digests, np.uint64) ^ _mix([(g, m, ids, o)]), np.zeros(ids.size, np.uint64)]
                )
                for g, m, ids, o in batch
            ],
            axis=1,
        )  # digests less their length term: _Plan.sums
        return self._upload(want.view(np.int64))

    @staticmethod
    def _verify(got: torch.Tensor, want: torch.Tensor | None) -> torch.Tensor:
        if want is None:
            return torch.ones(got.shape, dtype=torch.int8, device=got.device)
        return ((got == want[0]) | (want[1] != 0)).to(torch.int8)

    def _staging(
        self, batch: Batch, direction: int
    ) -> tuple[torch.Tensor, list[np.ndarray], tuple[np.ndarray, ...], list]:
        """Device staging laid out like the batch's runs of adjacent arena slots (pads between objects
        included), so that each run is one copy. Returns (16-byte aligned uint8 buffer, per-Moves row
        addresses, copy runs as arrays (arena offset, staging offset, bytes), its ring slot: see _acquire)."""
        pos, runs, total = _plan_runs(self._sorted_runs(batch))
        slot = self._ring_slot(direction, total)
        rows = np.split(slot[0].data_ptr() + pos, np.cumsum([ids.size for _g, _m, ids, _o in batch])[:-1])
        return slot[0], list(rows), runs, slot

    def _copy_runs(self, runs: tuple[np.ndarray, ...], stg: torch.Tensor, to_arena: bool, stream) -> None:
        """Staging <-> arena on `stream` (the current one), one copy-engine copy per run: all in one batch
        call where the runtime has it and there are several runs (scattered slots), else run by run."""
        arena, staging, size = runs
        if self._batch_copy is not None and arena.size > 2:
            a, s = self.arena_base + arena, stg.data_ptr() + staging
            dsts, srcs = (a, s) if to_arena else (s, a)
            self._batch_copy(dsts, srcs, size, stream.cuda_stream)
            return
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
            return [_aligned(nbytes, self.device), None]
        if not ring:  # both at once: never an allocation (which can fail) between a batch's rounds
            ring += [[_aligned(self._ring_bytes, self.device), None] for _ in range(2)]
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
        """Nothing of this direction is still running on the device: the batch's first copy would wait for
        its planning and gather alone, so _rounds cuts that round small. Per direction: when saves and
        loads start together, the second call's copy engine is idle too (H200, 16 KiB pages, side by side
        in one process: both ways 87.5/85.6/87.7 -> 87.3/90.1/88.6 GB/s for 1 GiB each way, 93.1/92.9/93.4
        -> 93.1/94.4/94.4 sustained, one direction alone unchanged; archive/2026-12-01-transfer-13-ramp-per-direction.txt)."""
        return _passed(self._last[direction])

    def _track(self, direction: int, handle: Handle) -> Handle:
        self._last[direction] = getattr(handle, "_event", None)
        return handle

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
        return "dma" if nbytes >= min_run_bytes * self._sorted_runs(batch)[0].size else "zero-copy"

    def _sorted_runs(self, batch: Batch) -> tuple[np.ndarray, ...]:
        """_sorted_runs(batch), kept for the batch seen last: a call that is one round sorts its slots once
        for _path and _staging (each sort was ~0.1 ms of the H200 host's time per call)."""
        if self._last_sorted is None or self._last_sorted[0] is not batch:
            self._last_sorted = (batch, _sorted_runs(batch))
        return self._last_sorted[1]

    def _rounds(self, batch: Batch, cold: bool = False) -> list[Batch]:
        """Cut the batch, in order, into rounds that each fit a ring buffer and are all about one size. One
        round's kernels run beside the next one's copy (see _save_dma / _load_dma); with two buffers taking
        turns, a small last round would make the next batch's first round wait for the buffer of the round
        before it, a gap of one gather or scatter on the copy engine at every batch boundary (measured:
        0.2-0.3 ms per 256 MiB batch on the H200). `cold` (see _idle): the first round is 1/RAMP of a
        buffer, so the copy engine starts after planning and gathering that much; the next round is planned
        while it copies."""
        cost = [slot_reach(geom.object_bytes, m) + 16 for geom, m, _i, _o in batch]  # + worst-case run pad
        total = sum(c * part[2].size for c, part in zip(cost, batch, strict=True))
        if total <= self._ring_bytes:
            return [batch]
        first = self._ring_bytes // self.RAMP if cold and self.RAMP > 1 else 0
        fewest = -(-(total - first) // self._ring_bytes)  # rounds needed after the first
        # an even share, plus one object so that the greedy cut below needs no extra round
        budget = min(self._ring_bytes, -(-(total - first) // fewest) + max(cost))
        rounds: list[Batch] = [[]]
        used, room_of = 0, first or budget
        for c, (geom, m, ids, offs) in zip(cost, batch, strict=True):
            s = 0
            while s < ids.size:
                room = (room_of - used) // c
                if room <= 0 and rounds[-1]:
                    rounds.append([])
                    used, room_of = 0, budget
                    continue
                e = min(ids.size, s + max(1, room))  # an object over the budget gets a round of its own
                digests = None if m.digests is None else list(m.digests)[s:e]
                rounds[-1].append(
                    (geom, Moves(m.group, ids[s:e], offs[s:e], digests, m.slot_bytes), ids[s:e], offs[s:e])
                )
                used += (e - s) * c
                s = e
        return [r for r in rounds if r]

    # ------------------------------------------------------------------ helpers
    def _fast(self, batch: Batch) -> bool:
        return all(self.align[m.group] >= 8 for _g, m, _i, _o in batch)

    def _align16(self, batch: Batch, sides: list[np.ndarray]) -> bool:
        if any(self.align[m.group] < 16 for _g, m, _i, _o in batch):
            return False
        return all(int(np.bitwise_or.reduce(s)) % 16 == 0 for s in sides if s.size)

    def _plan(self, batch: Batch, rows: list[list[np.ndarray]], sums: bool, stream) -> _Plan:
        """The launch's plan (see triton_kernels.py): a segment per Moves, each object's block id and its
        addresses on each side in `rows` (per Moves, one address per object), zeroed checksum words. Built
        in place in page-locked memory and brought to the device by _fetch."""
        nseg, counts = len(batch), np.array([ids.size for _g, _m, ids, _o in batch], np.int64)
        nobj = int(counts.sum())
        host = self._host_buffer(4 * nseg + nobj * (1 + len(rows) + sums))
        words = host.numpy()
        seg = words[: 4 * nseg].reshape(4, nseg)
        per = np.array([g.template.obj.size for g, _m, _i, _o in batch], np.int64)
        pieces = counts * per
        seg[0] = np.cumsum(pieces) - pieces
        seg[1] = np.cumsum(counts) - counts
        seg[2] = per
        seg[3] = [self.toff[m.group] for _g, m, _i, _o in batch]
        plan = _Plan(host, nseg, int(pieces.sum()), nobj, len(rows), sums)
        at = plan.ids_at
        for column in ([ids for _g, _m, ids, _o in batch], *rows):
            np.concatenate(column, out=words[at : at + nobj])
            at += nobj
        words[at:] = 0
        if self.device.type == "cuda":
            plan.buf = self._fetch(host, stream)
        return plan

    def _copy(
        self,
        plan: _Plan,
        src: int | None,
        dst: int | None,
        align16: bool,
        checksum: bool = False,
        ok: torch.Tensor | None = None,
        store: bool = True,
    ) -> None:
        """Run the copy kernel over a plan; src / dst: the plan's row column, or None for the KV pages."""
        if plan.n == 0:
            return
        col = [plan.at(c) if c is not None else 0 for c in (src, dst)]
        self.kernel[(min(plan.n, self.ctas),)](
            plan.buf,
            plan.nseg,
            plan.n,
            self.tmpl,
            self.tmpl.shape[1],
            plan.ids_at,
            col[0],
            col[1],
            plan.sums_at(),
            self.ktab,
            self._dummy if ok is None else ok,
            BLOCK=self.block,
            SRC_KV=src is None,
            DST_KV=dst is None,
            CHECKSUM=checksum,
            GUARD=ok is not None,
            ALIGN16=align16,
            STORE=store,
            CROWS=self.crows,
            num_warps=self.num_warps,
        )

    def _host_buffer(self, words: int) -> torch.Tensor:
        """int64 host memory for a plan: on CUDA page-locked, from the engine's own pool (see _TablePool),
        and handed back to the pool by _fetch once the device has read it."""
        if self.device.type != "cuda":
            return torch.empty(words, dtype=torch.int64)
        return self._tables.take(words)

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """A host-to-device copy on the current stream; it queues on the copy engine behind bulk copies
        already issued, so issue it before a round's bulk copy, never between that copy and its kernels."""
        t = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

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
        memory): no copy-engine queue to wait in."""
        n = src.numel()
        if n:
            self.fetch[(-(-n // FETCH_BLOCK),)](src, dst, n, BLOCK=FETCH_BLOCK)

    def _on(self, direction: int, caller) -> AbstractContextManager:
        """Run on this direction's stream, after the work already queued on the caller's stream."""
        if self.streams is None:
            return nullcontext()
        s = self.streams[direction]
        s.wait_stream(caller)
        return torch.cuda.stream(s)

    def _finish(
        self, batch: Batch, values: torch.Tensor, keep: list[torch.Tensor], mix: np.ndarray | None, stream
    ) -> Handle:
        """mix: for saves, each object's psum64 length term (xored in on the host: see _Plan.sums). Runs on
        `stream` (the current one): the handle completes after everything queued there."""
        sizes = [ids.size for _g, _m, ids, _o in batch]
        if self.streams is None:
            return DeviceHandle(sizes, None, values.clone(), keep, mix)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        # SM stores, not a copy-engine copy: a load's few bytes of ok flags waited ~5 ms behind the saves'
        # bulk D2H copies, and the load's next rounds behind them (H200, history/31)
        self._sm_copy(values, host)
        event = torch.cuda.Event()
        event.record(stream)
        return DeviceHandle(sizes, event, host, keep, mix)


class _Plan:
    """A launch's plan on the device (layout: triton_kernels.py). `sums()`: each object's pieces' checksum
    terms xored together, i.e. its psum64 less the length term, which the host xors in (DeviceHandle,
    _expected), so the device needs no extra op per group."""

    def __init__(self, buf: torch.Tensor, nseg: int, n: int, nobj: int, ncols: int, has_sums: bool):
        self.buf, self.nseg, self.n, self.nobj, self.ncols, self.has_sums = (
            buf,
            nseg,
            n,
            nobj,
            ncols,
            has_sums,
        )

    @property
    def ids_at(self) -> int:
        """Word offset of the block ids (after the segment table)."""
        return 4 * self.nseg

    def at(self, column: int) -> int:
        """Word offset of a row column (0-based; the block ids come before them)."""
        return self.ids_at + (1 + column) * self.nobj

    def sums_at(self) -> int:
        return self.at(self.ncols) if self.has_sums else 0

    def sums(self) -> torch.Tensor:
        at = self.sums_at()
        return self.buf[at : at + self.nobj]


def _templates(groups: Mapping[int, Any], device: torch.device) -> tuple[torch.Tensor, dict[int, int]]:
    """Every group's piece template in one int64 [4, pieces] device table (see triton_kernels.py), and the
    column where each group's pieces start."""
    toff, cols, at = {}, [], 0
    for g, geom in groups.items():
        t = geom.template
        toff[g] = at
        cols.append(np.stack([t.src, t.stride, t.obj, t.nbytes]))
        at += t.obj.size
    table = np.concatenate(cols, axis=1) if cols else np.zeros((4, 1), np.int64)
    return torch.from_numpy(np.ascontiguousarray(table)).to(device), toff


class _TablePool:
    """Page-locked int64 buffers for plans, each reused once the kernel that copies it to the device has
    run (an event recorded after that launch). PyTorch's pinned allocator cost up to ~0.25 ms per buffer
    on the H200 host in save calls (measured, when plans were tables of pieces)."""

    MIN_WORDS = 1 << 17  # 1 MiB: a plan of up to ~32K objects (4 words each) fits one buffer
    KEEP = 32  # idle buffers kept once the device is done with them (more stay while still being read)

    def __init__(self) -> None:
        self._idle: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()

    def take(self, words: int) -> torch.Tensor:
        while self._idle:
            buf, done = self._idle[0]
            if not _passed(done):
                break  # the oldest is still being read, and the younger ones most likely too
            self._idle.popleft()
            if buf.numel() >= words:
                return buf[:words]  # (a buffer too small for this table is dropped)
        return torch.empty(max(words, self.MIN_WORDS), dtype=torch.int64, pin_memory=True)[:words]

    def give(self, table: torch.Tensor, done: torch.cuda.Event | None) -> None:
        base = table if table._base is None else table._base
        if any(buf is base for buf, _ in self._idle):
            return  # already idle: handing it out twice would let two plans share memory
        self._idle.append((base, done))
        while len(self._idle) > self.KEEP and _passed(self._idle[0][1]):
            self._idle.popleft()  # only a buffer the device is done with: dropping one it still reads
            # would let the pinned allocator hand its memory to another tensor under the running fetch


def _passed(event: torch.cuda.Event | None) -> bool:
    return event is None or event.query()


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _mix(batch: Batch) -> np.ndarray:
    """Each object's psum64 length term (umbp.pool.psum), as uint64."""
    return np.concatenate(
        [np.full(ids.size, digest_mix(g.object_bytes), np.int64) for g, _m, ids, _o in batch]
    ).view(np.uint64)


def _sorted_runs(batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(first and last index of each run, in offset order; the order; sorted offsets; sorted sizes)."""
    offs = np.concatenate([o for _g, _m, _i, o in batch])
    size = np.concatenate([np.full(ids.size, g.object_bytes, np.int64) for g, _m, ids, _o in batch])
    reach = np.concatenate(
        [np.full(ids.size, slot_reach(g.object_bytes, m), np.int64) for g, m, ids, _o in batch]
    )
    order = np.argsort(offs, kind="stable")
    so, sr, ss = offs[order], reach[order], size[order]
    cut = np.flatnonzero(so[1:] != so[:-1] + sr[:-1]) + 1
    return np.concatenate([[0], cut]), np.concatenate([cut, [so.size]]) - 1, order, so, ss


def _plan_runs(sorted_runs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, tuple[np.ndarray, ...], int]:
    """Objects sorted by arena offset and cut into runs where one slot ends exactly where the next
    begins (a slot reaches its Moves' slot_bytes), from _sorted_runs. Returns (each object's staging
    offset, in batch order; runs as arrays (arena offset, staging offset, bytes), the last object's pad
    left out; staging bytes)."""
    first, last, order, so, ss = sorted_runs
    start, length = so[first], so[last] + ss[last] - so[first]
    padded = (length + 15) // 16 * 16  # keep every run's staging 16-byte aligned (the kernel's wide path)
    base = np.cumsum(padded) - padded
    run_of = np.repeat(np.arange(first.size), last - first + 1)
    pos = np.empty_like(so)
    pos[order] = base[run_of] + so - start[run_of]
    return pos, (start, base, length), int(padded.sum())


def _aligned(nbytes: int, device: torch.device) -> torch.Tensor:
    raw = torch.empty(nbytes + 16, dtype=torch.uint8, device=device)
    return raw[(-raw.data_ptr()) % 16 :]
