"""The engine-agnostic pool interface every tier implements (DRAM now; SSD, Redis/Valkey later)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class Pool(ABC):
    """Batched key -> bytes store. Keys are str; buffers are anything with contiguous CPU memory
    (bytes/bytearray/memoryview, numpy arrays, CPU torch tensors)."""

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
