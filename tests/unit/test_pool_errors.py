"""Bad input -> one clear ValueError naming the key/size/option and the fix; nothing stored is harmed."""

import numpy as np
import pytest

from umbp.pool import (
    Arena,
    BufferSizeError,
    BufferTypeError,
    CapacityError,
    DramIndex,
    DramPool,
    ObjectTooLargeError,
    OptionValueError,
    PinnedMemoryError,
    UmbpError,
    UnknownOptionError,
)
from umbp.pool.dram.arena import cuda_available

MiB = 1 << 20


@pytest.fixture
def pool():
    p = DramPool(capacity_bytes=4 * MiB, pinned=False)
    p.put(["kept"], [b"precious"])
    yield p
    p.close()


def _intact(pool: DramPool) -> bool:
    out = bytearray(8)
    return pool.get_into(["kept"], [out]) == [True] and out == b"precious" and pool.stats()["pinned"] == 0


def test_object_larger_than_arena(pool):
    with pytest.raises(ObjectTooLargeError) as err:
        pool.put(["small", "big/page-7"], [b"x", bytes(8 * MiB)])
    assert str(err.value) == (
        "umbp: object 'big/page-7' is 8 MiB but the DRAM arena holds 4 MiB; "
        "raise capacity_bytes (dram_gb) or store smaller pages"
    )
    assert isinstance(err.value, ValueError) and isinstance(err.value, UmbpError)
    assert pool.exists(["small"]) == [False]  # the batch was rejected before anything was stored
    assert _intact(pool)


@pytest.mark.parametrize("capacity", [0, -5])
def test_zero_or_negative_capacity(capacity):
    with pytest.raises(
        CapacityError, match=rf"DRAM pool option 'capacity_bytes' must be an integer >= 1 .*got {capacity}$"
    ):
        DramPool(capacity_bytes=capacity)
    with pytest.raises(CapacityError, match="capacity_bytes must be > 0"):
        DramIndex(capacity)
    with pytest.raises(
        CapacityError, match=rf"DRAM pool option 'dram_gb' must be a finite number > 0.*got {capacity}$"
    ):
        DramPool.from_options({"dram_gb": capacity})


def test_capacity_of_the_wrong_type_or_below_one_page():
    with pytest.raises(
        OptionValueError, match="'capacity_bytes' must be an integer >= 1 and <= 2\\*\\*50, got '8G'"
    ):
        DramPool(capacity_bytes="8G")
    with pytest.raises(CapacityError, match="smaller than one 4096-byte page"):
        DramIndex(100)
    with pytest.raises(OptionValueError, match="alignment must be a power of two >= 8 bytes, got 1000"):
        DramIndex(1 << 20, alignment=1000)


def test_buffer_size_mismatch_names_key_and_sizes(pool):
    with pytest.raises(BufferSizeError) as err:
        pool.get_into(["kept"], [bytearray(5)])
    assert str(err.value) == (
        "umbp: get_into buffer for key 'kept' is 5 bytes but the stored object is 8 bytes; "
        "pass a buffer of exactly 8 bytes"
    )
    assert _intact(pool)  # the pin taken for the failed call was released


def test_key_and_buffer_counts_differ(pool):
    with pytest.raises(
        BufferSizeError, match="put got 2 keys but 1 buffers; pass exactly one buffer per key"
    ):
        pool.put(["a", "b"], [b"1"])
    with pytest.raises(BufferSizeError, match="get_into got 1 keys but 0 buffers"):
        pool.get_into(["kept"], [])
    assert _intact(pool)


def test_unusable_buffers(pool):
    with pytest.raises(BufferTypeError, match="destination buffer for key 'kept' is read-only"):
        pool.get_into(["kept"], [b"12345678"])
    with pytest.raises(BufferTypeError, match="source buffer for key 'nc' is a non-contiguous numpy array"):
        pool.put(["nc"], [np.arange(16)[::2]])
    with pytest.raises(BufferTypeError, match="source buffer for key 'obj' is a list"):
        pool.put(["obj"], [[1, 2, 3]])
    assert pool.exists(["nc", "obj"]) == [False, False]
    assert _intact(pool)


def test_buffers_whose_bytes_cannot_be_viewed(pool):
    """Arrays of Python objects hold pointers, not data; a conjugate tensor view has no bytes of its own
    to view: each is one BufferTypeError before anything is reserved, not numpy's or torch's own error."""
    with pytest.raises(BufferTypeError, match="source buffer for key 'o' is a numpy array of Python objects"):
        pool.put(["o"], [np.array([1, 2], dtype=object)])
    with pytest.raises(BufferTypeError, match="destination buffer for key 'kept' is a numpy array of Python"):
        pool.get_into(["kept"], [np.empty(8, dtype=object)])
    torch = pytest.importorskip("torch")
    with pytest.raises(BufferTypeError, match="source buffer for key 'c' is a tensor whose bytes cannot be"):
        pool.put(["c"], [torch.randn(4, dtype=torch.complex64).conj()])
    assert pool.exists(["o", "c"]) == [False, False]
    assert _intact(pool)


def test_unknown_option_is_named_with_the_valid_ones():
    with pytest.raises(UnknownOptionError) as err:
        DramPool.from_options({"dram_gbs": 1, "colour": "blue"})
    msg = str(err.value)
    assert msg.startswith("umbp: unknown DRAM pool option(s) 'colour', 'dram_gbs' (did you mean 'dram_gb'?)")
    assert (
        "valid options: capacity_bytes, dram_gb, high_watermark, low_watermark, pinned, alignment, prefault"
        in msg
    )
    assert isinstance(err.value, ValueError)


def test_bad_option_values():
    with pytest.raises(
        OptionValueError, match=r"'low_watermark' \(0.9\) must not exceed 'high_watermark' \(0.5\)"
    ):
        DramPool(capacity_bytes=MiB, high_watermark=0.5, low_watermark=0.9)
    with pytest.raises(OptionValueError, match="'pinned' must be 'auto', true or false, got 'yes please'"):
        DramPool(capacity_bytes=MiB, pinned="yes please")
    with pytest.raises(
        OptionValueError, match="give DRAM pool option 'dram_gb' or 'capacity_bytes', not both"
    ):
        DramPool.from_options({"dram_gb": 1, "capacity_bytes": 1 << 30})
    with pytest.raises(OptionValueError, match=r"'capacity_bytes' \(or 'dram_gb' in GiB\) is required"):
        DramPool.from_options({})
    with pytest.raises(
        OptionValueError, match="'dram_gb' must be a finite number > 0 and <= 2\\*\\*20, got 'lots'"
    ):
        DramPool.from_options({"dram_gb": "lots"})
    with pytest.raises(OptionValueError, match="'copy_threads' must be an integer >= 1 and <= 256, got 0"):
        DramPool(capacity_bytes=MiB, copy_threads=0)
    with pytest.raises(OptionValueError, match="'prefault' must be true or false, got 'maybe'"):
        DramPool.from_options({"dram_gb": 0.001, "prefault": "maybe"})


@pytest.mark.skipif(cuda_available(import_if_needed=False), reason="this host can page-lock memory")
def test_pinned_true_without_cuda_is_a_clear_error():
    with pytest.raises(PinnedMemoryError, match=r"pinned=True needs torch with a CUDA.*use pinned='auto'"):
        Arena(MiB, pinned=True)


def test_arena_rejects_out_of_range_access():
    arena = Arena(64 * 1024, pinned=False)
    with pytest.raises(BufferSizeError, match="outside the 65536-byte arena"):
        arena.write(64 * 1024 - 8, bytes(16))
    with pytest.raises(BufferSizeError, match="is 3 bytes but the object is 4 bytes"):
        arena.read_into(0, 4, bytearray(3), key="k")
