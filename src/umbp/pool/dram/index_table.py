"""PyIndexTable: the pure-Python twin of the C `IndexTable` (umbp.pool._native) behind DramIndex.

Why a twin: the C table is what makes the index compact (no Python object per stored object), but umbp
must run where no C compiler built the extension (UMBP_NATIVE=0 or a missing build). This class gives the
same answers through dicts, at the old per-object cost; the tests run DramIndex over both tables and
compare them with the reference `DictIndex` on random operation sequences.

The table knows keys, rows, pins, states and the LRU order; page allocation is the caller's (DramIndex).
Operations that free pages return the (start, npages) runs for the caller to give back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

FREE, PENDING, COMMITTED, PENDING_DOOMED, DOOMED = range(5)
_ROW_NAMES = {PENDING: "reserved", COMMITTED: "committed", PENDING_DOOMED: "reserved", DOOMED: "doomed"}


@dataclass(slots=True)
class _Row:
    start: int
    npages: int
    nbytes: int
    state: int = PENDING
    pins: int = 0
    checksum: int | None = None


class PyIndexTable:
    """Same methods and results as the C IndexTable; see its comment block in _native_c/index_table.c."""

    def __init__(self, seed: bytes, alignment: int, slot_type: type, keep_keys: bool) -> None:
        self._seed = bytes(seed)
        self._align = alignment
        self._slot = slot_type
        self._keep = keep_keys
        self._rows: dict[str, _Row] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()
        self.live = self.reserved = self.pinned = self.deferred = 0
        self.lru_pages = self.live_bytes = 0

    def _key_out(self, key: str) -> str | bytes:
        if self._keep:
            return key
        return hashlib.blake2b(key.encode(), digest_size=16, key=self._seed).digest()

    def _slot_of(self, row: _Row) -> Any:
        return self._slot(row.start * self._align, row.nbytes, row.checksum)

    def _lru_drop(self, key: str, row: _Row) -> None:
        del self._lru[key]
        self.lru_pages -= row.npages

    def _lru_push(self, key: str, row: _Row) -> None:
        self._lru[key] = None
        self.lru_pages += row.npages

    def _check(self, key: Any) -> None:
        if not isinstance(key, str):
            raise TypeError(f"umbp: index keys are str, got {type(key).__name__}")
        if not key.isascii():
            key.encode()  # as the C table, which hashes UTF-8: a lone surrogate raises UnicodeEncodeError

    def _checked(self, keys: Iterable[Any]) -> list[str]:
        """Every key checked before a method changes anything (as the C table): a bad key found half-way
        would leave the keys before it pinned, or their pages in no row and never handed back."""
        keys = list(keys)
        for k in keys:
            self._check(k)
        return keys

    def state(self, key: str) -> int:
        self._check(key)
        row = self._rows.get(key)
        if row is None:
            return 0
        return {PENDING: 1, COMMITTED: 2}.get(row.state, 3)

    def add(self, key: str, start: int, npages: int, nbytes: int) -> Any:
        self._check(key)
        if key in self._rows:
            raise KeyError("umbp: IndexTable.add of a key already present")
        row = self._rows[key] = _Row(start, npages, nbytes)
        self.reserved += 1
        return self._slot_of(row)

    def commit(self, key: str, checksum: int | None) -> int:
        self._check(key)
        row = self._rows.get(key)
        if row is None or row.state not in (PENDING, PENDING_DOOMED):
            return -1
        if checksum is not None:
            if not 0 <= checksum < 1 << 64:
                raise OverflowError(f"umbp: checksum {checksum} is not a uint64")
            row.checksum = checksum
        if row.state == PENDING_DOOMED:  # removed meanwhile: nothing changed, the caller aborts it
            return 0
        self.reserved -= 1
        row.state = COMMITTED
        self._lru_push(key, row)
        self.live += 1
        self.live_bytes += row.nbytes
        return 1

    def abort(self, key: str) -> tuple[int, int] | None:
        self._check(key)
        row = self._rows.get(key)
        if row is None or row.state not in (PENDING, PENDING_DOOMED):
            return None
        self.reserved -= 1
        if row.state == PENDING_DOOMED:
            self.deferred -= 1
        del self._rows[key]
        return (row.start, row.npages)

    def lookup(self, keys: Sequence[str], touch: bool) -> list[bool]:
        out = []
        for k in keys:
            self._check(k)
            row = self._rows.get(k)
            hit = row is not None and row.state == COMMITTED
            if hit and touch and row.pins == 0:
                self._lru.move_to_end(k)
            out.append(hit)
        return out

    def contains(self, key: object) -> bool:
        row = self._rows.get(key) if isinstance(key, str) else None
        return row is not None and row.state == COMMITTED

    def slot_of(self, key: str) -> Any:
        self._check(key)
        row = self._rows.get(key)
        return self._slot_of(row) if row is not None and row.state == COMMITTED else None

    def pin(self, keys: Sequence[str]) -> list[Any]:
        out = []
        for k in self._checked(keys):
            row = self._rows.get(k)
            if row is None or row.state != COMMITTED:
                out.append(None)
                continue
            if row.pins == 0:
                self._lru_drop(k, row)
                self.pinned += 1
            row.pins += 1
            out.append(self._slot_of(row))
        return out

    def unpin(self, keys: Iterable[str]) -> tuple[list[tuple[int, int]], str | None]:
        freed: list[tuple[int, int]] = []
        for k in self._checked(keys):
            row = self._rows.get(k)
            if row is None or row.state not in (COMMITTED, DOOMED) or row.pins == 0:
                return freed, k
            row.pins -= 1
            if row.pins:
                continue
            self.pinned -= 1
            if row.state == COMMITTED:
                self._lru_push(k, row)  # a read is a use: most recently used
            else:
                self.deferred -= 1
                del self._rows[k]
                freed.append((row.start, row.npages))
        return freed, None

    def _remove_row(self, key: str, row: _Row, freed: list[tuple[int, int]]) -> int:
        if row.state == PENDING:
            row.state = PENDING_DOOMED
            self.deferred += 1
            return 0
        if row.state != COMMITTED:
            return 0
        self.live -= 1
        self.live_bytes -= row.nbytes
        if row.pins:
            row.state = DOOMED
            self.deferred += 1
            return 1
        self._lru_drop(key, row)
        del self._rows[key]
        freed.append((row.start, row.npages))
        return 1

    def remove(self, keys: Iterable[str]) -> tuple[int, list[tuple[int, int]]]:
        freed: list[tuple[int, int]] = []
        removed = 0
        for k in self._checked(keys):
            row = self._rows.get(k)
            if row is not None:
                removed += self._remove_row(k, row, freed)
        return removed, freed

    def clear(self) -> tuple[int, list[tuple[int, int]]]:
        freed: list[tuple[int, int]] = []
        removed = sum(self._remove_row(k, row, freed) for k, row in list(self._rows.items()))
        return removed, sorted(freed)  # page order, as the C table

    def evict(self) -> tuple[Any, Any, int, int] | None:
        if not self._lru:
            return None
        key = next(iter(self._lru))
        row = self._rows.pop(key)
        self._lru_drop(key, row)
        self.live -= 1
        self.live_bytes -= row.nbytes
        return self._key_out(key), self._slot_of(row), row.start, row.npages

    def rows(self) -> list[tuple[Any, int, int, str]]:
        return [(self._key_out(k), r.start, r.npages, _ROW_NAMES[r.state]) for k, r in self._rows.items()]

    def presize(self, rows: int) -> None:
        """Nothing to do: a dict cannot be presized (it still pauses to resize at millions of keys; the
        C table is the one meant for that scale)."""

    def counters(self) -> tuple[int, int, int, int, int, int, int]:
        return (self.live, self.reserved, self.pinned, self.deferred, self.lru_pages, self.live_bytes, 0)

    def __len__(self) -> int:
        return self.live
