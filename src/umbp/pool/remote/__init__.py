"""The shared tier on Redis >= 7 / Valkey: `RedisTier` and its settings, `RemoteConfig`.

    from umbp.pool.remote import RedisTier, RemoteConfig

Modules: `tier` (RedisTier), `config` (RemoteConfig), `backend` (one server or a cluster), `conns` (kept
connections), `resp` (the minimal RESP codec of the hot paths), `format` and `auth` (the stored value's
header, checksum and tag). See docs/remote.md.

The names resolve on first use (PEP 562) rather than at import: `tier` needs the optional `redis` package,
while `config`, `format` and `auth` do not, so validating options or reading a value's header must not
require redis-py to be installed.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "RedisTier": "umbp.pool.remote.tier",
    "GET_WINDOW_BYTES": "umbp.pool.remote.reader",
    "PUT_SEND_BYTES": "umbp.pool.remote.writer",
    "RemoteConfig": "umbp.pool.remote.config",
}

__all__ = ["RedisTier", "RemoteConfig"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
