"""How RedisTier removes and lists objects: `remove`, `clear` and the operators' scans (`umbp stats`).
These go through redis-py's command API (they are not on the serving path); `remove` and `clear` still
never raise on what a server sends (an odd reply is counted as an error, nothing removed on its word).
Every SCAN here ends: a reply that is not [cursor, [names]], a cursor the server hands out twice or more
pages than its key count calls for (at most MAX_SCAN_CALLS) end it with ScanError (a redis.RedisError)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import redis

from umbp.pool.keycheck import check_keys
from umbp.pool.remote.backend import Cluster
from umbp.pool.remote.calls import _REDIS_PY_FAULTS

# pages of one SCAN of one server: COUNT 1000 per page covers 10**9 hash-table slots, past any real server
MAX_SCAN_CALLS = 1 << 20


class ScanError(redis.RedisError):
    """A SCAN (or its STRLENs) that cannot go on: the server's replies are not what Redis sends, or its
    cursor would never come back to 0."""


class AdminMixin:
    """Part of RedisTier (umbp.pool.remote.tier), split out by concern: it works on the tier's own
    state (`self`), so the methods read exactly as they would in one class."""

    def remove(self, keys: Sequence[str]) -> int:
        """UNLINK value and marker of each key; returns how many keys had either. Errors count as absent,
        and so does a reply that is not a count (only a server that says it removed something counts)."""
        keys = list(keys)
        check_keys("remove", keys)
        self._quarantine.discard(keys)
        groups = self._groups(keys) or {}
        removed = 0
        try:
            client = self._backend.client()
            for gs in groups.values():
                for g in gs:
                    for k in g.keys(keys):
                        n = client.unlink(g.prefix + "d:" + k, g.prefix + "m:" + k)
                        if type(n) is not int:
                            self._count(unexpected_replies=1)
                        removed += int(type(n) is int and n > 0)
        except _REDIS_PY_FAULTS as exc:
            self._last_error = f"remove: {type(exc).__name__}: {exc}"[:200]
            self._count(reply_errors=1)
        return removed

    def clear(self, startswith: str = "") -> None:
        """Drop this tier's objects: the Redis keys under `key_prefix` only (never FLUSHDB; other data on
        the server is untouched). With `startswith`, only objects whose umbp key starts with it, e.g.
        "umbp:v1:<namespace>:" for one model. Best effort: an unreachable server keeps its keys."""
        self._quarantine.clear()
        pattern = self._clear_pattern(startswith)
        try:
            for client in self._backend.primaries():
                _unlink_matching(client, pattern)
        except _REDIS_PY_FAULTS as exc:
            self._last_error = f"clear: {type(exc).__name__}: {exc}"[:200]
            self._count(reply_errors=1)

    def _clear_pattern(self, startswith: str) -> str:
        esc = _glob_escape
        tag = "{*}" if isinstance(self._backend, Cluster) else ""
        if not startswith:
            return esc(self.config.redis_prefix) + "*"
        return f"{esc(self.config.redis_prefix)}{tag}[dm]:{esc(startswith)}*"

    def scan_objects(
        self, startswith: str = "", sizes: bool = True, limit: int | None = None, batch: int = 1000
    ) -> Iterator[tuple[str, int | None]]:
        """(umbp key, stored value bytes or None) of every visible object (marker key present) on every
        master, for operators (`umbp stats`); SCAN, so the server keeps serving. With sizes, one pipelined
        STRLEN per `batch` keys; a value of 0 bytes means its marker has no value (healed on next put).
        Stops after `limit` objects. Network errors raise: this is a tool, not the serving path."""
        marker = _glob_escape(self.config.redis_prefix) + (
            "{*}" if isinstance(self._backend, Cluster) else ""
        )
        pattern = f"{marker}m:{_glob_escape(startswith)}*"
        seen = 0
        for client in self._backend.primaries():
            names: list[bytes] = []
            for name in _scan(client, pattern, batch, _page_budget(client, batch)):
                names.append(name)
                if len(names) == batch:
                    yield from self._sized(client, names, sizes)
                    seen += len(names)
                    names = []
                    if limit is not None and seen >= limit:
                        return
            yield from self._sized(client, names, sizes)
            seen += len(names)
            if limit is not None and seen >= limit:
                return

    def _sized(
        self, client: redis.Redis, names: list[bytes], sizes: bool
    ) -> Iterator[tuple[str, int | None]]:
        split = [self._split_marker(n) for n in names]  # (everything before "m:", the umbp key)
        lengths: list[int | None] = [None] * len(names)
        if sizes and names:
            pipe = client.pipeline(transaction=False)
            for head, key in split:
                pipe.strlen(head + b"d:" + key)
            lengths = pipe.execute()
            if len(lengths) != len(names) or not all(type(n) is int and n >= 0 for n in lengths):
                raise ScanError("STRLEN: a reply that is not a length")
        for (_, key), n in zip(split, lengths, strict=True):
            yield key.decode(errors="replace"), n

    def scan_namespaces(self, limit: int | None = None, batch: int = 1000) -> dict[str, int]:
        """Objects (markers) per value namespace under key_prefix, this tier's own included: "" for
        unauthenticated values, "t<16 hex>" for each tenant key's namespace. One SCAN pass; for operators
        (`umbp stats`): a namespace sealed with a key this tier was not given can be counted, never read."""
        prefix = self.config.key_prefix.encode()
        counts: dict[str, int] = {}
        seen = 0
        for client in self._backend.primaries():
            pattern = _glob_escape(self.config.key_prefix) + "*"
            for name in _scan(client, pattern, batch, _page_budget(client, batch)):
                seen += 1
                ns = _marker_namespace(name[len(prefix) :])
                if ns is not None:
                    counts[ns] = counts.get(ns, 0) + 1
                if limit is not None and seen >= limit:
                    return counts
        return counts

    def _split_marker(self, name: bytes) -> tuple[bytes, bytes]:
        """`<prefix>[{tag}]m:<key>` -> (`<prefix>[{tag}]`, `<key>`)."""
        at = len(self.config.redis_prefix.encode())
        if name[at : at + 1] == b"{":
            at = name.index(b"}", at) + 1
        return name[:at], name[at + 2 :]


_TENANT_NS = re.compile(rb"(t[0-9a-f]{16}):")


def _marker_namespace(rest: bytes) -> str | None:
    """The namespace of a key name after key_prefix if it is a marker (`[t<16 hex>:][{tag}]m:<key>`)."""
    ns = ""
    m = _TENANT_NS.match(rest)
    if m:
        ns, rest = m.group(1).decode(), rest[m.end() :]
    if rest[:1] == b"{":
        end = rest.find(b"}")
        rest = rest[end + 1 :] if end > 0 else b""
    return ns if rest[:2] == b"m:" else None


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def _page_budget(client: redis.Redis, count: int) -> int:
    """How many SCAN pages a full scan of `client`'s server may take: a page ends after `count` keys (of
    any name) or 10 x `count` empty slots, so a server of N keys needs about N / count pages, plus its
    empty slots; 16 times that and 1024 more is room enough. MAX_SCAN_CALLS when DBSIZE is not answered
    (a user whose ACL refuses it)."""
    try:
        keys = client.dbsize()
    except _REDIS_PY_FAULTS:
        return MAX_SCAN_CALLS
    if type(keys) is not int or keys < 0:
        return MAX_SCAN_CALLS
    return min(MAX_SCAN_CALLS, 16 * (keys // count + 1) + 1024)


def _scan(client: redis.Redis, pattern: str, count: int, pages: int = MAX_SCAN_CALLS) -> Iterator[bytes]:
    """The key names SCAN MATCH `pattern` finds on `client`'s server, page by page; ScanError when the
    replies are not [cursor, [names]], a cursor comes back (the iteration would never end), or after
    `pages` pages. redis-py's scan_iter trusts the server to reach cursor 0."""
    cursor, seen = 0, set()
    for _ in range(pages):
        try:
            cursor, names = client.scan(cursor=cursor, match=pattern, count=count)
        except (TypeError, ValueError, AttributeError, IndexError):  # redis-py's reply callback unpacks it
            raise ScanError("SCAN: a reply that is not [cursor, [names]]") from None
        if type(cursor) is not int or cursor < 0 or type(names) is not list:
            raise ScanError("SCAN: a reply that is not [cursor, [names]]")
        if not all(type(n) is bytes for n in names):
            raise ScanError("SCAN: a key name that is not a string")
        yield from names
        if cursor == 0:
            return
        if cursor in seen:
            raise ScanError("SCAN: the server returned the same cursor twice; its scan would never end")
        seen.add(cursor)
    raise ScanError(f"SCAN: not finished after {pages} pages (more than its key count calls for)")


def _unlink_matching(client: redis.Redis, pattern: str, batch: int = 512) -> None:
    """SCAN + UNLINK one key per command (keys of one server may sit in different cluster slots)."""
    pipe = client.pipeline(transaction=False)
    n = 0
    for name in _scan(client, pattern, 1000):
        pipe.unlink(name)
        n += 1
        if n % batch == 0:
            pipe.execute()
    pipe.execute()
