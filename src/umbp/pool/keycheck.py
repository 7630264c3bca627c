"""The one key rule of the pool interface, checked the same way by every tier.

A key is a `str` that encodes to UTF-8: the SSD tier writes it into record headers and the shared tier
sends it to the server, both as UTF-8. Checking at the interface of every tier (DRAM included, which
could hold any hashable) means a key one tier accepts is never refused by the next one during an
eviction or a promotion, and bad keys get one error type, `InvalidKeyError`, naming the key, instead of
a bare `UnicodeEncodeError` or `TypeError` from deep inside a tier.
"""

from __future__ import annotations

from collections.abc import Iterable

from umbp.pool.errors import InvalidKeyError

_SHOWN = 60  # characters of a bad key shown in a message


def _shown(key: str) -> str:
    text = ascii(key[:_SHOWN])  # ascii(): a lone surrogate is printable as an escape, never re-raised
    return text + ("..." if len(key) > _SHOWN else "")


def check_keys(op: str, keys: Iterable[object]) -> None:
    """Raise InvalidKeyError for the first key that is not a str encodable as UTF-8."""
    for key in keys:
        if type(key) is not str:
            if not isinstance(key, str):
                raise InvalidKeyError(
                    f"umbp: {op} got a {type(key).__name__} key; keys are str (got {_describe(key)})"
                )
        if not key.isascii():
            try:
                key.encode()
            except UnicodeEncodeError:
                raise InvalidKeyError(
                    f"umbp: {op} got key {_shown(key)}, which is not valid UTF-8 text (a lone surrogate); "
                    "keys must encode to UTF-8"
                ) from None


def key_utf8(op: str, key: object, max_bytes: int) -> bytes:
    """A key's UTF-8 bytes, for tiers that store keys; InvalidKeyError if it is bad or over max_bytes."""
    check_keys(op, (key,))
    kb = key.encode()  # type: ignore[union-attr]
    if len(kb) > max_bytes:
        raise InvalidKeyError(
            f"umbp: key {_shown(key)} is {len(kb)} bytes; the SSD tier takes keys up to {max_bytes} bytes (utf-8)"  # type: ignore[arg-type]
        )
    return kb


def _describe(key: object) -> str:
    text = (
        repr(key) if isinstance(key, int | float | bytes | bytearray | tuple) else f"a {type(key).__name__}"
    )
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
