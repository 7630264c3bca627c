"""How a batch submitted to the GPU completes: a handle that polls the batch's CUDA event and reads each
object's result (a verdict or a digest) from a small page-locked buffer the launch wrote, so the host never
blocks on the device until a caller asks for the values."""

from __future__ import annotations

import numpy as np
import torch

from umbp.transfer.api import Handle
from umbp.transfer.plans import TablePool


class DeviceHandle(Handle):
    """Completes when its CUDA event does; values come from a small page-locked int64 buffer (None: an
    unverified load, every object written), which goes back to the engine's pool once read."""

    def __init__(
        self,
        sizes: list[int],
        event: torch.cuda.Event | None,
        host: torch.Tensor | None,
        keep: list[torch.Tensor],
        mix: np.ndarray | None,
        pool: TablePool | None,
    ):
        super().__init__(sizes)
        self._event, self._host, self._keep, self._mix, self._pool = event, host, keep, mix, pool

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        self._keep = []

    def _flat(self) -> list:
        if self._values is None:
            if self._host is None:
                self._values = [True] * sum(self._sizes)
            else:
                vals = self._host.numpy()
                if self._mix is None:
                    self._values = (vals != 0).tolist()
                else:  # digests: the length term goes in here
                    self._values = (vals.view(np.uint64) ^ self._mix).tolist()
                if self._pool is not None:
                    self._pool.give(self._host, None)  # read: the buffer may serve the next call
                self._host = None
        return self._values
