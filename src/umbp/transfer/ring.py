"""Device staging for the dma path: per direction, two buffers that a transfer's rounds take in turn.

Why two, and why kept: round r's copy-engine copy fills one buffer while round r-1's kernels still read
the other, and allocating ~128 MiB of device memory between a batch's rounds can fail half-way (the
caller would then have to drain rounds already queued). Both buffers are made at once, on a direction's
first dma round, and kept until `clear` (the engine's warm-up lets them go again, so that they are not
held while vLLM captures its CUDA graphs).
"""

from __future__ import annotations

import torch

from umbp.transfer.plans import aligned
from umbp.transfer.rounds import LOAD


class StagingRing:
    """[buffer, event after which it is free] slots: two per direction when `pooled` (CUDA), taken in
    turn; a one-off buffer for a round bigger than `nbytes` or when not pooled (CPU, where nothing
    runs asynchronously). Each pooled buffer of the load direction has `extra` bytes past its
    `nbytes` for a restore's early copies (early.py): a round never reaches into them, or a round of the
    call could overwrite early objects before the first round's scatter has read them."""

    def __init__(self, device: torch.device, nbytes: int, pooled: bool, extra: int = 0):
        self.device, self.nbytes, self.pooled, self.extra = device, nbytes, pooled, extra
        self._slots: dict[int, list[list]] = {0: [], 1: []}
        self._turn = {0: 0, 1: 0}

    def take(self, direction: int, nbytes: int) -> list:
        if not self.pooled or nbytes > self.nbytes:
            return [aligned(nbytes, self.device), None]
        slots = self._slots[direction]
        if not slots:  # both at once: never an allocation (which can fail) between a batch's rounds
            extra = self.extra if direction == LOAD else 0  # (saves have no early copies)
            slots += [[aligned(self.nbytes + extra, self.device), None] for _ in range(2)]
        self._turn[direction] += 1
        return slots[self._turn[direction] % len(slots)]

    @staticmethod
    def acquire(slot: list, stream) -> None:
        """Order `stream` after the last round that used this slot's buffer (on the device)."""
        if slot[1] is not None and stream is not None:
            stream.wait_event(slot[1])

    def clear(self) -> None:
        self._slots = {0: [], 1: []}
