"""Layer 2: the pool. Batched exists/put/get over tiers; the first tier is DRAM.

    from umbp.pool import DramPool
    pool = DramPool(capacity_bytes=8 << 30)          # or DramPool.from_options({"dram_gb": 8})
    pool.put(["k"], [buf]); pool.get_into(["k"], [out])

`DramIndex` (metadata) and `Arena` (bytes) are the two halves of `DramPool`, usable apart (the vLLM
connector keeps the index in the scheduler and one arena per worker). Depends on numpy; torch optional.
"""

from umbp.pool import checksum  # the package; the function: umbp.pool.checksum.checksum
from umbp.pool.base import Pool
from umbp.pool.dram import OPTIONS, Arena, DramIndex, DramPool, PageAllocator, Slot
from umbp.pool.errors import (
    BufferSizeError,
    BufferTypeError,
    CapacityError,
    InvalidKeyError,
    ObjectTooLargeError,
    OptionValueError,
    PinnedMemoryError,
    SlotStateError,
    UmbpError,
    UmbpValueError,
    UnknownOptionError,
)

__all__ = [
    "OPTIONS",
    "Arena",
    "BufferSizeError",
    "BufferTypeError",
    "CapacityError",
    "DramIndex",
    "DramPool",
    "InvalidKeyError",
    "ObjectTooLargeError",
    "OptionValueError",
    "PageAllocator",
    "PinnedMemoryError",
    "Pool",
    "Slot",
    "SlotStateError",
    "UmbpError",
    "UmbpValueError",
    "UnknownOptionError",
    "checksum",
]

# The SSD tier and the tier composition (docs/ssd.md).
from umbp.pool.composition import TierStack  # noqa: E402
from umbp.pool.ssd import (  # noqa: E402
    RecordInfo,
    SsdDirectoryError,
    SsdError,
    SsdLockedError,
    SsdTier,
    scan_directory,
)
from umbp.pool.tiered import TieredPool  # noqa: E402

__all__ += [
    "RecordInfo",
    "SsdDirectoryError",
    "SsdError",
    "SsdLockedError",
    "SsdTier",
    "TierStack",
    "TieredPool",
    "scan_directory",
]
