"""The copy-engine calls of a round in one C call (umbp.transfer._copies) against their Python twin
(batchcopy.issue through ctypes): the same copies, in the same order, split the same way between single
copies and the batch call, for both batch-call signatures; failures are one RuntimeError naming the CUDA
error. The runtime's functions are stand-ins (ctypes callbacks), so this runs without a GPU."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from umbp.transfer import batchcopy

pytestmark = pytest.mark.skipif(batchcopy._copies is None, reason="umbp.transfer._copies not built")

ONE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)
_ARGS = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
BATCH13 = ctypes.CFUNCTYPE(ctypes.c_int, *_ARGS, ctypes.c_void_p)
BATCH12 = ctypes.CFUNCTYPE(ctypes.c_int, *_ARGS, ctypes.c_void_p, ctypes.c_void_p)


class Runtime:
    """Stand-ins for cudaMemcpyAsync and cudaMemcpyBatchAsync that record each call, failing with
    `error` from the `fail_at`-th call on."""

    def __init__(self, fail_index: bool = False, error: int = 0, fail_at: int = 0):
        self.calls: list[tuple] = []
        self.error, self.fail_at = error, fail_at

        def result() -> int:
            return self.error if len(self.calls) > self.fail_at else 0

        def one(dst, src, n, kind, stream):
            self.calls.append(("one", dst, src, n, stream))
            assert kind == 4  # cudaMemcpyDefault
            return result()

        def batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, *rest):
            words = [ctypes.cast(p, ctypes.POINTER(ctypes.c_uint64))[:count] for p in (dsts, srcs, sizes)]
            order = ctypes.cast(attrs, ctypes.POINTER(ctypes.c_int))[0]
            index = ctypes.cast(idxs, ctypes.POINTER(ctypes.c_size_t))[0]
            assert (order, index, nattrs, len(rest)) == (1, 0, 1, 2 if fail_index else 1)
            self.calls.append(("batch", *map(tuple, words), rest[-1]))
            return result()

        self.one = ONE(one)
        self.batch = (BATCH12 if fail_index else BATCH13)(batch)
        self.fail_index = fail_index

    def native(self):
        return batchcopy.native_runs(batchcopy._address(self.one), (self.batch, self.fail_index))

    def twin(self, dst_base, dst, src_base, src, sizes, stream, batch, lead):
        """batchcopy.issue with Python callables that record what the ctypes functions would be given."""

        def one(d, s, n, h):
            if self.one(d, s, n, 4, h):
                raise RuntimeError("failed")

        def many(d, s, n, h):
            self.calls.append(("batch", *(tuple(int(v) for v in a) for a in (d, s, n)), h))

        dsts, srcs = dst_base + dst, src_base + src
        batchcopy.issue(dsts, srcs, sizes, stream, one, many if batch else None, lead)


@pytest.mark.parametrize("fail_index", [False, True])
@pytest.mark.parametrize("lead", [False, True])
@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("runs", [1, 2, 5, 9])
def test_a_rounds_copies_in_one_c_call_are_the_ones_python_issues(runs, batch, lead, fail_index):
    rng = np.random.default_rng(runs)
    sizes = rng.choice([4096, 1 << 20, 3 << 20], runs).astype(np.int64)
    dst = rng.integers(0, 1 << 30, runs).astype(np.int64) * 8
    src = rng.integers(0, 1 << 30, runs).astype(np.int64) * 8
    native, python = Runtime(fail_index), Runtime(fail_index)
    native.native()(1 << 40, dst, 1 << 41, src, sizes, 77, batch, lead)
    python.twin(1 << 40, dst, 1 << 41, src, sizes, 77, batch, lead)
    assert native.calls == python.calls
    kinds = [c[0] for c in native.calls]
    assert sum(1 if c[0] == "one" else len(c[3]) for c in native.calls) == runs  # every run once
    if batch and lead and runs > 1:
        assert kinds[0] == "one" and kinds[-1] == "batch"  # bytes move before the batch call's cost


def test_a_failing_copy_call_is_one_error_naming_the_cuda_error():
    dst = src = np.arange(4, dtype=np.int64) * 4096
    sizes = np.full(4, 1 << 20, np.int64)
    failing = Runtime(error=700, fail_at=1)  # the second call fails
    with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync failed with CUDA error 700 \(1048576 bytes\)"):
        failing.native()(0, dst, 0, src, sizes, 1, False, False)
    assert len(failing.calls) == 2  # nothing issued after the failure
    batch_fails = Runtime(error=1, fail_at=0)
    with pytest.raises(RuntimeError, match=r"cudaMemcpyBatchAsync failed with CUDA error 1 \(4 copies\)"):
        batch_fails.native()(0, dst, 0, src, sizes, 1, True, False)


def test_bad_arrays_are_refused_before_any_copy():
    runtime = Runtime()
    copy = runtime.native()
    ok = np.zeros(3, np.int64)
    with pytest.raises(ValueError, match="3 sizes but 2 destinations"):
        copy(0, ok[:2], 0, ok, ok, 0, False, False)
    with pytest.raises(TypeError, match="int64"):
        copy(0, ok.astype(np.int32), 0, ok, ok, 0, False, False)
    with pytest.raises(ValueError, match="negative size"):
        copy(0, ok, 0, ok, np.array([1, -1, 1], np.int64), 0, False, False)
    assert runtime.calls == []


EARLY_CASES = {
    "list": [0, 4096, 8 << 20],
    "numpy": np.array([8, 1 << 20, 64], dtype=np.int64),
    "numpy unsigned": np.array([8, 16, 24], dtype=np.uint64),
    "tuple of numpy ints": (np.int32(0), np.int64(8), np.uint16(16)),
    "misaligned": [0, 4, 8],
    "negative": [0, -8, 16],
    "at the end": [(16 << 20) - (1 << 20), 0, 8],
    "past the end": [(16 << 20) - (1 << 20) + 8, 0, 8],
    "past 2**63": [0, 1 << 63, 8],
    "past 2**64": [0, 1 << 64, 8],
    "a float": [0, 8.0, 16],
    "a numpy float": np.array([0.0, 8.0, 16.0]),
    "a string": [0, "8", 16],
    "None": [0, None, 16],
    "a bool": [True, 0, 8],
    "too few": [0, 8],
}


@pytest.mark.parametrize("count", [0, 1, 3, 65])
@pytest.mark.parametrize("case", list(EARLY_CASES))
def test_the_early_copies_c_call_checks_and_copies_as_its_python_twin(case, count):
    """batchcopy.native_early (_copies.early) and batchcopy.python_early: the same answer and the same
    copies for every kind of offset (a bad one among the first `count`: no copy at all), list or array."""
    offsets = EARLY_CASES[case]
    args = (55, 1 << 40, 1 << 21, 1 << 41, offsets, 1 << 20, 16 << 20, count)
    native, python = Runtime(), Runtime()
    got_native = batchcopy.native_early(batchcopy._address(native.one))(*args)
    got_python = batchcopy.python_early(lambda d, s, n, h: python.one(d, s, n, 4, h))(*args)
    assert got_native == got_python
    assert native.calls == python.calls
    assert got_native == bool(native.calls)
    if got_native:
        assert [c[1] for c in native.calls] == [(1 << 40) + k * (1 << 21) for k in range(count)]


def test_a_failing_early_copy_raises_naming_the_cuda_error():
    runtime = Runtime(error=700, fail_at=1)
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        batchcopy.native_early(batchcopy._address(runtime.one))(0, 0, 8, 0, [0, 8, 16], 8, 64, 3)


@pytest.mark.parametrize("fail_index", [False, True])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("count", [1, 2, 7])
def test_a_save_heads_copies_in_one_c_call_are_the_ones_python_issues(count, batched, fail_index):
    """batchcopy.native_head (_copies.head) and batchcopy.python_head: each object's runs of KV memory
    at the same addresses, to the same slots, split the same way between single copies and the batch
    call."""
    from umbp.transfer.head import Runs

    rng = np.random.default_rng(count)
    runs = Runs(
        src=np.array([1 << 30, 3 << 30, 5 << 30], np.int64),
        stride=np.array([409600, 204800, 409600], np.int64),
        obj=np.array([0, 409600, 614400], np.int64),
        nbytes=np.array([409600, 204800, 1 << 20], np.int64),
    )
    ids = rng.integers(0, 1000, 9).astype(np.int64)
    offs = rng.integers(0, 1 << 20, 9).astype(np.int64) * 4096
    native, python = Runtime(fail_index), Runtime(fail_index)
    batchcopy.native_head(batchcopy._address(native.one), (native.batch, fail_index))(
        1 << 40, offs, ids, runs, count, 77, batched
    )

    def one(d, s, n, h):
        python.one(d, s, n, 4, h)

    def many(d, s, n, h):
        python.calls.append(("batch", *(tuple(int(v) for v in a) for a in (d, s, n)), h))

    batchcopy.python_head(one, many)(1 << 40, offs, ids, runs, count, 77, batched)
    assert native.calls == python.calls
    copied = [c[1:4] for c in native.calls if c[0] == "one"]
    for c in native.calls:
        if c[0] == "batch":
            copied += list(zip(*c[1:4], strict=True))
    want = {
        (
            (1 << 40) + int(offs[k] + runs.obj[j]),
            int(runs.src[j] + ids[k] * runs.stride[j]),
            int(runs.nbytes[j]),
        )
        for k in range(count)
        for j in range(3)
    }
    assert set(copied) == want and len(copied) == len(want)


def test_a_failing_head_copy_raises_naming_the_cuda_error():
    from umbp.transfer.head import Runs

    runs = Runs(*(np.array([v], np.int64) for v in (1 << 30, 4096, 0, 4096)))
    runtime = Runtime(error=700, fail_at=0)
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        batchcopy.native_head(batchcopy._address(runtime.one), None)(
            0, np.zeros(2, np.int64), np.arange(2, dtype=np.int64), runs, 2, 0, False
        )
