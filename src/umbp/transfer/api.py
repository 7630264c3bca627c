"""The transfer engine's API, shared by the CUDA kernel path and the simple staged (CPU) path.

A batch is a list of `Moves`: for one KV-cache group, which blocks go to / come from which arena slots.
`save` gathers every layer's page of each block into its slot and returns each object's psum64 (the
arena's checksum, so a later load can verify the slot); `load` copies slots back into blocks, and when
expected digests are given it writes only the objects whose bytes match (a mismatch is reported, never
written into the KV cache). Both return a handle at once; on CUDA the work runs on the engine's own
streams (one per direction, so saves and loads overlap each other and the forward): a save reads KV
pages, and a load writes them, after the work already queued on the caller's current stream. A load
reads its arena slots as they are when it is called (the arena is host memory, written before).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from umbp.pool import Arena
from umbp.pool.native import optional_extension
from umbp.transfer.geometry import PIECE_BYTES, GroupGeometry
from umbp.transfer.shapes import BatchShape, ShapeCache, template_offsets

_checks = optional_extension("umbp.transfer._checks")[0]  # _checked in one C call (see _checks.c)


@dataclass(frozen=True)
class Moves:
    """One group's share of a batch: object i is block `block_ids[i]` <-> arena slot `offsets[i]`.
    `digests` (loads only): the psum64 recorded at save time, one per object, integers in [0, 2**64);
    None loads unchecked.
    `slot_bytes`: how far each slot reaches (>= the object; DramIndex slots are whole pages, and the
    scheduler may reserve a padded page size). A save may overwrite a slot's bytes past its object, which
    lets slots that touch end to start form one run, copied in one piece. None: the object's bytes only."""

    group: int
    block_ids: Sequence[int]
    offsets: Sequence[int]
    digests: Sequence[int] | None = None
    slot_bytes: int | None = None


class Handle:
    """An in-flight save or load. `result()` waits and returns, per Moves of the batch, the objects'
    digests (save) or whether each object was written (load)."""

    def __init__(self, sizes: list[int], values: list[Any] | None = None):
        self._sizes = sizes
        self._values = values

    def done(self) -> bool:
        """Non-blocking: has the device finished? (True at once for the staged path.)"""
        return True

    def wait(self) -> None:
        """Block until the device has finished."""

    def _flat(self) -> list[Any]:
        assert self._values is not None
        return self._values

    def result(self) -> list[list[Any]]:
        self.wait()
        flat, out, i = self._flat(), [], 0
        for n in self._sizes:
            out.append(flat[i : i + n])
            i += n
        return out


class TransferEngine:
    """Moves pages between registered KV-cache groups and an `Arena`. Subclasses implement `_save`/`_load`."""

    backend = "?"

    def __init__(
        self,
        arena: Arena,
        groups: Mapping[int, Sequence[tuple[torch.Tensor, int]]],
        piece_bytes: int = PIECE_BYTES,
    ):
        self.arena = arena
        self.arena_tensor = arena.tensor_view(0, arena.capacity_bytes)
        self.groups = {g: GroupGeometry(list(layers), piece_bytes) for g, layers in groups.items()}
        devices = {geom.device for geom in self.groups.values()}
        if len(devices) > 1:
            raise ValueError(f"umbp: all groups must live on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.shapes = ShapeCache(self.groups, template_offsets(list(self.groups.items())))
        # groups whose layers share memory (vLLM's hybrid layout): block b of each is one page, which
        # a load may write once across all of them
        self._alias = alias_classes(self.groups)
        self._notes = _alias_notes(self._alias)
        self._aliased = len(set(self._alias.values())) < len(self._alias)
        # what the C checks need per group: (object bytes, block count, alias class, duplicate note)
        self._limits = {
            g: (geom.object_bytes, geom.num_blocks, self._alias[g], self._notes[g])
            for g, geom in self.groups.items()
        }
        self._flat_of: tuple | None = None  # (batch, shape, ids, offsets) of the batch checked last

    def object_bytes(self, group: int) -> int:
        return self.groups[group].object_bytes

    def save(self, batch: Sequence[Moves]) -> Handle:
        """Start copying each block's pages into its slot; the handle's result is the digests."""
        checked = self._checked(batch, load=False)
        if not any(ids.size for _g, _m, ids, _o in checked):
            return Handle([0] * len(checked), [])
        return self._save(checked)

    def load(self, batch: Sequence[Moves]) -> Handle:
        """Start copying each slot into its block's pages; the handle's result says which were written."""
        checked = self._checked(batch, load=True)
        if not any(ids.size for _g, _m, ids, _o in checked):
            return Handle([0] * len(checked), [])
        return self._load(checked)

    def warm_up(self, block: int, offset: int, verify: bool = True) -> None:
        """Prepare now what the first transfers would otherwise prepare in the middle of serving (compiled
        kernels, staging buffers), using `block`'s pages and the arena at `offset`, which nobody may be
        using yet; their bytes are left as they were. Nothing to prepare on this backend."""

    def synchronize(self) -> None:
        """Wait for every transfer this engine started."""

    def fence(self, handle: Handle) -> None:
        """Order the caller's current stream after this transfer, on the device (the host does not wait):
        the next forward may rewrite a block that a save is still reading (the boundary page and the
        recurrent state of a running request). Nothing to do where handles complete synchronously."""

    def _save(self, batch: list[tuple[GroupGeometry, Moves, np.ndarray, np.ndarray]]) -> Handle:
        raise NotImplementedError

    def _load(self, batch: list[tuple[GroupGeometry, Moves, np.ndarray, np.ndarray]]) -> Handle:
        raise NotImplementedError

    def _checked(
        self, batch: Sequence[Moves], load: bool
    ) -> list[tuple[GroupGeometry, Moves, np.ndarray, np.ndarray]]:
        """Validate a batch before anything touches memory: a bad id or offset in a kernel is corruption.
        Returns, per Moves, (geometry, Moves, its ids, its offsets), the ids and offsets views of one
        array each for the whole batch. One C call where the extension is built (_checks.c: it lists
        the checks; this Python twin makes the same ones and raises the same errors, tests compare
        them): in Python they were ~60 us of the H200 host's time in front of a restore's first copy."""
        got = (
            None if _checks is None else _checks.flatten(batch, self._limits, self.arena.capacity_bytes, load)
        )
        if got is not None:
            key, buf, digests = got
            if not key:
                return []
            both = np.frombuffer(buf, np.int64)
            total = both.size // 2
            out = self._split(batch, key, both[:total], both[total:])[0]
            if digests is not None:  # some Moves' digests were converted (numpy integers, a non-list)
                for k, values in enumerate(digests):
                    if values is not None:
                        out[k] = _with_digests(out[k], values)
            return out
        return self._checked_py(batch, load)

    def _checked_py(
        self, batch: Sequence[Moves], load: bool
    ) -> list[tuple[GroupGeometry, Moves, np.ndarray, np.ndarray]]:
        """_checked in Python. The checks run once over the whole batch's arrays, not per Moves, against
        per-object limits kept per batch shape (shapes.py): a restore is one Moves per cache group."""
        key, total = [], 0
        for m in batch:
            geom = self.groups.get(m.group)
            if geom is None:
                raise KeyError(f"umbp: group {m.group} is not registered with the transfer engine")
            n, n_offs = _count(m.block_ids), _count(m.offsets)
            if n_offs != n or (m.digests is not None and len(m.digests) != n):
                raise ValueError(
                    "umbp: block_ids, offsets (and digests) of a Moves must have one entry per object"
                )
            reach = geom.object_bytes
            if m.slot_bytes is not None:
                reach = operator.index(m.slot_bytes)  # as C: an int64, or TypeError / OverflowError
                if not -(1 << 63) <= reach < 1 << 63:
                    raise OverflowError(f"umbp: slot_bytes {reach} does not fit in 64 bits")
                if reach < geom.object_bytes:
                    raise ValueError(
                        f"umbp: slot_bytes {m.slot_bytes} is smaller than group {m.group}'s objects "
                        f"({geom.object_bytes} bytes)"
                    )
            key.append((m.group, n, reach))
            total += n
        if not key:
            return []
        ids, offs = (
            _flat_int64([m.block_ids for m in batch], total),
            _flat_int64([m.offsets for m in batch], total),
        )
        out, shape = self._split(batch, tuple(key), ids, offs)
        if not ids.size:
            return out
        # as unsigned, a negative id is huge: one compare checks both ends of the range
        if (ids.view(np.uint64) >= shape.limit.view(np.uint64)).any():  # methods: no np.any wrapper
            for geom, _m, part, _o in out:
                geom.check_blocks(part)  # raises, naming the group's range
        # sign bit or any of the low 3 bits set: negative or not 8-byte aligned. The end compared as
        # offset > capacity - reach: offset + reach wraps in int64 for an offset near 2**63 (and a slot
        # reaching past the arena is refused here, before check_disjoint adds offsets and reaches)
        if (offs & _SIGN_OR_MISALIGNED).any() or (offs > self.arena.capacity_bytes - shape.reach).any():
            raise ValueError("umbp: arena offset outside the arena or not 8-byte aligned in a transfer batch")
        if load:
            for k, item in enumerate(out):
                values = _valid_digests(item[1], item[2].size)
                if values is not None:
                    out[k] = _with_digests(item, values)
            _check_single_writes(out, shape, ids, self._alias if self._aliased else None, self._notes)
        elif shape.uniform_reach is not None:
            check_disjoint([offs], [shape.uniform_reach])
        else:
            check_disjoint([o for _g, _m, _i, o in out], [r for _g, _c, r in key])
        return out

    def _split(
        self, batch: Sequence[Moves], key: tuple, ids: np.ndarray, offs: np.ndarray
    ) -> tuple[list[tuple[GroupGeometry, Moves, np.ndarray, np.ndarray]], BatchShape]:
        """Per Moves (geometry, Moves, ids, offsets) as views of the batch's joined arrays, and the
        batch's shape; both kept for the engine's planning (see flat())."""
        out, at = [], 0
        for m, (g, n, _r) in zip(batch, key, strict=True):
            out.append((self.groups[g], m, ids[at : at + n], offs[at : at + n]))
            at += n
        shape = self.shapes.get(key)
        self._flat_of = (out, shape, ids, offs)
        return out, shape

    def flat(self, batch: list) -> tuple[BatchShape, np.ndarray, np.ndarray]:
        """(shape, block ids, arena offsets) of a checked batch, the ids and offsets as one array each
        in batch order. The batch _checked saw last (the one a call plans) is not joined again."""
        known = self._flat_of
        if known is not None and known[0] is batch:
            return known[1], known[2], known[3]
        ids = _joined([ids for _g, _m, ids, _o in batch])
        offs = _joined([offs for _g, _m, _i, offs in batch])
        key = tuple((m.group, i.size, slot_reach(g.object_bytes, m)) for g, m, i, _o in batch)
        return self.shapes.get(key), ids, offs


_SIGN_OR_MISALIGNED = np.int64(-(1 << 63) | 7)


def _check_single_writes(
    out: list, shape: BatchShape, ids: np.ndarray, classes: dict | None, notes: dict[int, str]
) -> None:
    """A load may write each block of a group once (two writers of one page race), and each block of
    groups that share memory once across them. classes: group -> alias class (see alias_classes), None
    where no two groups share one. The first Moves in batch order whose class repeats a block is named."""
    if classes is None and shape.distinct_groups:  # a restore: only a Moves' own ids can repeat
        for _geom, m, part, _o in out:
            if part.size > 1 and _has_repeats(part):
                raise ValueError(f"umbp: a load writes block ids of group {m.group} twice{notes[m.group]}")
        return
    groups = [m.group for _g, m, _i, _o in out]
    cls = groups if classes is None else [classes[g] for g in groups]
    # (class, block) as one key: the class's index times the largest block count, plus the block
    index = {c: i for i, c in enumerate(dict.fromkeys(cls))}
    keys = np.repeat(np.array([index[c] for c in cls], np.int64), shape.counts) * int(shape.limit.max()) + ids
    if _has_repeats(keys):
        for c in index:
            mine = [part for k, (_geom, _m, part, _o) in enumerate(out) if cls[k] == c]
            if _has_repeats(_joined(mine)):
                g = groups[cls.index(c)]
                raise ValueError(f"umbp: a load writes block ids of group {g} twice{notes[g]}")


def alias_classes(groups: Mapping[int, GroupGeometry]) -> dict[int, int]:
    """Per group a dense class index (from 0, in group order), one class for groups whose layers' memory
    intersects: in vLLM's hybrid layout one buffer per layer slot is viewed by a layer of each group, so
    block b of each of them is one page. Layer spans sorted by start merge into runs of overlapping
    spans (an interval graph's connected components); the groups of a run are one class."""
    parent = {g: g for g in groups}

    def root(g: int) -> int:
        while parent[g] != g:
            g = parent[g]
        return g

    spans = sorted((*layer.span(), g) for g, geom in groups.items() for layer in geom.layers)
    end, owner = None, None
    for lo, hi, g in spans:
        if hi <= lo:
            continue
        if end is not None and lo < end:
            parent[root(g)] = root(owner)
            end = max(end, hi)
        else:
            end, owner = hi, g
    index: dict[int, int] = {}
    return {g: index.setdefault(root(g), len(index)) for g in groups}


def _alias_notes(classes: dict[int, int]) -> dict[int, str]:
    """What the duplicate-write error adds for a group sharing memory with others ("" for the rest)."""
    members: dict[int, list] = {}
    for g, c in classes.items():
        members.setdefault(c, []).append(g)
    return {
        g: ""
        if len(members[c]) == 1
        else f" (groups {', '.join(map(str, members[c]))} share their KV memory: block b is one page in each)"
        for g, c in classes.items()
    }


_U64 = 1 << 64
_BAD_DIGEST = "umbp: a digest must be an integer in [0, 2**64) (a psum64 from save), got {!r} for group {}"


def _valid_digests(m: Moves, n: int) -> list[int] | None:
    """A load's expected digests checked before anything is written (a bad one used to raise after
    earlier objects were written, or read as a quiet miss): None when m.digests is None or a list or
    tuple of ints in [0, 2**64), used as it is; else its values converted to ints. As in _checks.c."""
    d = m.digests
    if d is None:
        return None
    exact = type(d) in (list, tuple)
    if (
        exact
        and len(d) == n
        and all(type(v) is int for v in d)
        and (not n or (min(d) >= 0 and max(d) < _U64))
    ):
        return None  # the usual case, in C loops (no code of the caller's runs between these reads)
    seq = d if exact else list(d)
    out = None if exact else []
    for j in range(n):
        if len(seq) != n:  # an item's __index__ changed the list
            raise ValueError(
                "umbp: block_ids, offsets (and digests) of a Moves must have one entry per object"
            )
        item = seq[j]
        if type(item) is int:
            v = item
        else:
            if out is None:
                out = list(seq[:j])
            try:
                v = operator.index(item)
            except (TypeError, OverflowError):
                raise ValueError(_BAD_DIGEST.format(item, m.group)) from None
        if not 0 <= v < _U64:
            raise ValueError(_BAD_DIGEST.format(item, m.group))
        if out is not None:
            out.append(v)
    return out


def _with_digests(item: tuple, values: list[int]) -> tuple:
    """A checked batch entry whose Moves carries the checked digests."""
    geom, m, ids, offs = item
    return geom, Moves(m.group, m.block_ids, m.offsets, values, m.slot_bytes), ids, offs


def _count(values: Sequence[int] | np.ndarray) -> int:
    return len(values) if isinstance(values, (list, tuple)) else int(np.size(values))


def _flat_int64(parts: list, total: int) -> np.ndarray:
    """The Moves' id (or offset) sequences joined into one int64 array: one np.fromiter over all of them
    when they are lists (what the connector passes; one call instead of one per Moves), else each
    converted and joined. Integers only, as in the C twin: np.fromiter alone would truncate 1.5 to 1 and
    read "3" as 3."""
    if all(isinstance(p, (list, tuple)) for p in parts):
        return np.fromiter(map(operator.index, itertools.chain.from_iterable(parts)), np.int64, total)
    return _joined([_int64(p) for p in parts])


def _int64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """A flat int64 array of integers (see _flat_int64)."""
    if isinstance(values, (list, tuple)):
        return np.fromiter(map(operator.index, values), np.int64, len(values))
    a = np.asarray(values)
    if a.size and a.dtype.kind not in "iub":
        raise TypeError(f"umbp: block ids and arena offsets must be integers, got {a.dtype} values")
    return a.astype(np.int64, copy=False).reshape(-1)


def slot_reach(object_bytes: int, moves: Moves) -> int:
    """Bytes of the arena one slot of these moves spans (see Moves.slot_bytes)."""
    return object_bytes if moves.slot_bytes is None else max(object_bytes, int(moves.slot_bytes))


def _has_repeats(ids: np.ndarray) -> bool:
    """Sort and compare neighbours: ~10x cheaper than np.unique for the thousands of ids of one load."""
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def check_disjoint(starts: list[np.ndarray], reaches: list[int]) -> None:
    """Slots written by one save must not overlap (two writers of one byte race); loads may share them.
    starts[i]: the offsets of one Moves, whose slots each span reaches[i] bytes. When every slot spans
    the same bytes (one group, the usual batch) sorted starts must lie a reach apart: one sort instead of
    the argsort and two gathers that mixed reaches need (4,096 objects on an H200 host: 0.04 vs 0.38 ms,
    about half of a call's validation before its copy can start; archive/2026-12-03-transfer-zero-copy-host-time-30.txt).
    The offsets must already lie inside the arena (offset <= capacity - reach, as _checked_py checks first):
    then offset + reach cannot wrap in int64."""
    s = _joined(starts)
    if s.size < 2:
        return
    if len(set(reaches)) == 1:
        s = np.sort(s)
        overlap = bool((s[1:] - s[:-1] < reaches[0]).any())
    else:
        e = np.concatenate([o + r for o, r in zip(starts, reaches, strict=True)])
        order = np.argsort(s, kind="stable")
        overlap = bool(np.any(s[order][1:] < e[order][:-1]))
    if overlap:
        raise ValueError("umbp: a save batch writes overlapping arena slots")


def digest_mix(nbytes: int) -> int:
    """The length term psum64 xors in (see umbp.pool.checksum), as a signed int64 for device tensors."""
    from umbp.pool.checksum import GOLDEN as _GOLDEN

    v = (nbytes * _GOLDEN) & ((1 << 64) - 1)
    return v - (1 << 64) if v >= 1 << 63 else v
