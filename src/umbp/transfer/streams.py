"""The kernel engine's CUDA streams and the ordering between them and the caller's stream.

Each direction has a main stream (a dma call's copy-engine copies, or a zero-copy call's launch) and a
side stream (a dma call's gathers or verify-and-scatter launches), so that round r's kernels overlap
round r-1's copy and saves overlap loads. What must follow the caller's queued work does so through one
marker event recorded on the caller's stream (_after). A mixin of KernelEngine, kept apart because
every path of the engine uses it and none of it decides what is copied.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


class EngineStreams:
    """KernelEngine's streams (see the module docstring); None everywhere on CPU tensors (tests)."""

    streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None
    aux: tuple[torch.cuda.Stream, torch.cuda.Stream] | None
    _index: int | None

    def _init_streams(self, cuda: bool) -> None:
        device = self.device
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else None
        # dma rounds: gathers (save) / verify + scatter (load) run on these, so round r's kernels overlap
        # round r-1's (or r+1's) copy-engine transfer on the direction's main stream
        self.aux = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else None
        self._marker = torch.cuda.Event() if cuda else None  # see _after
        self._callers: dict[int, torch.cuda.Stream] = {}  # see _caller

    def _on(self, direction: int, caller) -> AbstractContextManager:
        """Run on this direction's stream, after the work already queued on the caller's stream."""
        if self.streams is None:
            return nullcontext()
        s = self.streams[direction]
        s.wait_stream(caller)
        return torch.cuda.stream(s)

    def _caller(self):
        """The caller's current stream. torch.cuda.current_stream makes a Stream object per call, host time
        in front of a save's first copy; the raw handle is one C call, and a handle seen before gets its
        object back (a handle names one stream while it exists; after, its object records on the new one)."""
        if self.streams is None:
            return None
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        stream = self._callers.get(raw)
        if stream is None:
            if len(self._callers) >= 64:  # bounded: callers are a few streams, but nothing promises it
                self._callers.clear()
            stream = self._callers[raw] = torch.cuda.current_stream(self._index)
        return stream

    def _main(self, direction: int):
        return self.streams[direction] if self.streams is not None else None

    def _side(self, direction: int):
        return self.aux[direction] if self.aux is not None else None

    def _after(self, caller, stream) -> torch.cuda.Event | None:
        """Order `stream` after the work queued on the caller's stream so far; returns the marker event
        for more streams to wait on (None on CPU). One event per engine, recorded again by each call: a
        wait takes the record current when it is issued, and creating an event per call cost host time
        in front of the first copy."""
        if stream is None:
            return None
        self._marker.record(caller)
        stream.wait_event(self._marker)
        return self._marker

    @staticmethod
    def _stream(stream) -> AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    @staticmethod
    def _event(stream) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event
