"""Errors raised by the pool layer.

Bad input raises one `UmbpValueError` subclass (also a `ValueError`) whose message names the key, size or
option at fault and says how to fix it. Errors are raised before anything is copied or reserved, so a
bad call never harms what is already stored.
"""

from __future__ import annotations

MiB = 1 << 20


def human_bytes(n: int) -> str:
    """Render a byte count the way people size arenas (KiB / MiB / GiB), exact when it divides evenly."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if n % scale == 0 else f"{value:.2f} {unit}"
    return f"{n} B"


class UmbpError(Exception):
    """Base class of every error umbp raises on purpose."""


class UmbpValueError(UmbpError, ValueError):
    """Bad input: an argument, option or buffer the caller can fix."""


class InvalidKeyError(UmbpValueError):
    """A key that is not a str, is not valid UTF-8 text (a lone surrogate), or is longer than a tier stores."""


class ObjectTooLargeError(UmbpValueError):
    """An object larger than the whole arena: it could never be stored, so it is an error, not a miss."""


class BufferSizeError(UmbpValueError):
    """A destination buffer whose size differs from the stored object's, or key/buffer counts that differ."""


class BufferTypeError(UmbpValueError):
    """A buffer that cannot be copied without a hidden copy: non-contiguous, read-only, or on a GPU."""


class UnknownOptionError(UmbpValueError):
    """A configuration key the pool does not know (usually a typo)."""


class OptionValueError(UmbpValueError):
    """A known option with a value of the wrong type or range."""


class CapacityError(OptionValueError):
    """A capacity (or watermark, alignment) that cannot describe a usable arena."""


class PinnedMemoryError(UmbpValueError):
    """pinned=True on a host where page-locked memory cannot be had (no torch or no CUDA)."""


class SlotStateError(UmbpError, RuntimeError):
    """A DramIndex call that does not match the key's state (commit without reserve, unbalanced unpin):
    a bug in the caller, never a data condition."""
