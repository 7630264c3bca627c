"""The shapes a RedisTier call is made of: one job per server, what counts as a network fault.

Shared by the tier and its reader and writer parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import redis

from umbp.pool.remote.resp import (
    Wire,
)

_NET_ERRORS = (OSError, redis.RedisError, ValueError)  # ValueError: a reply that does not parse
# What redis-py's own reply parser (connection set-up, the slow paths) can raise on a hostile reply: it is
# not bounded like umbp.pool.remote.resp (deeply nested arrays recurse, huge counts allocate), and a cache call
# must still not raise on what a server sends.
_REDIS_PY_FAULTS = (
    *_NET_ERRORS,
    redis.exceptions.RedisClusterException,
    RecursionError,
    MemoryError,
    OverflowError,
)
_REDIRECT = "redirect"  # a result slot whose key must go through redis-py's cluster client
_HIT, _ABSENT, _UNANSWERED, _MOVED = 1, 0, -1, -2  # exists() result codes


@dataclass
class _Job:
    """One server's share of a batch: `send` writes all its commands, `read` consumes all its replies."""

    node: str
    send: Callable[[Wire], None]
    read: Callable[[Wire], None]
    n: int  # keys it covers (for the unavailable_skips counter)
    nbytes: int = 0  # payload bytes it moves: the call's deadline grows with them (RemoteConfig.deadline_s)
