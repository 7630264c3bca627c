"""RemoteConfig: the validated settings of the shared Redis/Valkey tier (`umbp.pool.remote.RedisTier`).

Why a separate, strict config: the tier is configured from an engine's free-form JSON (vLLM's
`kv_connector_extra_config`). A typo there ("quarantine_sec") must stop start-up with an error naming the
key, not silently fall back to a default; a password must never appear in an error, a log or `stats()`.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import unquote, urlsplit

from umbp.pool.errors import OptionValueError, UnknownOptionError

MiB = 1 << 20

OPTIONS: dict[str, str] = {
    "url": "redis://[user[:password]@]host[:port][/db] or rediss://... for TLS (default redis://127.0.0.1:6379/0)",
    "urls": "list of URLs: the cluster's startup nodes (cluster mode), or a one-element list",
    "cluster": "true: Redis Cluster (hash slots, MOVED/ASK followed by redis-py); false: one server (default)",
    "username": "ACL user name (overrides the URL's)",
    "password": "password (overrides the URL's); prefer password_env",
    "password_env": "name of an environment variable holding the password (keeps it out of config files)",
    "tls": "true: connect with TLS (implied by rediss:// URLs)",
    "tls_ca_file": "CA bundle that signed the server certificate (PEM)",
    "tls_cert_file": "client certificate (PEM), for servers that require client auth",
    "tls_key_file": "client private key (PEM)",
    "tls_verify": "verify the server certificate (default true)",
    "tls_check_hostname": "check the certificate's host name (default true; needs tls_verify)",
    "connect_timeout_s": "TCP/TLS connect + handshake timeout in seconds (default 0.5)",
    "timeout_s": "per socket read/write timeout in seconds (default 2.0)",
    "max_connections": "connections per server in the client pool (default 32)",
    "key_prefix": "prefix of every Redis key this tier writes; clear() stays inside it (default 'umbp:')",
    "ttl_s": "expire objects this many seconds after they were stored (default none)",
    "quarantine_s": "after a failed load, report the key absent for this long (default 30; 0 = off)",
    "quarantine_max_keys": "bound on quarantined keys kept in memory (default 100000)",
    "retry_interval_s": "after a connection failure, treat the server as down this long, then reconnect (default 1.0)",
    "write_queue_bytes": "bound on bytes queued by put_async; a full queue drops saves (default 256 MiB)",
    "write_batch": "objects per background write round trip (default 16)",
    "hash_tag_chars": "cluster only: last N hex chars of a key form its hash tag, 16**N slots (default 2)",
}


def _reject_unknown(options: Mapping[str, Any]) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if not unknown:
        return
    hints = [m for k in unknown for m in difflib.get_close_matches(k, OPTIONS, n=1)]
    hint = f" (did you mean {', '.join(repr(h) for h in hints)}?)" if hints else ""
    raise UnknownOptionError(
        f"umbp: unknown remote tier option(s) {', '.join(repr(k) for k in unknown)}{hint}; "
        f"valid options: {', '.join(OPTIONS)}"
    )


def _bad(name: str, value: Any, want: str) -> OptionValueError:
    shown = "<hidden>" if "password" in name else repr(value)
    return OptionValueError(f"umbp: remote option {name} must be {want}, got {shown}")


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        return value.lower() in ("true", "1", "yes", "on")
    raise _bad(name, value, "true or false")


def _as_number(name: str, value: Any, *, minimum: float, integer: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _bad(name, value, f"a number >= {minimum}")
    try:
        num = float(value)
    except ValueError:
        raise _bad(name, value, f"a number >= {minimum}") from None
    if num != num or num < minimum or (integer and num != int(num)):
        raise _bad(name, value, f"{'an integer' if integer else 'a number'} >= {minimum}")
    return int(num) if integer else num


def _as_str(name: str, value: Any, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not allow_empty):
        raise _bad(name, value, "a non-empty string")
    return value


@dataclass(frozen=True)
class Endpoint:
    """One server address parsed from a URL (credentials are kept apart, in RemoteConfig)."""

    host: str
    port: int
    db: int = 0

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class RemoteConfig:
    """Settings of RedisTier; build it with `from_options` (validates) or directly (then call `validate`)."""

    urls: tuple[str, ...] = ("redis://127.0.0.1:6379/0",)
    cluster: bool = False
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    tls_check_hostname: bool = True
    connect_timeout_s: float = 0.5
    timeout_s: float = 2.0
    max_connections: int = 32
    key_prefix: str = "umbp:"
    ttl_s: float | None = None
    quarantine_s: float = 30.0
    quarantine_max_keys: int = 100_000
    retry_interval_s: float = 1.0
    write_queue_bytes: int = 256 * MiB
    write_batch: int = 16
    hash_tag_chars: int = 2

    def __repr__(self) -> str:  # never show the password
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["urls"] = tuple(redact_url(u) for u in self.urls)
        shown["password"] = "<hidden>" if self.password else None
        return "RemoteConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RemoteConfig:
        """Build from a config mapping; unknown keys are rejected by name, every value is checked."""
        _reject_unknown(options)
        kw: dict[str, Any] = {}
        _urls_from(options, kw)
        for name in ("cluster", "tls", "tls_verify", "tls_check_hostname"):
            if name in options:
                kw[name] = _as_bool(name, options[name])
        for name in ("username", "password", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            if options.get(name) is not None:
                kw[name] = _as_str(name, options[name])
        if "key_prefix" in options:
            kw["key_prefix"] = _as_str("key_prefix", options["key_prefix"])
        if options.get("password_env") is not None:
            kw["password"] = _password_from_env(_as_str("password_env", options["password_env"]))
        _numbers_from(options, kw)
        return cls(**kw).validate()

    def validate(self) -> RemoteConfig:
        """Check cross-field rules; returns self (with the URL's TLS/credentials folded in)."""
        if not self.urls:
            raise OptionValueError("umbp: remote tier needs a server: set url (or urls for a cluster)")
        eps = [parse_url(u) for u in self.urls]
        if not self.cluster and len(eps) > 1:
            raise OptionValueError(
                f"umbp: remote option urls lists {len(eps)} servers but cluster is false; give one url, "
                "or set cluster=true for a Redis Cluster"
            )
        if self.cluster and any(e.db for e in eps):
            raise OptionValueError("umbp: Redis Cluster has only database 0; drop the /db from the cluster urls")
        if "{" in self.key_prefix or "}" in self.key_prefix:
            raise _bad("key_prefix", self.key_prefix, "free of '{' and '}' (they would change hash slots)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise OptionValueError("umbp: remote options tls_cert_file and tls_key_file go together; give both")
        if self.tls_check_hostname and not self.tls_verify:
            return replace(self, tls_check_hostname=False).validate()
        if any(u.startswith("rediss://") for u in self.urls) and not self.tls:
            return replace(self, tls=True).validate()
        return self._with_url_credentials()

    def _with_url_credentials(self) -> RemoteConfig:
        parts = urlsplit(self.urls[0])
        user = unquote(parts.username) if parts.username else None
        pwd = unquote(parts.password) if parts.password else None
        changes = {}
        if self.username is None and user:
            changes["username"] = user
        if self.password is None and pwd:
            changes["password"] = pwd
        return replace(self, **changes) if changes else self

    @property
    def endpoints(self) -> list[Endpoint]:
        return [parse_url(u) for u in self.urls]

    def summary(self) -> dict[str, Any]:
        """What stats() shows: the settings without any secret."""
        return {"urls": [redact_url(u) for u in self.urls], "cluster": self.cluster, "tls": self.tls,
                "auth": "password" if self.password else "none", "user": self.username,
                "key_prefix": self.key_prefix, "ttl_s": self.ttl_s, "quarantine_s": self.quarantine_s,
                "timeout_s": self.timeout_s, "connect_timeout_s": self.connect_timeout_s}


def _urls_from(options: Mapping[str, Any], kw: dict[str, Any]) -> None:
    if "url" in options and "urls" in options:
        raise OptionValueError("umbp: give remote option url or urls, not both")
    if "url" in options:
        kw["urls"] = (_as_str("url", options["url"]),)
    elif "urls" in options:
        urls = options["urls"]
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        if not isinstance(urls, list | tuple) or not urls:
            raise _bad("urls", urls, "a non-empty list of redis:// URLs")
        kw["urls"] = tuple(_as_str("urls", u) for u in urls)


_NUMBERS: dict[str, tuple[float, bool]] = {  # name -> (minimum, integer)
    "connect_timeout_s": (0.001, False), "timeout_s": (0.001, False), "max_connections": (1, True),
    "ttl_s": (0.001, False), "quarantine_s": (0.0, False), "quarantine_max_keys": (1, True),
    "retry_interval_s": (0.0, False), "write_queue_bytes": (0, True), "write_batch": (1, True),
    "hash_tag_chars": (1, True),
}


def _numbers_from(options: Mapping[str, Any], kw: dict[str, Any]) -> None:
    for name, (minimum, integer) in _NUMBERS.items():
        if name in options and not (name == "ttl_s" and options[name] is None):
            kw[name] = _as_number(name, options[name], minimum=minimum, integer=integer)
    if kw.get("hash_tag_chars", 2) > 4:
        raise _bad("hash_tag_chars", kw["hash_tag_chars"], "1, 2, 3 or 4 (16**N hash slots)")


def _password_from_env(var: str) -> str:
    value = os.environ.get(var)
    if not value:
        raise OptionValueError(f"umbp: remote option password_env names ${var}, which is not set or empty")
    return value


def redact_url(url: str) -> str:
    """The URL with any password replaced by '***' (for errors, logs and stats)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return parts._replace(netloc=f"{user}:***@{host}{port}").geturl()


def parse_url(url: str) -> Endpoint:
    """host, port and db of a redis:// or rediss:// URL; a clear error for anything else."""
    shown = redact_url(url)
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise OptionValueError(
            f"umbp: remote url {shown!r} must start with redis:// or rediss:// (TLS), e.g. redis://127.0.0.1:6379/0"
        )
    try:
        port = parts.port or 6379
    except ValueError:
        raise OptionValueError(f"umbp: remote url {shown!r} has a bad port") from None
    if not parts.hostname:
        raise OptionValueError(f"umbp: remote url {shown!r} has no host")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise OptionValueError(f"umbp: remote url {shown!r}: the path must be a database number, e.g. /0")
    return Endpoint(parts.hostname, port, int(path) if path else 0)
