"""Arena: the bytes half of the DRAM tier: one preallocated buffer plus checksummed copies in and out.

Why one buffer: no per-object allocation on the hot path, stable offsets that another process's index can
hand out, and (with CUDA) a single page-locked region that GPU copies can DMA from directly.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import Any

import numpy as np

from umbp.pool.buffers import as_u8
from umbp.pool.checksum import checksum_u8, copy_with_checksum
from umbp.pool.dram.index import check_capacity
from umbp.pool.errors import BufferSizeError, OptionValueError, PinnedMemoryError, human_bytes

_ROUND = 4096  # the buffer is allocated in whole pages


def _gpu_device_nodes() -> bool:
    """Cheap hint that a GPU driver is present, so 'auto' does not import torch (seconds) on CPU hosts."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


def cuda_available(import_if_needed: bool) -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        if importlib.util.find_spec("torch") is None:
            return False
        if not import_if_needed and not _gpu_device_nodes():
            return False
        import torch
    return bool(torch.cuda.is_available())


def parse_pinned(pinned: Any) -> bool | str:
    """'auto' | True | False; config strings 'true'/'false'/'auto' are accepted too (the options layer's one
    spelling of a boolean: never 1/0)."""
    if isinstance(pinned, str):
        low = pinned.strip().lower()
        table: dict[str, bool | str] = {"auto": "auto", "true": True, "false": False}
        if low in table:
            return table[low]
    elif isinstance(pinned, bool):
        return pinned
    raise OptionValueError(f"umbp: pinned must be 'auto', True or False, got {pinned!r}")


class Arena:
    """One preallocated byte buffer of `capacity_bytes`.

    pinned='auto': page-locked (torch.empty(pin_memory=True)) when torch with CUDA is available, else a
    plain numpy buffer. pinned=True without CUDA raises PinnedMemoryError. prefault=True touches every
    page up front so the first puts do not pay page faults (and a too-large arena fails at start-up).
    """

    def __init__(self, capacity_bytes: int, pinned: bool | str = "auto", *, prefault: bool = True) -> None:
        check_capacity(capacity_bytes, 8)
        pinned = parse_pinned(pinned)
        self.capacity_bytes = capacity_bytes
        size = -(-capacity_bytes // _ROUND) * _ROUND
        self._tensor: Any = None
        want_pinned = pinned is True or (pinned == "auto" and cuda_available(import_if_needed=False))
        if pinned is True and not cuda_available(import_if_needed=True):
            raise PinnedMemoryError(
                "umbp: pinned=True needs torch with a CUDA (or ROCm) device, and none is available here; "
                "use pinned='auto' (page-locked when a GPU is present) or pinned=False"
            )
        if want_pinned:
            self._tensor = self._pinned_tensor(size, required=pinned is True)
        if self._tensor is not None:
            self._u8 = self._tensor.numpy()
            self.backend = "torch-pinned"
        else:
            self._u8 = np.empty(size, dtype=np.uint8)
            if prefault:
                self._u8.fill(0)
            self.backend = "numpy"
        self.pinned = self._tensor is not None

    @staticmethod
    def _pinned_tensor(size: int, required: bool) -> Any:
        import torch

        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            if required:
                raise PinnedMemoryError(
                    f"umbp: could not page-lock {human_bytes(size)} ({exc}); lower capacity_bytes (dram_gb), "
                    "raise the memlock limit, or use pinned='auto'/False"
                ) from exc
            warnings.warn(f"umbp: page-locked arena unavailable ({exc}); using pageable memory", stacklevel=3)
            return None

    def _region(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity_bytes or offset % 8:
            raise BufferSizeError(
                f"umbp: arena range [{offset}, {offset + nbytes}) is outside the {self.capacity_bytes}-byte "
                "arena or not 8-byte aligned; use offsets from DramIndex.reserve()/pin()"
            )
        return self._u8[offset : offset + nbytes]

    def write(self, offset: int, src: Any, key: str = "?") -> int:
        """Copy src into the arena at offset; returns the psum64 of the bytes now stored."""
        data = as_u8(src, key=key, what="source buffer", writable=False)
        return copy_with_checksum(self._region(offset, data.size), data, to_region=True)

    def read_into(self, offset: int, nbytes: int, dst: Any, key: str = "?") -> int:
        """Copy nbytes at offset into dst (exactly nbytes long); returns the psum64 of the bytes copied.
        Compare it with the checksum recorded at write time before trusting dst."""
        out = as_u8(dst, key=key, what="destination buffer", writable=True)
        if out.size != nbytes:
            raise BufferSizeError(
                f"umbp: destination buffer for key '{key}' is {out.size} bytes but the object is {nbytes} "
                f"bytes; pass a buffer of exactly {nbytes} bytes"
            )
        return copy_with_checksum(self._region(offset, nbytes), out, to_region=False)

    def checksum(self, offset: int, nbytes: int) -> int:
        """psum64 of the stored bytes, in place (no copy)."""
        return checksum_u8(self._region(offset, nbytes))

    def verify(self, offset: int, nbytes: int, expected: int) -> bool:
        return self.checksum(offset, nbytes) == expected

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A writable numpy uint8 view of the arena range (no copy, no checksum)."""
        return self._region(offset, nbytes)

    def tensor_view(self, offset: int, nbytes: int) -> Any:
        """A torch uint8 view of the arena range (no copy); imports torch."""
        region = self._region(offset, nbytes)
        if self._tensor is not None:
            return self._tensor[offset : offset + nbytes]
        import torch

        return torch.from_numpy(region)
