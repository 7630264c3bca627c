"""DramPool: DramIndex + Arena + a psum64 per object, in one process, thread-safe.

Concurrency: one lock guards the metadata only; copies run outside it, protected by a reservation (put)
or a read pin (get), so readers and writers of different objects copy in parallel and numpy releases the
GIL for the large copies. Bad input is rejected before anything is reserved or copied.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from umbp.pool.arena import Arena
from umbp.pool.base import Pool
from umbp.pool.buffers import prepare_buffers
from umbp.pool.errors import BufferSizeError, CapacityError, OptionValueError, UmbpError, UnknownOptionError
from umbp.pool.index import COMMITTED, PENDING, DramIndex, Slot, too_large_error
from umbp.pool.psum import copy_many

GiB = 1 << 30

OPTIONS: dict[str, str] = {
    "capacity_bytes": "arena size in bytes (int); give this or dram_gb",
    "dram_gb": "arena size in GiB (number); give this or capacity_bytes",
    "high_watermark": "fraction of capacity that triggers LRU eviction (default 0.95)",
    "low_watermark": "fraction eviction brings usage down to (default 0.85)",
    "pinned": "'auto' (page-locked when torch+CUDA are present), true or false",
    "alignment": "slot alignment / allocation page in bytes, a power of two >= 8 (default 4096)",
    "prefault": "touch every arena page at start-up (default true)",
    "copy_threads": "threads that copy + checksum one put/get batch (default 1: the calling thread only)",
}


def _capacity_from_options(opts: Mapping[str, Any]) -> int:
    if "capacity_bytes" in opts and "dram_gb" in opts:
        raise OptionValueError("umbp: give capacity_bytes or dram_gb, not both")
    if "capacity_bytes" in opts:
        return opts["capacity_bytes"]
    if "dram_gb" not in opts:
        raise CapacityError("umbp: the DRAM pool needs a size; set dram_gb (GiB) or capacity_bytes")
    gb = opts["dram_gb"]
    if isinstance(gb, bool) or not isinstance(gb, int | float | str):
        raise OptionValueError(f"umbp: dram_gb must be a number of GiB, got {gb!r}; e.g. dram_gb=8")
    try:
        return int(float(gb) * GiB)
    except ValueError:
        raise OptionValueError(f"umbp: dram_gb must be a number of GiB, got {gb!r}; e.g. dram_gb=8") from None


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return text in ("true", "1", "yes", "on")
    raise OptionValueError(f"umbp: {name} must be true or false, got {value!r}")


class DramPool(Pool):
    """The DRAM tier. See docs/pool.md for options, errors and the benchmark."""

    def __init__(
        self,
        capacity_bytes: int,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        pinned: bool | str = "auto",
        *,
        alignment: int = 4096,
        prefault: bool = True,
        copy_threads: int = 1,
    ) -> None:
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) or copy_threads < 1:
            raise OptionValueError(
                f"umbp: copy_threads must be an int >= 1, got {copy_threads!r}; 1 copies on the calling thread"
            )
        self._index = DramIndex(capacity_bytes, high_watermark, low_watermark, alignment, track_evicted=False)
        self._arena: Arena | None = Arena(self._index.capacity_bytes, pinned, prefault=prefault)
        self._lock = threading.Lock()
        self._copy_threads = copy_threads
        self._executor = (
            ThreadPoolExecutor(copy_threads - 1, thread_name_prefix="umbp-copy") if copy_threads > 1 else None
        )
        self._counters = dict.fromkeys(
            ("hits", "misses", "puts", "put_duplicates", "put_failures", "checksum_failures",
             "bytes_written", "bytes_read"),
            0,
        )

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> DramPool:
        """Build from a config mapping; unknown keys are rejected by name (typos must not be ignored)."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            hints = [m for k in unknown for m in difflib.get_close_matches(k, OPTIONS, n=1)]
            hint = f" (did you mean {', '.join(repr(h) for h in hints)}?)" if hints else ""
            raise UnknownOptionError(
                f"umbp: unknown DRAM pool option(s) {', '.join(repr(k) for k in unknown)}{hint}; "
                f"valid options: {', '.join(OPTIONS)}"
            )
        names = ("high_watermark", "low_watermark", "pinned", "alignment", "copy_threads")
        kwargs = {k: options[k] for k in names if k in options}
        if "prefault" in options:
            kwargs["prefault"] = _parse_bool("prefault", options["prefault"])
        return cls(_capacity_from_options(options), **kwargs)

    # ---- properties ----------------------------------------------------------------------------------

    @property
    def index(self) -> DramIndex:
        return self._index

    @property
    def arena(self) -> Arena:
        if self._arena is None:
            raise UmbpError("umbp: this DramPool is closed")
        return self._arena

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    # ---- Pool API ------------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return self._index.lookup(keys)

    def put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Reserve the whole batch under one lock, copy outside it, commit under one lock. Reserving first
        also means a batch never evicts its own earlier objects."""
        srcs = prepare_buffers("put", keys, buffers, writable=False)
        cap = self._index.capacity_bytes
        for key, src in zip(keys, srcs, strict=True):
            if src.size > cap:
                raise too_large_error(key, src.size, cap)
        arena_u8 = self.arena.view(0, cap)
        results, slots = self._reserve_batch(keys, srcs)
        pairs = [
            (arena_u8[slot.offset : slot.offset + slot.nbytes], src)
            for slot, src in zip(slots, srcs, strict=True)
            if slot is not None
        ]
        try:
            digests = copy_many(pairs, True, self._executor, self._copy_threads)
        except BaseException:
            with self._lock:
                for key, slot in zip(keys, slots, strict=True):
                    if slot is not None:
                        self._index.abort(key)
            raise
        with self._lock:
            self._commit_batch(keys, slots, digests, results)
        return results

    def _reserve_batch(self, keys: Sequence[str], srcs: list[np.ndarray]) -> tuple[list[bool], list[Slot | None]]:
        counters, index = self._counters, self._index
        results: list[bool] = []
        slots: list[Slot | None] = []
        with self._lock, index.batched_evictions():  # a burst of victims goes down a tier in one call
            for key, src in zip(keys, srcs, strict=True):
                slot = None
                if index.state(key) in (COMMITTED, PENDING):  # duplicate put: a no-op
                    counters["put_duplicates"] += 1
                    ok = True
                else:
                    slot = index.reserve(key, src.size)
                    ok = slot is not None
                    if not ok:
                        counters["put_failures"] += 1
                results.append(ok)
                slots.append(slot)
        return results, slots

    def _commit_batch(self, keys: Sequence[str], slots: list[Slot | None], digests: list[int],
                      results: list[bool]) -> None:
        counters, index = self._counters, self._index
        it = iter(digests)
        for i, (key, slot) in enumerate(zip(keys, slots, strict=True)):
            if slot is None:
                continue
            if index.commit(key, next(it)):
                counters["puts"] += 1
                counters["bytes_written"] += slot.nbytes
            else:  # removed or cleared while we copied
                counters["put_failures"] += 1
                results[i] = False

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        dsts = prepare_buffers("get_into", keys, buffers, writable=True)
        arena_u8 = self.arena.view(0, self._index.capacity_bytes)
        with self._lock:
            slots = self._index.pin(keys)
        pinned = [k for k, s in zip(keys, slots, strict=True) if s is not None]
        try:
            self._check_sizes(keys, slots, dsts)
            hits = [(s, d) for s, d in zip(slots, dsts, strict=True) if s is not None]
            pairs = [(arena_u8[s.offset : s.offset + s.nbytes], d) for s, d in hits]
            digests = iter(copy_many(pairs, False, self._executor, self._copy_threads))
            results = [s is not None and next(digests) == s.checksum for s in slots]
        except BaseException:
            with self._lock:
                self._index.unpin(pinned)
            raise
        with self._lock:
            self._index.unpin(pinned)
            self._account_get(keys, slots, results)
        return results

    def _account_get(self, keys: Sequence[str], slots: list[Slot | None], results: list[bool]) -> None:
        """Counters, and drop objects that failed their checksum so they never serve bad data."""
        corrupt = [k for k, s, ok in zip(keys, slots, results, strict=True) if s is not None and not ok]
        if corrupt:
            self._index.remove(corrupt)
        counters = self._counters
        hits = sum(results)
        counters["hits"] += hits
        counters["misses"] += len(results) - hits
        counters["checksum_failures"] += len(corrupt)
        counters["bytes_read"] += sum(s.nbytes for s, ok in zip(slots, results, strict=True) if ok and s)

    @staticmethod
    def _check_sizes(keys: Sequence[str], slots: list[Slot | None], dsts: list[np.ndarray]) -> None:
        for key, slot, dst in zip(keys, slots, dsts, strict=True):
            if slot is not None and dst.size != slot.nbytes:
                raise BufferSizeError(
                    f"umbp: get_into buffer for key '{key}' is {dst.size} bytes but the stored object is "
                    f"{slot.nbytes} bytes; pass a buffer of exactly {slot.nbytes} bytes"
                )

    def remove(self, keys: Sequence[str]) -> int:
        with self._lock:
            return self._index.remove(keys)

    def clear(self) -> None:
        with self._lock:
            self._index.clear()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = self._index.stats()
            out.update(self._counters)
        lookups = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / lookups if lookups else 0.0
        arena = self._arena
        out["arena_backend"] = arena.backend if arena is not None else "closed"
        out["pinned_memory"] = bool(arena is not None and arena.pinned)
        return out

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        with self._lock:
            self._index.clear()
            self._arena = None
