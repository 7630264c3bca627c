"""TierStack: the tiers below a first (DRAM) tier, composed by what they declare they can do.

One composition for both users of stacked tiers: `TieredPool` (a Pool whose first tier is a DramPool)
and the vLLM connector's worker (whose first tier is the GPU-managed arena, with the SSD and shared tiers
below it). Both hand objects down with `write_behind` (a checked copy, no waiting for the disk or the
network), read lower tiers in order, and flush and close them the same way. Which tier is the
restart-surviving one and which is the shared one comes from the `Pool` capabilities (`persistent`,
`shared`), never from the tier's class, so a new tier joins by declaring them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from umbp.pool.base import Pool
from umbp.pool.errors import UmbpError, UmbpValueError


class TierStack:
    """Lower tiers in order (fastest first). `None` entries (an unconfigured tier) are left out."""

    def __init__(self, tiers: Sequence[Pool | None]) -> None:
        self.tiers: list[Pool] = [t for t in tiers if t is not None]

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def __iter__(self) -> Iterator[Pool]:
        return iter(self.tiers)

    @property
    def persistent(self) -> Pool | None:
        """The first tier whose objects survive a restart and that is not shared (a rank's own disk)."""
        return next((t for t in self.tiers if t.persistent and not t.shared), None)

    @property
    def shared(self) -> Pool | None:
        """The first tier other processes see."""
        return next((t for t in self.tiers if t.shared), None)

    @property
    def intake_bytes(self) -> int | None:
        """What the first lower tier takes in one burst (None: unbounded or no tier)."""
        return self.tiers[0].intake_bytes if self.tiers else None

    def write_behind(
        self, tier: Pool, keys: Sequence[str], buffers: Sequence[Any], checksums: Sequence[int] | None
    ) -> tuple[list[bool], int]:
        """Hand objects to `tier` without waiting for its I/O; never raises for a tier that is closed or
        an object it can never hold. Returns (stored per key, how many of them failed with an error
        rather than being dropped for want of room). A batch the tier refuses for one object (too large,
        a key it cannot store) is retried object by object, so the others in the batch still go down."""
        try:
            return tier.write_behind(keys, buffers, checksums=checksums), 0
        except UmbpValueError:
            if len(keys) == 1:
                return [False], 1
            out, errors = [], 0
            for i, key in enumerate(keys):
                ok, err = self.write_behind(
                    tier, [key], [buffers[i]], None if checksums is None else [checksums[i]]
                )
                out += ok
                errors += err
            return out, errors
        except UmbpError:  # the tier is closed
            return [False] * len(keys), len(keys)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every tier's queued writes; False if any timed out."""
        return all([t.flush(timeout) for t in self.tiers])

    def close(self, flush_timeout: float | None = None) -> None:
        """Flush (when `flush_timeout` is given) and close every tier, first to last."""
        for tier in self.tiers:
            if flush_timeout is not None:
                tier.flush(timeout=flush_timeout)
            tier.close()
        self.tiers = []
