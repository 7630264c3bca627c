"""What the copy kernel is told, and how a batch is cut and laid out before any copy is issued.

The kernel engine (kernel_engine.py) submits work and completes handles; this module holds the pure
planning it relies on, host side only:

* `Plan`: one launch's plan in int64 words (layout in triton_kernels.py): a segment table, each object's
  block id, its addresses on the arena or staging side, the digests a verified load expects, and zeroed
  checksum words. Built in page-locked memory from a `TablePool`.
* `plan_rounds`: for every round of a batch in one pass, its arena slots sorted and cut into runs of
  adjacent slots, and where each object lies in device staging, so that each run is one copy-engine copy.
  `sorted_runs` / `plan_runs` compute the same for one round, step by step: the reference the tests hold
  plan_rounds to. Per-object constants of a batch come from its `BatchShape` (shapes.py).
* `round_budgets` / `round_bounds`: how a batch is cut into rounds that fit a staging buffer, shaped
  for what the caller waits for (see round_budgets). `slice_batch`: a round as a Batch of its own (the
  engine runs a round as a span of the call's plan instead; tests state rounds this way).
* `lay_out`: round_bounds and plan_rounds in one call to the C extension umbp.transfer._rounds where it is
  built (identical results), else those numpy functions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from umbp.pool.native import optional_extension
from umbp.transfer.api import Moves, slot_reach
from umbp.transfer.shapes import BatchShape, template_offsets
from umbp.transfer.staged import Batch

RUN_PAD = 16  # staging bytes a run may need for alignment: the worst case a round budget counts per object
_rounds, _why_not = optional_extension("umbp.transfer._rounds")  # lay_out in one C call (_rounds.c)

Layout = tuple[np.ndarray, tuple[np.ndarray, ...], int]  # (pos, (arena, staging, bytes) runs, total)


class Plan:
    """A call's plan (layout: triton_kernels.py): segment table [4, nseg], block ids [nobj], `ncols` row
    columns [nobj] each (offsets from a base each launch passes), then (verified loads) expected digests
    as (digest less its length term, skip) pairs [2 * nobj], then (checksumming calls) one zeroed
    checksum word per object. Every launch of the call reads it, each over the pieces of its round
    (`span`). `sums()`: each object's pieces' checksum terms xored together, i.e. its psum64 less the
    length term, which the host xors in (completion.DeviceHandle), so the device needs no extra op per
    group."""

    def __init__(self, shape: BatchShape, host: torch.Tensor, ncols: int, want: bool, sums: bool):
        self.shape, self.host, self.buf = shape, host, host
        self.nseg, self.n, self.nobj, self.ncols = len(shape.counts), shape.pieces, shape.nobj, ncols
        self.has_want, self.has_sums = want, sums

    def span(self, a: int, b: int) -> tuple[int, int]:
        """The pieces of objects a:b (a round): the launch's first piece and end."""
        if a == 0 and b == self.nobj:
            return 0, self.n
        return self.shape.piece(a), self.shape.piece(b)

    @property
    def ids_at(self) -> int:
        """Word offset of the block ids (after the segment table)."""
        return 4 * self.nseg

    def at(self, column: int) -> int:
        """Word offset of a row column (0-based; the block ids come before them)."""
        return self.ids_at + (1 + column) * self.nobj

    def want_at(self) -> int:
        return self.at(self.ncols) if self.has_want else 0

    def sums_at(self) -> int:
        if not self.has_sums:
            return 0
        return self.at(self.ncols) + (2 * self.nobj if self.has_want else 0)

    @property
    def words(self) -> int:
        return self.at(self.ncols) + (2 * self.has_want + self.has_sums) * self.nobj

    def sums(self) -> torch.Tensor:
        at = self.sums_at()
        return self.buf[at : at + self.nobj]


def build_plan(
    shape: BatchShape,
    batch: Batch,
    ids: np.ndarray,
    rows: list[np.ndarray],
    sums: bool,
    host: Any,
) -> Plan:
    """Fill a plan for `batch` of this `shape` (ids: its block ids; rows: per column, one row offset per
    object, each in batch order) in `host(words)`, a function returning an int64 tensor of that many
    words. Verified loads (any Moves with digests) get the expected digests; `sums`: checksum words. The
    segment table and the length terms come from the shape, made once per batch shape."""
    nseg, nobj = len(batch), shape.nobj
    want = any(m.digests is not None for _g, m, _i, _o in batch)
    plan = Plan(shape, None, len(rows), want, sums)  # type: ignore[arg-type]
    words = host(plan.words)
    plan.host = plan.buf = words
    w = words.numpy()
    w[: 4 * nseg] = shape.seg.reshape(-1)
    at = plan.ids_at
    for column in (ids, *rows):
        w[at : at + nobj] = column
        at += nobj
    if want:
        pairs = w[at : at + 2 * nobj].reshape(nobj, 2)
        given = [m.digests is not None for _g, m, _i, _o in batch]
        digests = [d for _g, m, _i, _o in batch if m.digests is not None for d in m.digests]
        if all(given):
            pairs[:, 0] = (np.fromiter(digests, np.uint64, nobj) ^ shape.mix).view(np.int64)
            pairs[:, 1] = 0  # 0: checked
        else:
            checked = np.repeat(np.array(given), shape.counts)
            d = np.zeros(nobj, np.uint64)
            d[checked] = np.fromiter(digests, np.uint64, int(checked.sum())) ^ shape.mix[checked]
            pairs[:, 0] = d.view(np.int64)
            pairs[:, 1] = ~checked  # 1: not checked
        at += 2 * nobj
    w[at:] = 0
    return plan


def templates(groups: Mapping[int, Any], device: torch.device) -> tuple[torch.Tensor, dict[int, int]]:
    """Every group's piece template in one int64 [4, pieces] device table (see triton_kernels.py), and the
    column where each group's pieces start."""
    toff = template_offsets(list(groups.items()))  # the columns BatchShape segment tables name
    cols = [np.stack([t.src, t.stride, t.obj, t.nbytes]) for t in (geom.template for geom in groups.values())]
    table = np.concatenate(cols, axis=1) if cols else np.zeros((4, 1), np.int64)
    return torch.from_numpy(np.ascontiguousarray(table)).to(device), toff


class TablePool:
    """Page-locked int64 buffers for plans and results, each reused once the device is done with it (an
    event) or its reader gave it back. PyTorch's pinned allocator cost up to ~0.25 ms per buffer on the
    H200 host in save calls (measured, when plans were tables of pieces)."""

    MIN_WORDS = 1 << 17  # 1 MiB: a plan of up to ~32K objects (4 words each) fits one buffer
    KEEP = 32  # idle buffers kept once the device is done with them (more stay while still being read)

    def __init__(self) -> None:
        self._idle: deque[tuple[torch.Tensor, Any]] = deque()
        self.allocations = 0  # buffers made (each a page-locked allocation: what the pool exists to avoid)

    def take(self, words: int) -> torch.Tensor:
        while self._idle:
            buf, done = self._idle[0]
            if not passed(done):
                break  # the oldest is still being read, and the younger ones most likely too
            self._idle.popleft()
            if buf.numel() >= words:
                return buf[:words]  # (a buffer too small for this table is dropped)
        self.allocations += 1
        return torch.empty(max(words, self.MIN_WORDS), dtype=torch.int64, pin_memory=True)[:words]

    def give(self, table: torch.Tensor, done: Any) -> None:
        base = table if table._base is None else table._base
        if any(buf is base for buf, _ in self._idle):
            return  # already idle: handing it out twice would let two plans share memory
        self._idle.append((base, done))
        while len(self._idle) > self.KEEP and passed(self._idle[0][1]):
            self._idle.popleft()  # only a buffer the device is done with: dropping one it still reads
            # would let the pinned allocator hand its memory to another tensor under the running fetch


def passed(event: Any) -> bool:
    return event is None or event.query()


def sorted_runs(
    batch: Batch, shape: BatchShape | None = None, offs: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(first and last index of each run, in offset order; the order; sorted offsets; sorted sizes).
    `shape` / `offs` (the batch's shape and joined offsets, when the caller has them) spare the numpy
    calls that expand per-Moves sizes and reaches to objects: a restore is a Moves per cache group, and
    small numpy calls cost ~1-5 us each on a slow host, in front of the first copy."""
    if offs is None:
        offs = batch[0][3] if len(batch) == 1 else np.concatenate([o for _g, _m, _i, o in batch])
    if shape is None:
        counts = [ids.size for _g, _m, ids, _o in batch]
        size = np.repeat(np.array([g.object_bytes for g, _m, _i, _o in batch], np.int64), counts)
        reach = np.repeat(
            np.array([slot_reach(g.object_bytes, m) for g, m, _i, _o in batch], np.int64), counts
        )
        uniform = None
    else:
        size, reach, uniform = shape.size, shape.reach, shape.uniform_reach
    order = np.argsort(offs, kind="stable")
    so, ss = offs[order], size[order]
    ends = so[:-1] + (uniform if uniform is not None else reach[order][:-1])
    starts = np.flatnonzero(so[1:] != ends) + 1  # the runs after the first
    n = so.size
    first = np.empty(starts.size + 1, np.int64)
    first[0] = 0
    first[1:] = starts
    last = np.empty_like(first)
    last[:-1] = starts - 1
    last[-1] = n - 1
    return first, last, order, so, ss


def plan_runs(runs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, tuple[np.ndarray, ...], int]:
    """Objects sorted by arena offset and cut into runs where one slot ends exactly where the next
    begins (a slot reaches its Moves' slot_bytes), from sorted_runs. Returns (each object's staging
    offset, in batch order; runs as arrays (arena offset, staging offset, bytes), the last object's pad
    left out; staging bytes)."""
    first, last, order, so, ss = runs
    start = so[first]
    length = so[last] + ss[last] - start
    padded = (length + (RUN_PAD - 1)) & -RUN_PAD  # every run's staging 16-byte aligned (wide path)
    ends = np.cumsum(padded)
    base = ends - padded
    shift = (base - start)[np.repeat(np.arange(first.size), last - first + 1)]
    pos = np.empty_like(so)
    pos[order] = so + shift
    return pos, (start, base, length), int(ends[-1]) if ends.size else 0


def plan_rounds(
    offs: np.ndarray,
    size: np.ndarray,
    reach: np.ndarray,
    bounds: list[int],
    order: np.ndarray | None = None,
) -> list[tuple[np.ndarray, tuple[np.ndarray, ...], int]]:
    """plan_runs(sorted_runs(round)) for every round of a batch at once (rounds: consecutive objects of
    the batch, round r = objects bounds[r]:bounds[r + 1], as round_bounds cuts them; offs, size, reach:
    per object in batch order). One sort by (round, offset) and one pass instead of a sort and a layout
    per round: ~25 numpy calls a round, ~1-5 us each on a slow host, between a restore's copies.
    `order`: the stable argsort of offs, if the caller has it (one round only)."""
    n, nr = offs.size, len(bounds) - 1
    if order is not None and nr == 1:
        pass
    elif nr == 1:
        order = np.argsort(offs, kind="stable")
    else:  # stable within a round, like the per-round argsort: loads may share a slot
        sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        order = np.lexsort((offs, np.repeat(np.arange(nr), sizes)))
    so, ss = offs[order], size[order]
    new_run = np.empty(n, bool)
    new_run[0] = True
    np.not_equal(so[1:], so[:-1] + reach[order][:-1], out=new_run[1:])
    new_run[bounds[:-1]] = True  # sorted by round first: round r still holds positions bounds[r]:bounds[r+1]
    first = np.flatnonzero(new_run)
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1] = n - 1
    start = so[first]
    length = so[last] + ss[last] - start
    padded = (length + (RUN_PAD - 1)) & -RUN_PAD  # every run's staging 16-byte aligned (wide path)
    ends = np.cumsum(padded)
    cuts = np.searchsorted(first, bounds)  # each round's first run (and the run count at the end)
    before = np.concatenate(([0], ends))[cuts]  # staging bytes of the rounds before each round
    base = ends - padded - np.repeat(before[:-1], cuts[1:] - cuts[:-1])
    pos = np.empty_like(so)
    pos[order] = so + (base - start)[np.repeat(np.arange(first.size), last - first + 1)]
    totals = (before[1:] - before[:-1]).tolist()
    out = []
    for r in range(nr):
        a, b = cuts[r], cuts[r + 1]
        out.append((pos[bounds[r] : bounds[r + 1]], (start[a:b], base[a:b], length[a:b]), totals[r]))
    return out


def round_budgets(total: int, ring: int, shape: str, min_round: int, tail: int = 0) -> list[int]:
    """Staging bytes of each round of a batch of `total` bytes (each round fits one ring buffer of `ring`):

    * "even": as few rounds as fit, all about one size. Back-to-back batches (a serving engine's steady
      state): with two buffers taking turns, a small last round made the next batch's first round wait
      for the buffer of the round before it, a gather's or scatter's worth of idle copy engine at every
      batch boundary (0.2-0.3 ms per 256 MiB batch on the H200).
    * "taper" (a load that finds its direction idle, i.e. a restore someone waits for): halving rounds,
      down to `min_round`. A round's verify and scatter can start only when its copy is done, so the
      last round's are the restore's tail: a whole 128 MiB round's took ~0.2 ms on the H200. The first
      copy does not wait for the first round's size (it is issued before its kernels are planned).
      With `tail` > 0 a last round over twice `tail` is split so that the batch ends on a round of
      `tail` bytes: its verify and scatter are all that is left after the last copy, and the host
      plans them while the copies before it run.
    * "ramp" (a save that finds its direction idle): doubling rounds from `min_round`: the first copy
      waits for the first round's gather, so that one is small; later gathers run beside copies.

    Each round after the first must be planned on the host while the one before it copies: `min_round`
    keeps a round's copy longer than a round's host time."""
    if total <= 0:
        return [0]
    min_round = max(1, min(min_round, ring))
    if shape == "even" or total <= min_round:
        fewest = -(-total // ring)
        return [-(-total // fewest)] * fewest
    out, left = [], total
    size = min_round
    while left > 0:
        if shape == "taper":
            size = min(ring, max(min_round, left // 2))
            if left - size < min_round and left <= ring:
                size = left
        else:  # ramp
            size = min(ring, size)
            if left - size < size and left <= ring:
                size = left
        out.append(size)
        left -= size
        size *= 2
    if shape == "taper" and 0 < tail and 2 * tail < out[-1]:
        out[-1:] = [out[-1] - tail, tail]
    return out


def c_layout() -> bool:
    """Whether lay_out runs in C (umbp.transfer._rounds is built and not turned off)."""
    return _rounds is not None


def lay_out(
    offs: np.ndarray,
    size: np.ndarray,
    reach: np.ndarray,
    budgets: tuple[int, ...],
    cap: int,
    order: np.ndarray | None = None,
) -> tuple[list[int], list[Layout]]:
    """A batch cut into rounds (round_bounds; budgets empty: one round) and every round laid out
    (plan_rounds): (bounds, layouts). One C call where the extension is built (umbp.transfer._rounds,
    identical results: tests compare them), else those two numpy functions (`order`: the offsets'
    stable argsort, if the caller has it, for one round)."""
    n = int(offs.size)
    if _rounds is not None and n:
        out = np.empty(8 * n + 4, np.int64)
        try:
            nr, nruns = _rounds.lay_out(offs, size, reach, budgets, cap, RUN_PAD, out)
        except ValueError:  # offsets too large to sort beside this many indices: numpy sorts them
            pass
        else:
            return _unpacked(out, n, nr, nruns)
    bounds = round_bounds(reach + RUN_PAD, list(budgets), cap) if budgets else [0, n]
    return bounds, plan_rounds(offs, size, reach, bounds, order)


def _unpacked(out: np.ndarray, n: int, nr: int, nruns: int) -> tuple[list[int], list[Layout]]:
    """lay_out's C result (see _rounds.c for the word layout) as bounds and per-round views."""
    bounds = out[: nr + 1].tolist()
    pos = out[nr + 1 : nr + 1 + n]
    at = nr + 1 + n
    first = out[at : at + nr + 1].tolist()
    totals = out[at + nr + 1 : at + 2 * nr + 1].tolist()
    at += 2 * nr + 1
    start, base, length = (out[at + k * nruns : at + (k + 1) * nruns] for k in range(3))
    layouts = []
    for r in range(nr):
        a, b, x, y = bounds[r], bounds[r + 1], first[r], first[r + 1]
        layouts.append((pos[a:b], (start[x:y], base[x:y], length[x:y]), totals[r]))
    return bounds, layouts


def round_bounds(cost: np.ndarray, budgets: list[int], cap: int) -> list[int]:
    """Where each round of a batch starts, as an index into its objects in batch order (and the object
    count at the end): round k takes the longest run of objects whose costs (cost: per object, its slot's
    reach plus a run's worst-case alignment pad) add up to at most budgets[k], and at least one object
    (an object over its budget gets a round of its own). The last budget, and any round past it, may
    take up to `cap` (a ring buffer), so that the objects the greedy cut leaves over (budgets are bytes,
    objects are whole) join it instead of making a sliver of a round. A search per round on the costs'
    running sum: no per-object or per-Moves Python in front of a restore's first copy."""
    n = int(cost.size)
    if n == 0:
        return [0]
    cum = np.cumsum(cost)
    bounds, spent, k = [0], 0, 0
    while bounds[-1] < n:
        room = budgets[k] if k < len(budgets) - 1 else max(cap, budgets[-1])
        end = max(bounds[-1] + 1, int(np.searchsorted(cum, spent + room, side="right")))
        bounds.append(end)
        spent, k = int(cum[end - 1]), k + 1
    return bounds


def slice_batch(batch: Batch, a: int, b: int) -> Batch:
    """Objects a:b of the batch (indices in batch order) as a Batch of their own: each Moves cut to its
    part, Moves left with none dropped."""
    out: Batch = []
    at = 0
    for geom, m, ids, offs in batch:
        lo, hi = max(a - at, 0), min(b - at, ids.size)
        at += ids.size
        if lo >= hi:
            continue
        if lo == 0 and hi == ids.size:
            out.append((geom, m, ids, offs))
            continue
        digests = None if m.digests is None else _part(m.digests, lo, hi)
        part_ids, part_offs = ids[lo:hi], offs[lo:hi]
        out.append((geom, Moves(m.group, part_ids, part_offs, digests, m.slot_bytes), part_ids, part_offs))
    return out


def _part(values, s: int, e: int) -> list:
    """values[s:e] as a list, copying only that part when values is already one."""
    return values[s:e] if isinstance(values, list) else list(values)[s:e]


def aligned(nbytes: int, device: torch.device) -> torch.Tensor:
    raw = torch.empty(nbytes + 16, dtype=torch.uint8, device=device)
    return raw[(-raw.data_ptr()) % 16 :]
