"""Many copies in one call: the CUDA runtime's `cudaMemcpyBatchAsync` (CUDA >= 12.8), reached via ctypes.

Why: the dma path copies staging <-> arena once per run of adjacent arena slots. When slots are scattered
(an arena fragmented by churn) each object is its own run, and one `cudaMemcpyAsync` per run costs ~10 us
of host time and a copy-engine launch: 1 MiB objects ran at ~0.93 of a plain copy, 64 KiB ones at 0.14.
One batch call hands the driver every run at once. Measured on the H200 (`bench/results/archive/`,
1 GiB per direction in 256 MiB calls, scattered slots): 256 KiB runs 0.96 D2H / 0.98 H2D / 97 GB/s both
ways, 1 MiB runs 0.99 / 0.99 / 98 GB/s; 64 KiB runs only 0.81 / 0.89 (0.7 us of host time per copy), where
the zero-copy kernel is better; 16 KiB runs 0.48 / 0.09.

`load()` returns None where the runtime lacks the call (CPU-only torch, CUDA < 12.8): callers then copy
run by run. `load_one()` is the runtime's plain `cudaMemcpyAsync`, for a run or two: it reaches the copy
engine without the batch call's fixed cost (~20-30 us of the H200 host's time, in front of a restore's
first byte), and without torch's stream switch and tensor slicing (~30 us there).

`load_runs()` is what the engine calls per round: a whole round's copies (its lead runs one by one, then
the batch call, as `issue` splits them), in one call to the C extension umbp.transfer._copies, which
calls the same runtime functions through their addresses (`native_runs`): through ctypes, the arrays'
conversion and each call's arguments cost ~20 us of a slow host's time per batch call and ~5 us per
single copy. Without the extension, `python_runs` does the same through `issue` and ctypes.

`load_early()` is a restore's early copies (early.py): the first objects' offsets checked and each copied
with `cudaMemcpyAsync`, in one C call (`native_early`), else `python_early` through ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from umbp.pool.native import optional_extension

_copies, _why_not = optional_extension("umbp.transfer._copies")

_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources are read in stream order (after our kernels)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """cudaMemcpyAttributes; location hints left invalid (they matter only for managed memory)."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_hint", _Location),
        ("dst_hint", _Location),
        ("flags", ctypes.c_uint),
    ]


BatchCopy = Callable[[np.ndarray, np.ndarray, np.ndarray, int], None]
OneCopy = Callable[[int, int, int, int], None]
# a call's first round issues runs one by one until this many bytes are queued (see issue): ~40 us of
# copy at 55 GB/s, more than the batch call's host cost it covers (H200)
LEAD_BYTES, LEAD_RUNS = 2 << 20, 4
EARLY_MOST = 64  # a restore's early copies: at most this many objects (the C twin's bound too)
_DEFAULT = 4  # cudaMemcpyDefault: the direction from the addresses (unified addressing)


def _batch_call(runtime: ctypes.CDLL | None) -> tuple[ctypes._CFuncPtr, bool] | None:
    """The runtime's cudaMemcpyBatchAsync and whether it takes CUDA 12.8/12.9's failIdx out-parameter
    before the stream; None where the runtime lacks it."""
    if runtime is None:
        return None
    version = ctypes.c_int()
    if runtime.cudaRuntimeGetVersion(ctypes.byref(version)) != 0 or version.value < 12080:
        return None
    fn = getattr(runtime, "cudaMemcpyBatchAsync", None)
    return None if fn is None else (fn, version.value < 13000)


def load() -> BatchCopy | None:
    """copy(dsts, srcs, sizes, stream_handle): uint64 arrays of addresses and byte counts, enqueued on the
    stream (a `torch.cuda.Stream.cuda_stream`); raises RuntimeError with the CUDA error code on failure."""
    call = _batch_call(_runtime())
    if call is None:
        return None
    fn, fail_index = call
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_void_p] * 3
        + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        + [ctypes.c_void_p] * (2 if fail_index else 1)
    )
    attrs = _Attributes(_ORDER_STREAM, _Location(0, 0), _Location(0, 0), 0)
    first = (ctypes.c_size_t * 1)(0)  # one attribute set, for copies 0..count-1
    failed = ctypes.c_size_t(0)

    def copy(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        d, s, n = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        args = [d.ctypes.data, s.ctypes.data, n.ctypes.data, d.size, ctypes.byref(attrs), first, 1]
        args += [ctypes.byref(failed), stream] if fail_index else [stream]
        err = fn(*args)
        if err:
            raise RuntimeError(f"umbp: cudaMemcpyBatchAsync failed with CUDA error {err} ({d.size} copies)")

    return copy


def load_one() -> OneCopy | None:
    """copy(dst, src, nbytes, stream_handle): one copy enqueued on the stream; raises RuntimeError with
    the CUDA error code on failure. None without a CUDA runtime."""
    runtime = _runtime()
    fn = getattr(runtime, "cudaMemcpyAsync", None) if runtime is not None else None
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    def copy(dst: int, src: int, nbytes: int, stream: int) -> None:
        err = fn(dst, src, nbytes, _DEFAULT, stream)
        if err:
            raise RuntimeError(f"umbp: cudaMemcpyAsync failed with CUDA error {err} ({nbytes} bytes)")

    return copy


RunsCopy = Callable[[int, np.ndarray, int, np.ndarray, np.ndarray, int, bool, bool], None]


def load_runs() -> RunsCopy | None:
    """copy(dst_base, dst_offs, src_base, src_offs, sizes, stream_handle, batch, lead): run i copies
    sizes[i] bytes from src_base + src_offs[i] to dst_base + dst_offs[i] (int64 arrays), enqueued on the
    stream as `issue` enqueues them (`batch`: the batch call may take them; `lead`: the copy engine is
    idle): in one C call where the extension is built, else through ctypes. None without the runtime's
    cudaMemcpyAsync."""
    return _loaded(native_runs, python_runs)


def python_runs(one: OneCopy, batch: BatchCopy | None) -> RunsCopy:
    """load_runs' copy through `issue` (one: load_one's copy, batch: load's, or stand-ins in tests)."""

    def copy(
        dst_base: int,
        dst: np.ndarray,
        src_base: int,
        src: np.ndarray,
        sizes: np.ndarray,
        stream: int,
        batched: bool,
        lead: bool,
    ) -> None:
        issue(dst_base + dst, src_base + src, sizes, stream, one, batch if batched else None, lead)

    return copy


def native_runs(one: int, call: tuple[ctypes._CFuncPtr, bool] | None) -> RunsCopy:
    """load_runs' copy for these runtime functions (one: cudaMemcpyAsync's address; call: from
    _batch_call); the tests hand it stand-ins."""
    assert _copies is not None
    issue_ = _copies.issue
    batch_at, fail_index = (_address(call[0]), call[1]) if call is not None else (0, False)

    def copy(
        dst_base: int,
        dst: np.ndarray,
        src_base: int,
        src: np.ndarray,
        sizes: np.ndarray,
        stream: int,
        batch: bool,
        lead: bool,
    ) -> None:
        at = batch_at if batch else 0
        issue_(
            one,
            at,
            fail_index,
            dst_base,
            dst,
            src_base,
            src,
            sizes,
            stream,
            LEAD_BYTES if lead else 0,
            LEAD_RUNS,
        )

    return copy


# copy(stream, dst_base, dst_step, src_base, offsets, nbytes, capacity, count) -> whether it copied
EarlyCopy = Callable[[int, int, int, int, Sequence[Any], int, int, int], bool]


def load_early() -> EarlyCopy | None:
    """A restore's early copies: object k of the first `count` goes from src_base + offsets[k] to
    dst_base + k * dst_step (nbytes each, on the stream), once every one of those offsets is an integer,
    8-byte aligned, with its object inside the arena (capacity bytes); else nothing is copied and the
    answer is False. One C call where the extension is built, else through ctypes. None without the
    runtime's cudaMemcpyAsync."""
    return _loaded(lambda one, _call: native_early(one), lambda one, _batch: python_early(one))


def early_offsets(offsets: Sequence[Any], count: int, nbytes: int, capacity: int) -> list[int]:
    """The first `count` offsets as ints, or [] where any is not an integer, 8-byte aligned, with its
    object of nbytes inside the arena: what the early copies check (the C twin in _copies.c)."""
    if count <= 0 or count > EARLY_MOST or nbytes <= 0 or capacity < nbytes:
        return []
    out = []
    for k in range(count):
        try:
            off = operator.index(offsets[k])
        except (TypeError, IndexError, ValueError, OverflowError):
            return []
        if off < 0 or off & 7 or off > capacity - nbytes:
            return []
        out.append(off)
    return out


def python_early(one: OneCopy) -> EarlyCopy:
    """load_early's copy through `one` (load_one's copy, or a stand-in in tests)."""

    def copy(
        stream: int,
        dst_base: int,
        dst_step: int,
        src_base: int,
        offsets: Sequence[Any],
        nbytes: int,
        capacity: int,
        count: int,
    ) -> bool:
        offs = early_offsets(offsets, count, nbytes, capacity)
        for k, off in enumerate(offs):
            one(dst_base + k * dst_step, src_base + off, nbytes, stream)
        return bool(offs)

    return copy


def native_early(one: int) -> EarlyCopy:
    """load_early's copy in one C call, `one` being cudaMemcpyAsync's address (tests: a stand-in's): the
    extension's function itself, `one` bound (no Python layer in front of a restore's first copy)."""
    assert _copies is not None
    return functools.partial(_copies.early, one)


# copy(dst_base, offs, ids, runs, count, stream, batched): a save head's copies (head.py): for objects
# k < count and each run j of `runs` (head.Runs), runs.nbytes[j] bytes from runs.src[j] + ids[k] *
# runs.stride[j] to dst_base + offs[k] + runs.obj[j], split as `issue` splits a call's first round
HeadCopy = Callable[[int, np.ndarray, np.ndarray, Any, int, int, bool], None]


def load_head() -> HeadCopy | None:
    """A cold save's head copies: one C call where the extension is built (the addresses worked out
    there), else numpy and `issue` through ctypes. None without the runtime's cudaMemcpyAsync."""
    return _loaded(native_head, python_head)


def python_head(one: OneCopy, batch: BatchCopy | None) -> HeadCopy:
    """load_head's copy in numpy and `issue` (one, batch: load_one's and load's copies, or stand-ins)."""

    def copy(
        dst_base: int, offs: np.ndarray, ids: np.ndarray, runs: Any, count: int, stream: int, batched: bool
    ) -> None:
        src = (runs.src + ids[:count, None] * runs.stride).ravel()
        dst = (dst_base + offs[:count, None] + runs.obj).ravel()
        size = np.tile(runs.nbytes, count)
        issue(dst, src, size, stream, one, batch if batched else None, True)

    return copy


def native_head(one: int, call: tuple[ctypes._CFuncPtr, bool] | None) -> HeadCopy:
    """load_head's copy in one C call (one: cudaMemcpyAsync's address; call: from _batch_call)."""
    assert _copies is not None
    head_ = _copies.head
    batch_at, fail_index = (_address(call[0]), call[1]) if call is not None else (0, False)

    def copy(
        dst_base: int, offs: np.ndarray, ids: np.ndarray, runs: Any, count: int, stream: int, batched: bool
    ) -> None:
        at = batch_at if batched else 0
        head_(
            one,
            at,
            fail_index,
            dst_base,
            offs,
            ids,
            runs.src,
            runs.stride,
            runs.obj,
            runs.nbytes,
            count,
            stream,
            LEAD_BYTES,
            LEAD_RUNS,
        )

    return copy


def _loaded(native: Callable[[int, Any], Any], python: Callable[[OneCopy, BatchCopy | None], Any]) -> Any:
    """native(cudaMemcpyAsync's address, _batch_call's answer) where the C extension is built, else
    python(load_one's copy, load's copy); None without the runtime's cudaMemcpyAsync."""
    runtime = _runtime()
    one = getattr(runtime, "cudaMemcpyAsync", None) if runtime is not None else None
    if one is None:
        return None
    if _copies is None:
        copy_one = load_one()
        return python(copy_one, load()) if copy_one is not None else None
    return native(_address(one), _batch_call(runtime))


def _address(fn: ctypes._CFuncPtr) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def _runtime() -> ctypes.CDLL | None:
    """The CUDA runtime torch already loaded (same soname, so the same library and context): the major
    version torch was built with first, so a second runtime of another version is never loaded beside it."""
    import torch

    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libcudart.so.{major}"] if major.isdigit() else []
    for name in names + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def issue(
    dsts: np.ndarray,
    srcs: np.ndarray,
    size: np.ndarray,
    stream: int,
    one: OneCopy,
    batch: BatchCopy | None,
    lead: bool,
) -> None:
    """Enqueue copies on a stream: all in one batch call where `batch` is given, else one by one. `lead`:
    the copy engine is idle (a call's first round), so the first runs (up to LEAD_BYTES) go one by one
    ahead of the batch call, and bytes move while the host spends the batch call's fixed cost."""
    first = size.size if batch is None else (_leading_runs(size, LEAD_BYTES, LEAD_RUNS) if lead else 0)
    for d, c, n in zip(dsts[:first].tolist(), srcs[:first].tolist(), size[:first].tolist()):
        one(d, c, n, stream)
    if first < size.size:
        batch(dsts[first:], srcs[first:], size[first:], stream)


def _leading_runs(size: np.ndarray, nbytes: int, most: int) -> int:
    """How many of the first runs it takes to reach nbytes: at most `most`, and never all of them."""
    queued, count = 0, 0
    for n in size[: min(most, size.size - 1)].tolist():
        queued, count = queued + n, count + 1
        if queued >= nbytes:
            break
    return count
