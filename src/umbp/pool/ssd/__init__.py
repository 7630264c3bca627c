"""The SSD tier: `SsdTier`, objects in append-only segment files under one or more directories.

    from umbp.pool.ssd import SsdTier

Modules: `tier` (construction and the Pool interface; its other concerns are mixins beside it:
`index`, `directory`, `staging`, `reader`, `writer`, `space`), `format` (the on-disk records and groups),
`recovery` (the start-up scan, resync and flush mark), `options` (SsdOptions). See docs/ssd.md.
"""

from umbp.pool.ssd.format import RecordInfo
from umbp.pool.ssd.options import SsdOptions
from umbp.pool.ssd.recovery import scan_directory
from umbp.pool.ssd.tier import SsdDirectoryError, SsdError, SsdLockedError, SsdTier

__all__ = [
    "RecordInfo",
    "SsdDirectoryError",
    "SsdError",
    "SsdLockedError",
    "SsdOptions",
    "SsdTier",
    "scan_directory",
]
