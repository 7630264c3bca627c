"""RemoteConfig: the validated settings of the shared Redis/Valkey tier (`umbp.pool.remote.tier.RedisTier`).

Why a separate, strict config: the tier is configured from an engine's free-form JSON (vLLM's
`kv_connector_extra_config`). A typo there ("quarantine_sec") must stop start-up with an error naming the
key, not silently fall back to a default; a password must never appear in an error, a log or `stats()`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
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
    "timeout_s": "deadline of one call (lookup, load or save batch) in seconds, plus its bytes at "
    "min_throughput_mib_s (default 2.0)",
    "min_throughput_mib_s": "slowest transfer a call waits for: its deadline grows by its bytes at this rate "
    "(default 64)",
    "max_connections": "connections per server in the client pool (default 32)",
    "key_prefix": "prefix of every Redis key this tier writes; clear() stays inside it (default 'umbp:')",
    "ttl_s": "expire objects this many seconds after they were stored (default none)",
    "quarantine_s": "after a failed load, report the key absent for this long (default 30; 0 = off)",
    "quarantine_max_keys": "bound on quarantined keys kept in memory (default 100000)",
    "retry_interval_s": "after a connection failure, treat the server as down this long, then reconnect (default 1.0)",
    "write_queue_bytes": "bound on bytes queued by put_async; a full queue drops saves (default 256 MiB)",
    "write_batch": "objects per background write round trip (default 16)",
    "hash_tag_chars": "cluster only: last N hex chars of a key form its hash tag, 16**N slots (default 2)",
    "auth_key_env": "name of an environment variable holding this tenant's secret (>= 16 bytes): values are "
    "MACed, and the Redis namespace is derived from it (see docs/remote.md)",
    "auth_key_file": "path of a file holding this tenant's secret (instead of auth_key_env)",
    "auth_old_key_envs": "key rotation: environment variables holding previous secrets, accepted for reads",
    "auth_old_key_files": "key rotation: files holding previous secrets, accepted for reads",
    "auth_mac": "'auto' (default: aes-gmac when the cryptography package is installed, else hmac-sha256), "
    "'hmac-sha256' or 'aes-gmac'",
    "encrypt": "true: AES-GCM encryption at rest (needs the auth key and the remote-crypto extra)",
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


def _as_number(
    name: str,
    value: Any,
    *,
    minimum: float,
    maximum: float = math.inf,
    integer: bool = False,
    strings: bool = True,
) -> Any:
    """A finite number in [minimum, maximum] (an integer where `integer`); a bool, NaN, an infinity or a
    number out of range is an error naming the option."""
    kinds = int | float | str if strings else int | float
    want = f"{'an integer' if integer else 'a number'} >= {minimum}"
    if maximum != math.inf:
        want += f" and <= {maximum:g}"
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise _bad(name, value, want)
    try:
        num = int(value) if integer and isinstance(value, int) else float(value)
    except (ValueError, OverflowError):
        raise _bad(name, value, want) from None
    if not math.isfinite(num) or num < minimum or num > maximum or (integer and num != int(num)):
        raise _bad(name, value, want)
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
    min_throughput_mib_s: float = 64.0
    # the tenant's secrets as bytes (read from auth_key_env/auth_key_file at from_options), never shown
    auth_key: bytes | None = None
    auth_old_keys: tuple[bytes, ...] = ()
    auth_mac: str = "auto"
    encrypt: bool = False

    def __repr__(self) -> str:  # never show the password or a secret
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["urls"] = tuple(redact_url(u) for u in self.urls)
        shown["password"] = "<hidden>" if self.password else None
        shown["auth_key"] = "<hidden>" if self.auth_key else None
        shown["auth_old_keys"] = f"<{len(self.auth_old_keys)} hidden>"
        return "RemoteConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    __str__ = __repr__

    def deadline_s(self, nbytes: int) -> float:
        """How long one call moving `nbytes` of payload may take in all: timeout_s, plus the bytes at
        min_throughput_mib_s. A whole-call deadline, not a per-receive timeout: a server that drips a
        byte at a time must not hold a call for longer than this."""
        return self.timeout_s + nbytes / (self.min_throughput_mib_s * MiB)

    @property
    def redis_prefix(self) -> str:
        """The prefix of every Redis key this tier writes: key_prefix, then (with an auth key) the
        tenant's namespace, derived from its secret so that no one without it can name its keys."""
        if self.auth_key is None:
            return self.key_prefix
        from umbp.pool.remote.auth import namespace_of

        return f"{self.key_prefix}{namespace_of(self.auth_key)}:"

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
        _auth_from(options, kw)
        return cls(**kw).validate()

    def validate(self) -> RemoteConfig:
        """Check cross-field rules; returns self (with the URL's TLS/credentials folded in)."""
        if not self.urls:
            raise OptionValueError("umbp: remote tier needs a server: set url (or urls for a cluster)")
        _check_fields(self)
        eps = [parse_url(u) for u in self.urls]
        if not self.cluster and len(eps) > 1:
            raise OptionValueError(
                f"umbp: remote option urls lists {len(eps)} servers but cluster is false; give one url, "
                "or set cluster=true for a Redis Cluster"
            )
        if self.cluster and any(e.db for e in eps):
            raise OptionValueError(
                "umbp: Redis Cluster has only database 0; drop the /db from the cluster urls"
            )
        if "{" in self.key_prefix or "}" in self.key_prefix:
            raise _bad("key_prefix", self.key_prefix, "free of '{' and '}' (they would change hash slots)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise OptionValueError(
                "umbp: remote options tls_cert_file and tls_key_file go together; give both"
            )
        if self.encrypt and self.auth_key is None:
            raise OptionValueError(
                "umbp: remote option encrypt needs a tenant secret: set auth_key_env or auth_key_file"
            )
        if self.auth_old_keys and self.auth_key is None:
            raise OptionValueError(
                "umbp: remote options auth_old_key_* need the current key too (auth_key_env or auth_key_file)"
            )
        if self.tls_check_hostname and not self.tls_verify:
            return replace(self, tls_check_hostname=False).validate()
        if any(u.startswith("rediss://") for u in self.urls) and not self.tls:
            return replace(self, tls=True).validate()
        return self._with_url_credentials()

    def _with_url_credentials(self) -> RemoteConfig:
        user, pwd, _ = split_credentials(self.urls[0])
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
        return {
            "urls": [redact_url(u) for u in self.urls],
            "cluster": self.cluster,
            "tls": self.tls,
            "auth": "password" if self.password else "none",
            "user": self.username,
            "key_prefix": self.key_prefix,
            "ttl_s": self.ttl_s,
            "quarantine_s": self.quarantine_s,
            "timeout_s": self.timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
            "values": "unauthenticated"
            if self.auth_key is None
            else "encrypted"
            if self.encrypt
            else f"authenticated ({self.auth_mac})",
        }


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


# name -> (minimum, maximum, integer). The maxima are what the tier can honour: a timeout becomes
# milliseconds for poll() (a C int), a TTL becomes Redis' PX milliseconds; beyond them a value would pass
# here and then break every call.
_NUMBERS: dict[str, tuple[float, float, bool]] = {
    "connect_timeout_s": (0.001, 3600.0, False),
    "timeout_s": (0.001, 3600.0, False),
    "max_connections": (1, 65536, True),
    "ttl_s": (0.001, 10 * 365 * 86400.0, False),
    "quarantine_s": (0.0, 30 * 86400.0, False),
    "quarantine_max_keys": (1, 100_000_000, True),
    "retry_interval_s": (0.0, 3600.0, False),
    "write_queue_bytes": (4096, 1 << 40, True),
    "write_batch": (1, 65536, True),
    "hash_tag_chars": (1, 4, True),
    "min_throughput_mib_s": (0.001, 1e6, False),
}


def _numbers_from(options: Mapping[str, Any], kw: dict[str, Any]) -> None:
    for name, (minimum, maximum, integer) in _NUMBERS.items():
        if name in options and not (name == "ttl_s" and options[name] is None):
            kw[name] = _as_number(name, options[name], minimum=minimum, maximum=maximum, integer=integer)


def _check_fields(cfg: RemoteConfig) -> None:
    """Every field of a RemoteConfig built directly (not through from_options) is checked too."""
    for name, (minimum, maximum, integer) in _NUMBERS.items():
        value = getattr(cfg, name)
        if not (name == "ttl_s" and value is None):
            _as_number(name, value, minimum=minimum, maximum=maximum, integer=integer, strings=False)
    for name in ("cluster", "tls", "tls_verify", "tls_check_hostname", "encrypt"):
        if not isinstance(getattr(cfg, name), bool):
            raise _bad(name, getattr(cfg, name), "true or false")
    if cfg.auth_mac not in AUTH_MACS:
        raise _bad("auth_mac", cfg.auth_mac, " or ".join(repr(m) for m in AUTH_MACS))
    if not isinstance(cfg.key_prefix, str) or not cfg.key_prefix:
        raise _bad("key_prefix", cfg.key_prefix, "a non-empty string")


AUTH_MACS = ("auto", "hmac-sha256", "aes-gmac")
MIN_SECRET_BYTES = 16


def _auth_from(options: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """The tenant's secret (and previous ones, for reads during a rotation) from env vars or files."""
    if options.get("auth_key_env") is not None and options.get("auth_key_file") is not None:
        raise OptionValueError("umbp: give remote option auth_key_env or auth_key_file, not both")
    if options.get("auth_key_env") is not None:
        kw["auth_key"] = _secret_from_env("auth_key_env", options["auth_key_env"])
    if options.get("auth_key_file") is not None:
        kw["auth_key"] = _secret_from_file("auth_key_file", options["auth_key_file"])
    old: list[bytes] = []
    for name, read in (("auth_old_key_envs", _secret_from_env), ("auth_old_key_files", _secret_from_file)):
        values = options.get(name)
        if values is None:
            continue
        if isinstance(values, str):
            values = [v.strip() for v in values.split(",") if v.strip()]
        if not isinstance(values, list | tuple):
            raise _bad(name, values, "a list of names")
        old.extend(read(name, v) for v in values)
    if old:
        kw["auth_old_keys"] = tuple(old)
    if options.get("auth_mac") is not None:
        kw["auth_mac"] = _as_str("auth_mac", options["auth_mac"]).lower()
    if "encrypt" in options:
        kw["encrypt"] = _as_bool("encrypt", options["encrypt"])


def _secret_from_env(option: str, var: Any) -> bytes:
    var = _as_str(option, var)
    value = os.environ.get(var)
    if not value:
        raise OptionValueError(f"umbp: remote option {option} names ${var}, which is not set or empty")
    return _long_enough(option, value.encode())


def _secret_from_file(option: str, path: Any) -> bytes:
    path = _as_str(option, path)
    try:
        with open(path, "rb") as f:
            value = f.read(1 << 16).strip()
    except OSError as exc:
        raise OptionValueError(
            f"umbp: remote option {option}: cannot read {path!r}: {exc.strerror}"
        ) from None
    return _long_enough(option, value)


def _long_enough(option: str, secret: bytes) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise OptionValueError(
            f"umbp: remote option {option}: the secret must be at least {MIN_SECRET_BYTES} "
            f"bytes (it has {len(secret)}; e.g. `openssl rand -hex 32`)"
        )
    return secret


def _password_from_env(var: str) -> str:
    value = os.environ.get(var)
    if not value:
        raise OptionValueError(f"umbp: remote option password_env names ${var}, which is not set or empty")
    return value


_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&]*", re.IGNORECASE)


def split_credentials(url: str) -> tuple[str | None, str | None, str]:
    """(user, password, the URL without them). The user info ends at the LAST '@' (before any later
    '/', '?' or '#' only if that '@' is not there): a password with an unencoded '#', '/', '?', '@' or ':'
    is still taken whole as the password, never left in a host, path or fragment where an error or a log
    would show it."""
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    if not sep or at < 0:
        return None, None, url
    info, host = rest[:at], rest[at + 1 :]
    user, colon, pwd = info.partition(":")
    return (unquote(user) or None, unquote(pwd) if colon and pwd else None, f"{scheme}://{host}")


def redact_url(url: str) -> str:
    """The URL with any password replaced by '***' and any query dropped (for errors, logs and stats)."""
    url = _QUERY_PASSWORD.sub(r"\1***", url)  # first: its value may hold an '@' that looks like user info
    user, pwd, bare = split_credentials(url)
    if "?" in bare:  # redis-py style ?password=... must not show either
        bare = bare.split("?", 1)[0] + "?***"
    if pwd is None and user is None:
        return bare
    scheme, _, host = bare.partition("://")
    shown_user = (user or "") if pwd is not None else "***"
    return f"{scheme}://{shown_user}{':***' if pwd is not None else ''}@{host}"


def redact_options(value: Any) -> str:
    """repr() of a remote option value (a URL, a list, a dict) with every password hidden: for errors
    about a malformed `remote` setting, which may hold credentials."""
    if isinstance(value, str):
        return repr(redact_url(value))
    if isinstance(value, Mapping):
        return (
            "{"
            + ", ".join(
                f"{k!r}: {'<hidden>' if 'password' in str(k) else redact_options(v)}"
                for k, v in value.items()
            )
            + "}"
        )
    if isinstance(value, list | tuple):
        return "[" + ", ".join(redact_options(v) for v in value) + "]"
    return repr(value) if isinstance(value, int | float | bool | type(None)) else f"<{type(value).__name__}>"


def parse_url(url: str) -> Endpoint:
    """host, port and db of a redis:// or rediss:// URL; a clear error for anything else."""
    shown = redact_url(url)
    parts = urlsplit(split_credentials(url)[2])
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
