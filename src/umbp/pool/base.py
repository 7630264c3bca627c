"""The engine-agnostic pool interface every tier implements (DRAM, SSD, Redis/Valkey).

Besides the batched calls, each tier declares what it can do (capabilities). A composition of tiers
(umbp.pool.composition.TierStack, used by TieredPool and by the vLLM connector's worker) reads these
instead of asking which concrete class a tier is, so a new tier joins a stack by declaring them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar


class Pool(ABC):
    """Batched key -> bytes store. Keys are str; buffers are anything with contiguous CPU memory
    (bytes/bytearray/memoryview, numpy arrays, CPU torch tensors)."""

    # ---- capabilities ------------------------------------------------------------------------------
    persistent: ClassVar[bool] = False
    """Its objects outlive the process: a restart on the same storage serves them (the SSD tier)."""
    shared: ClassVar[bool] = False
    """Other processes and hosts see its objects (the Redis/Valkey tier)."""
    demotes_evictions: ClassVar[bool] = False
    """It can hand the objects it evicts, bytes intact, to a lower tier (DramPool, see TieredPool)."""
    async_writes: ClassVar[bool] = False
    """`write_behind` returns after a checked copy into a queue; a writer thread does the network I/O
    (the Redis tier). Without it, `write_behind` may still be fast (the SSD tier stages and returns)."""

    @property
    def max_object_bytes(self) -> int | None:
        """The largest object it can ever hold (None: no fixed bound)."""
        return None

    @property
    def max_key_bytes(self) -> int | None:
        """The longest key (UTF-8 bytes) it can store (None: no fixed bound). A stack refuses longer keys
        at put, so that no key is taken by one tier and refused by the next during an eviction."""
        return None

    @property
    def intake_bytes(self) -> int | None:
        """What it takes in one call before its writer drains any (None: not bounded that way). A stack
        sizes the bursts it hands down below this, so a burst is not dropped for want of queue room."""
        return None

    def write_behind(
        self, keys: Sequence[str], buffers: Sequence[Any], checksums: Sequence[int] | None = None
    ) -> list[bool]:
        """Store objects handed down by another tier or a save, without waiting for slow I/O where the
        tier can. `checksums[i]`, when given and the tier verifies them, is the psum64 the bytes must
        have: a copy that no longer matches is dropped (False), never stored. The default is `put`
        (which does not verify them)."""
        return self.put(keys, buffers)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued writes are stored; False if `timeout` ran out first. No queue: True."""
        return True

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (committed). Does not change recency."""

    @abstractmethod
    def put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Store each buffer under its key. True: stored, or already present/being stored (a duplicate put
        is a no-op). False: could not be stored now (e.g. everything else is pinned)."""

    @abstractmethod
    def get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Copy each object into the caller's buffer (exactly its size). True: the exact stored bytes were
        copied. False: a miss (absent, or it failed its checksum); the buffer's content is then undefined."""

    @abstractmethod
    def remove(self, keys: Sequence[str]) -> int:
        """Drop keys; returns how many were present."""

    @abstractmethod
    def clear(self) -> None:
        """Drop everything."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and sizes (hits, misses, puts, evictions, checksum_failures, used/capacity bytes, ...)."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for tiers without resources
        """Release resources (the DRAM arena). The pool must not be used afterwards."""

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
