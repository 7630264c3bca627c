"""SsdOptions: the SSD tier's options, checked by the one options layer (umbp.pool.options).

A module of its own so the tier's I/O code does not carry its configuration rules, and so docs/ssd.md's
option table can be generated without opening a directory.
"""

from __future__ import annotations

from typing import ClassVar

from umbp.pool.options import Options, auto_or_bool, option, option_set

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 4096  # the on-disk block (umbp.pool.ssd.format.BLOCK); sizes below it cannot hold a record
PiB = 1 << 50


@option_set
class SsdOptions(Options):
    """Options of `SsdTier` (its keyword arguments, or `SsdTier.from_options(mapping)`)."""

    where: ClassVar[str] = "SSD tier option"

    dirs: tuple[str, ...] = option(
        help="one directory or a list (one per drive); keys are striped by crc32(key) % len(dirs), so every "
        "version of a key lives in one directory. Changing the list orphans records (`foreign_records`; "
        "reclaimed as dead space)",
        nonempty=True,
    )
    capacity_bytes: int = option(
        help="bytes of segment files (headers and padding included), split evenly across directories; lowered "
        "automatically while the filesystem has less free space (`limit_bytes`)",
        minimum=64 * KiB,
        maximum=PiB,
        gib_alias="ssd_gb",
    )
    queue_bytes: int = option(
        256 * MiB,
        help="the staging buffer: the most bytes waiting to be written; also the largest object",
        minimum=BLOCK,
        maximum=1 << 40,
    )
    direct_io: bool | str = option(
        "auto",
        help="O_DIRECT where the filesystem allows (falls back to buffered I/O, per directory, if "
        "`open` or a write says EINVAL); `true` raises instead; `false` buffered (sealed segments are then "
        "dropped from the page cache with `posix_fadvise`)",
        convert=auto_or_bool,
        type_doc="`auto`, `true` or `false`",
    )
    segment_bytes: int | None = option(
        None,
        help="segment file size; at most a quarter of a directory's capacity. One file descriptor per "
        "segment stays open",
        minimum=BLOCK,
        maximum=1 << 40,
        default_doc="capacity per directory ÷ 16, within [256 KiB, 256 MiB]",
    )
    low_watermark: float = option(
        0.8,
        help="reclamation evicts least recently used objects until live bytes are below this fraction of "
        "the usable capacity",
        above=0,
        maximum=1,
    )
    max_io_bytes: int = option(
        8 * MiB, help="largest write (coalesced records) and bounce buffer", minimum=64 * KiB, maximum=1 << 30
    )
    io_threads: int = option(
        2,
        help="reader threads for batched `get_into` (0: read on the calling thread)",
        minimum=0,
        maximum=256,
    )
    copy_threads: int = option(
        2,
        help="threads that copy + checksum one `put` batch of ≥ 2 MiB into staging (the caller plus "
        "`copy_threads - 1` helpers; 1: the caller only)",
        minimum=1,
        maximum=256,
    )
    track_evicted: bool = option(False, help="collect keys for `drain_evicted()`")
    health_interval_s: float = option(
        1.0,
        help="how often each writer checks for deleted segments, a vanished directory and free space",
        above=0,
        maximum=3600,
    )
    prefault: bool = option(
        True, help="map the staging buffer's pages at start-up (MAP_POPULATE) so puts never page-fault"
    )

    def check(self) -> None:
        if not self.dirs:
            raise self.error("dirs", self.dirs, "at least one directory")
        if self.capacity_bytes < 64 * KiB * len(self.dirs):
            raise self.fail(
                f"SSD tier option 'capacity_bytes' ({self.capacity_bytes}) must be at least 64 KiB "
                f"per directory ({64 * KiB * len(self.dirs)} for {len(self.dirs)})"
            )
