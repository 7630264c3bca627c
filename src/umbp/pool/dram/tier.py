"""DramPool: DramIndex + Arena + a psum64 per object, in one process, thread-safe.

Concurrency: one lock guards the metadata only; copies run outside it, protected by a reservation (put)
or a read pin (get), so readers and writers of different objects copy in parallel and numpy releases the
GIL for the large copies. Bad input is rejected before anything is reserved or copied.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np

from umbp.pool.base import Pool
from umbp.pool.buffers import prepare_buffers
from umbp.pool.checksum import copy_many
from umbp.pool.dram.arena import Arena
from umbp.pool.dram.index import COMMITTED, PENDING, DramIndex, Slot, too_large_error
from umbp.pool.errors import BufferSizeError, CapacityError, UmbpError
from umbp.pool.keycheck import check_keys
from umbp.pool.options import Options, auto_or_bool, option, option_set

GiB = 1 << 30
PiB = 1 << 50


@option_set
class DramOptions(Options):
    """The DRAM pool's options (`DramPool.from_options`); docs/pool.md's table is generated from these."""

    where: ClassVar[str] = "DRAM pool option"

    capacity_bytes: int = option(
        help="arena size in bytes; give this or `dram_gb`",
        minimum=1,
        maximum=PiB,
        gib_alias="dram_gb",
        error=CapacityError,
    )
    high_watermark: float = option(
        0.95,
        help="a put that would lift usage above this fraction of the arena "
        "first evicts least-recently-used objects ...",
        above=0,
        maximum=1,
    )
    low_watermark: float = option(
        0.85, help="... down to this fraction (at most `high_watermark`)", above=0, maximum=1
    )
    pinned: bool | str = option(
        "auto",
        help="`auto`: page-locked (`torch.empty(pin_memory=True)`) when torch "
        "with a GPU is present, else plain memory; `true`: page-locked or a clear error; "
        "`false`: never",
        convert=auto_or_bool,
        type_doc="`auto`, `true` or `false`",
    )
    alignment: int = option(
        4096,
        help="slot alignment = allocation page in bytes, a power of two; every object takes at least one "
        "page (an empty one too, so that empty objects are evicted like any other and cannot grow the index "
        "past the arena)",
        minimum=8,
        maximum=1 << 30,
    )
    prefault: bool = option(
        True,
        help="touch every arena page at start-up (no page faults in the hot path; a "
        "too-large arena fails at once)",
    )
    copy_threads: int = option(
        1,
        help="threads that copy + checksum one put/get batch; 1 = only the calling "
        "thread. More help only batches of large objects (>= 1 MiB in all, >= 128 KiB "
        "per object on average)",
        minimum=1,
        maximum=256,
    )

    def check(self) -> None:
        if self.alignment & (self.alignment - 1):
            raise self.error(
                "alignment", self.alignment, "a power of two >= 8 (the default 4096 suits KV pages)"
            )
        if self.low_watermark > self.high_watermark:
            raise self.fail(
                f"DRAM pool option 'low_watermark' ({self.low_watermark}) must not exceed "
                f"'high_watermark' ({self.high_watermark})"
            )
        if self.capacity_bytes < self.alignment:
            raise CapacityError(
                f"umbp: DRAM pool option 'capacity_bytes' ({self.capacity_bytes}) is smaller "
                f"than one {self.alignment}-byte page; raise capacity_bytes (dram_gb)"
            )


OPTIONS: dict[str, str] = DramOptions.option_help()  # name -> help, for callers that list the options


class DramPool(Pool):
    """The DRAM tier. See docs/pool.md for options, errors and the benchmark."""

    demotes_evictions = True  # DramIndex.on_evict sees each evicted object's slot before reuse

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
        opts = DramOptions(
            capacity_bytes=capacity_bytes,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            pinned=pinned,
            alignment=alignment,
            prefault=prefault,
            copy_threads=copy_threads,
        )
        capacity_bytes, high_watermark, low_watermark = (
            opts.capacity_bytes,
            opts.high_watermark,
            opts.low_watermark,
        )
        pinned, alignment, prefault, copy_threads = (
            opts.pinned,
            opts.alignment,
            opts.prefault,
            opts.copy_threads,
        )
        self._index = DramIndex(capacity_bytes, high_watermark, low_watermark, alignment, track_evicted=False)
        self._arena: Arena | None = Arena(self._index.capacity_bytes, pinned, prefault=prefault)
        self._lock = threading.Lock()
        self._closing = False
        self._copy_threads = copy_threads
        self._executor = (
            ThreadPoolExecutor(copy_threads - 1, thread_name_prefix="umbp-copy") if copy_threads > 1 else None
        )
        self._counters = dict.fromkeys(
            (
                "hits",
                "misses",
                "puts",
                "put_duplicates",
                "put_failures",
                "checksum_failures",
                "bytes_written",
                "bytes_read",
            ),
            0,
        )

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> DramPool:
        """Build from a config mapping (DramOptions: unknown keys are named, every value is checked)."""
        return cls.from_config(DramOptions.from_options(options))

    @classmethod
    def from_config(cls, opts: DramOptions) -> DramPool:
        return cls(
            opts.capacity_bytes,
            opts.high_watermark,
            opts.low_watermark,
            opts.pinned,
            alignment=opts.alignment,
            prefault=opts.prefault,
            copy_threads=opts.copy_threads,
        )

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

    @property
    def max_object_bytes(self) -> int:
        return self._index.capacity_bytes

    # ---- Pool API ------------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        check_keys("exists", keys)
        with self._lock:
            return self._index.lookup(keys)

    def put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Reserve the whole batch under one lock, copy outside it, commit under one lock. Reserving first
        also means a batch never evicts its own earlier objects."""
        check_keys("put", keys)
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
            digests = self._copy_many(pairs, True)
        except BaseException:
            with self._lock:
                for key, slot in zip(keys, slots, strict=True):
                    if slot is not None:
                        self._index.abort(key)
            raise
        with self._lock:
            self._commit_batch(keys, slots, digests, results)
        return results

    def _reserve_batch(
        self, keys: Sequence[str], srcs: list[np.ndarray]
    ) -> tuple[list[bool], list[Slot | None]]:
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

    def _commit_batch(
        self, keys: Sequence[str], slots: list[Slot | None], digests: list[int], results: list[bool]
    ) -> None:
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
        check_keys("get_into", keys)
        dsts = prepare_buffers("get_into", keys, buffers, writable=True)
        arena_u8 = self.arena.view(0, self._index.capacity_bytes)
        with self._lock:
            slots = self._index.pin(keys)
        pinned = [k for k, s in zip(keys, slots, strict=True) if s is not None]
        try:
            self._check_sizes(keys, slots, dsts)
            hits = [(s, d) for s, d in zip(slots, dsts, strict=True) if s is not None]
            pairs = [(arena_u8[s.offset : s.offset + s.nbytes], d) for s, d in hits]
            digests = iter(self._copy_many(pairs, False))
            results = [s is not None and next(digests) == s.checksum for s in slots]
        except BaseException:
            with self._lock:
                self._index.unpin(pinned)
            raise
        with self._lock:
            self._index.unpin(pinned)
            self._account_get(keys, slots, results)
        return results

    def _copy_many(self, pairs: list[tuple[np.ndarray, np.ndarray]], to_region: bool) -> list[int]:
        try:
            return copy_many(pairs, to_region, self._executor, self._copy_threads)
        except RuntimeError:  # close() shut the copy threads down under this call
            if self._closing:
                raise UmbpError("umbp: this DramPool is closed") from None
            raise

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
        check_keys("remove", keys)
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
        self._closing = True  # a copy that then finds its threads shut down reports the pool closed
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        with self._lock:
            self._index.clear()
            self._arena = None
