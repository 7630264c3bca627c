"""Turn caller buffers (bytes, bytearray, memoryview, numpy arrays, torch CPU tensors) into flat uint8
numpy views without copying. A hidden copy would make a put/get silently twice as slow (and a get into a
copy would lose the data), so layouts that need one are rejected with a clear error instead."""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np

from umbp.pool.errors import BufferSizeError, BufferTypeError

_U8 = np.dtype(np.uint8)


def _is_torch_tensor(buf: Any) -> bool:
    # Checked by module name so that the pool never imports torch just to look at a buffer.
    return type(buf).__module__.startswith("torch") and hasattr(buf, "data_ptr")


def _torch_as_u8(buf: Any, key: str, what: str) -> np.ndarray:
    if buf.device.type != "cpu":
        raise BufferTypeError(
            f"umbp: {what} for key '{key}' is on {buf.device}; the DRAM pool copies CPU memory only, "
            "so copy it to a CPU (ideally pinned) tensor first"
        )
    if not buf.is_contiguous():
        raise BufferTypeError(
            f"umbp: {what} for key '{key}' is a non-contiguous tensor; pass tensor.contiguous() "
            "(a get into a hidden copy would lose the data)"
        )
    import torch  # already imported by whoever made the tensor

    try:
        return buf.detach().reshape(-1).view(torch.uint8).numpy()
    except (TypeError, RuntimeError) as exc:  # a conjugate or negative view, a quantized or sparse dtype
        raise BufferTypeError(
            f"umbp: {what} for key '{key}' is a tensor whose bytes cannot be viewed ({exc}); "
            "pass a plain contiguous tensor (e.g. tensor.resolve_conj().contiguous())"
        ) from None


def as_u8(buf: Any, *, key: str, what: str, writable: bool) -> np.ndarray:
    """A flat uint8 view of `buf` sharing its memory; raises BufferTypeError naming `key` otherwise."""
    if type(buf) is np.ndarray and buf.dtype is _U8 and buf.ndim == 1 and buf.flags.c_contiguous:
        out = buf  # the common case (slices of one big uint8 buffer): skip the reshape/view calls
    elif isinstance(buf, np.ndarray):
        if buf.dtype.hasobject:
            raise BufferTypeError(
                f"umbp: {what} for key '{key}' is a numpy array of Python objects ({buf.dtype}); "
                "only arrays of plain numbers hold their bytes in the buffer"
            )
        if not buf.flags.c_contiguous:
            raise BufferTypeError(
                f"umbp: {what} for key '{key}' is a non-contiguous numpy array; "
                "pass np.ascontiguousarray(...) (a get into a hidden copy would lose the data)"
            )
        out = buf.reshape(-1).view(np.uint8)
    elif _is_torch_tensor(buf):
        out = _torch_as_u8(buf, key, what)
    else:
        try:
            out = np.frombuffer(buf, dtype=np.uint8)
        except (TypeError, ValueError, BufferError) as exc:
            raise BufferTypeError(
                f"umbp: {what} for key '{key}' is a {type(buf).__name__}, which is not a contiguous buffer "
                f"({exc}); pass bytes, bytearray, memoryview, a numpy array or a CPU torch tensor"
            ) from None
    if writable and not out.flags.writeable:
        raise BufferTypeError(
            f"umbp: {what} for key '{key}' is read-only ({type(buf).__name__}); "
            "get_into needs a writable buffer such as bytearray, numpy.empty or torch.empty"
        )
    return out


def prepare_buffers(op: str, keys: Sequence[str], buffers: Sequence[Any], writable: bool) -> list[np.ndarray]:
    """One uint8 view per key for a batched pool call; every tier checks a batch the same way."""
    if len(keys) != len(buffers):
        raise BufferSizeError(
            f"umbp: {op} got {len(keys)} keys but {len(buffers)} buffers; pass exactly one buffer per key"
        )
    what = "destination buffer" if writable else "source buffer"
    return [as_u8(b, key=k, what=what, writable=writable) for k, b in zip(keys, buffers, strict=True)]


def aligned_buffer(nbytes: int, populate: bool = True) -> np.ndarray:
    """A page-aligned uint8 buffer (anonymous mmap): O_DIRECT needs aligned memory. populate=True maps
    every page up front (MAP_POPULATE), so the hot path never pays a page fault (~5 us per 4 KiB)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return np.frombuffer(mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=flags), np.uint8)[:nbytes]
