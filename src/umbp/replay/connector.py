"""`ReplayConnector`: the real UMBPConnector, plus a read-only observer of its lookups.

The replay needs, at the moment vLLM asks umbp for a request's external hit, the oracle and the local hit
for the same request state, and umbp's explanation when it falls short. Subclassing keeps the connector's
behaviour byte-for-byte the UMBPConnector's; the observer only reads.
"""

from __future__ import annotations

from typing import Protocol

from umbp.vllm.connector import UMBPConnector


class LookupObserver(Protocol):
    def on_lookup(self, connector: UMBPConnector, request, num_computed_tokens: int, ext: int | None) -> None:
        """Called after every scheduler-side lookup (vLLM may look a waiting request up more than once)."""


class ReplayConnector(UMBPConnector):
    observer: LookupObserver | None = None  # set by the replay engine right after the Scheduler is built

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        ext, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self.observer is not None:
            self.observer.on_lookup(self, request, num_computed_tokens, ext)
        return ext, is_async
