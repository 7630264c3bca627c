"""The shapes a RedisTier call is made of: one job per server, what counts as a network fault.

Shared by the tier and its reader and writer parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import redis

from umbp.pool.remote.resp import (
    Wire,
    command,
)

_NET_ERRORS = (OSError, redis.RedisError, ValueError)  # ValueError: a reply that does not parse
# What redis-py can raise on a hostile reply where it still parses them (connection set-up, the cluster's
# topology, remove and clear): its parser is not bounded like umbp.pool.remote.resp (deeply nested arrays
# recurse, huge counts allocate) and its reply callbacks unpack and convert what they are given (SCAN's
# on ':5' is a TypeError); a cache call must still not raise on what a server sends.
_REDIS_PY_FAULTS = (
    *_NET_ERRORS,
    redis.exceptions.RedisClusterException,
    RecursionError,
    MemoryError,
    OverflowError,
    TypeError,
)
_HIT, _ABSENT, _UNANSWERED, _MOVED = 1, 0, -1, -2  # exists() result codes
_ASKING = command("ASKING")  # before a command sent to the node an ASK redirect names


def _asked(wire: Wire) -> None:
    """Consume ASKING's reply. Whatever it is, the reply of the command after it decides: without the
    flag, that command is redirected again, which ends the key's attempt."""
    wire.reply(max_bulk=0, max_items=0, depth=1)


@dataclass
class _Job:
    """One server's share of a batch: `send` writes all its commands, `read` consumes all its replies."""

    node: str
    send: Callable[[Wire], None]
    read: Callable[[Wire], None]
    n: int  # keys it covers (for the unavailable_skips counter)
    nbytes: int = 0  # payload bytes it moves: the call's deadline grows with them (RemoteConfig.deadline_s)
