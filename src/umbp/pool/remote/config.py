"""RemoteConfig: the validated settings of the shared Redis/Valkey tier (`umbp.pool.remote.tier.RedisTier`).

Why a strict config: the tier is configured from an engine's free-form JSON (vLLM's
`kv_connector_extra_config`). A typo there ("quarantine_sec") must stop start-up with an error naming the
key, not silently fall back to a default; a password or tenant secret must never appear in an error, a log,
a repr or `stats()`.

It is an option set of the one options layer (umbp.pool.options): strict types and ranges, "did you mean"
for unknown keys, the key's name in every error, and one help string per option from which docs/remote.md's
table is generated. A few keys only say where a value comes from (`url` folds into `urls`, `password_env`
into `password`, `auth_key_env`/`auth_key_file` into the secret `auth_key`); `check` resolves them once, and
resolving again (as `dataclasses.replace` does) changes nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

from umbp.pool.errors import OptionValueError
from umbp.pool.options import Invalid, Options, hide_secret, option, option_set
from umbp.redact import HIDDEN, looks_like_env_name, looks_like_path, redact_url, shown_value
from umbp.regular_file import open_regular

MiB = 1 << 20
DEFAULT_URL = "redis://127.0.0.1:6379/0"
AUTH_MACS = ("auto", "hmac-sha256", "aes-gmac")
MIN_SECRET_BYTES = 16
MAX_KEY_FILE_BYTES = 64 << 10  # a key file holds one secret
# The numeric maxima are what the tier can honour: a timeout becomes milliseconds for poll() (a C int), a
# TTL becomes Redis' PX milliseconds; beyond them a value would pass here and then break every call.
_HOUR_S = 3600.0
_TTL_MAX_S = 10 * 365 * 86400.0


@dataclass(frozen=True)
class Endpoint:
    """One server address parsed from a URL (credentials are kept apart, in RemoteConfig)."""

    host: str
    port: int
    db: int = 0

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"


# ---- converters (an option's own rule; Invalid says what the value must be) ------------------------------


def _one_url(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid("a non-empty string (a redis:// or rediss:// URL)")
    problem = url_problem(value)
    if problem:
        raise Invalid("", reason=problem)
    return value


def _url_or_none(value: Any) -> str | None:
    return None if value is None else _one_url(value)


def _url_list(value: Any) -> tuple[str, ...] | None:
    """A list of URLs, or one string of comma-separated URLs (an environment variable's natural form)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [u.strip() for u in value.split(",") if u.strip()]
    if not isinstance(value, list | tuple) or not value:
        raise Invalid("a non-empty list of redis:// URLs (or one comma-separated string)")
    return tuple(_one_url(u) for u in value)


def _name_list(value: Any) -> tuple[str, ...]:
    """Names of environment variables or files: a list, or one comma-separated string."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
        raise Invalid("a list of names (or one comma-separated string)")
    return tuple(value)


def _key_prefix(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid("a non-empty string")
    if "{" in value or "}" in value:
        raise Invalid("free of '{' and '}' (they would change hash slots)")
    return value


def _auth_mac(value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() in AUTH_MACS:
        return value.strip().lower()
    raise Invalid(" or ".join(repr(m) for m in AUTH_MACS))


def _show_urls(value: Any) -> str:
    return shown_value(value, "urls")


@option_set
class RemoteConfig(Options):
    """Settings of RedisTier; build it with `from_options(mapping)` or with keyword arguments (both check
    every value). `auth_key`/`auth_old_keys` hold the tenant's secrets, read from the places the auth_*
    options name; they are never shown."""

    where: ClassVar[str] = "remote tier option"

    url: str | None = option(
        None,
        help="`redis://[user[:password]@]host[:port][/db]`, `rediss://` for TLS; becomes `urls`",
        convert=_url_or_none,
        show=_show_urls,
        type_doc="URL",
        default_doc=f"`{DEFAULT_URL}`",
    )
    urls: tuple[str, ...] | None = option(
        None,
        help="list (or comma-separated string) of URLs: a cluster's startup nodes, or one server",
        convert=_url_list,
        show=_show_urls,
        type_doc="list of URLs",
        default_doc="`url`",
    )
    cluster: bool = option(
        False, help="Redis Cluster mode (`urls`/`url` of one or more masters; database 0 only)"
    )
    username: str | None = option(None, help="ACL user name (overrides the URL's)", nonempty=True)
    password: str | None = option(
        None, help="password (overrides the URL's); prefer `password_env`", nonempty=True, show=hide_secret
    )
    password_env: str | None = option(
        None,
        help="name of an environment variable holding the password (keeps it out of config files); give it "
        "or `password`",
        nonempty=True,
    )
    tls: bool = option(False, help="connect with TLS (implied by `rediss://` URLs)")
    tls_ca_file: str | None = option(
        None,
        help="CA bundle that signed the server's certificate (PEM); default: the system's CAs",
        nonempty=True,
    )
    tls_cert_file: str | None = option(
        None,
        help="client certificate (PEM), for `tls-auth-clients yes`; with `tls_key_file` (both or neither)",
        nonempty=True,
    )
    tls_key_file: str | None = option(None, help="the client certificate's private key (PEM)", nonempty=True)
    tls_verify: bool = option(True, help="verify the server's certificate")
    tls_check_hostname: bool = option(
        True, help="check the certificate's host name (off when `tls_verify` is off)"
    )
    connect_timeout_s: float = option(
        0.5,
        help="timeout of the TCP connect, and of the TLS handshake as a whole (the set-up commands after it are "
        "held to timeout_s)",
        minimum=0.001,
        maximum=_HOUR_S,
    )
    timeout_s: float = option(
        2.0,
        help="deadline of one call (a lookup, a load or save batch); a call not done by then is a miss / a "
        "dropped save",
        minimum=0.001,
        maximum=_HOUR_S,
    )
    min_throughput_mib_s: float = option(
        64.0,
        help="the deadline grows by the call's payload bytes at this rate, so a large batch gets time to move "
        "its bytes while a dripping server cannot stretch a small one",
        minimum=0.001,
        maximum=1e6,
    )
    auth_key_env: str | None = option(
        None,
        help="name of an environment variable holding this tenant's secret (at least 16 bytes; e.g. "
        "`openssl rand -hex 32`): values are MACed (or encrypted) and the Redis namespace is derived from "
        "it. See Authenticated and encrypted values",
        nonempty=True,
    )
    auth_key_file: str | None = option(
        None, help="path of a file holding this tenant's secret (instead of `auth_key_env`)", nonempty=True
    )
    auth_old_key_envs: tuple[str, ...] = option(
        (),
        help="key rotation: environment variables holding previous secrets, accepted for reads only",
        convert=_name_list,
        type_doc="list of names",
    )
    auth_old_key_files: tuple[str, ...] = option(
        (),
        help="key rotation: files holding previous secrets, accepted for reads only",
        convert=_name_list,
        type_doc="list of paths",
    )
    auth_mac: str = option(
        "auto",
        help="`auto` (AES-GMAC when the `cryptography` package is installed, else HMAC-SHA256), "
        "`hmac-sha256` or `aes-gmac`",
        convert=_auth_mac,
        type_doc="`auto`, `hmac-sha256`, `aes-gmac`",
    )
    encrypt: bool = option(
        False,
        help='AES-GCM encryption at rest (needs a secret and `pip install "umbp[remote-crypto]"`; a clear '
        "error without it)",
    )
    retry_interval_s: float = option(
        1.0,
        help="after a failure, how long a server is left alone before the next reconnect",
        minimum=0,
        maximum=_HOUR_S,
    )
    max_connections: int = option(32, help="connections per server, per process", minimum=1, maximum=65536)
    key_prefix: str = option(
        "umbp:",
        help="every Redis key starts with it; `clear()` never leaves it. Give deployments that must clear "
        "independently their own prefix",
        convert=_key_prefix,
        type_doc="string without `{` `}`",
    )
    ttl_s: float | None = option(
        None,
        help="objects (value and marker) expire this long after they were stored",
        minimum=0.001,
        maximum=_TTL_MAX_S,
    )
    quarantine_s: float = option(
        30.0,
        help="how long a key whose load failed reads absent (0: off)",
        minimum=0,
        maximum=30 * 86400.0,
    )
    quarantine_max_keys: int = option(
        100_000, help="bound on quarantined keys (oldest dropped first)", minimum=1, maximum=100_000_000
    )
    write_queue_bytes: int = option(
        256 * MiB,
        help="bound on bytes waiting in `put_async`'s queue: one arena of this size (whole 4 KiB pages; each "
        "queued copy takes whole pages), mapped once and reused, so copies do not page-fault; pages are "
        "mapped on first use and stay resident",
        minimum=4096,
        maximum=1 << 40,
    )
    write_batch: int = option(16, help="objects per background write round trip", minimum=1, maximum=65536)
    hash_tag_chars: int = option(
        2,
        help="cluster: hash tag = the key's last N characters, 16**N slots per cluster",
        minimum=1,
        maximum=4,
    )
    # The tenant's secrets as bytes, read from auth_key_env/auth_key_file (and the old ones) by check().
    # Not options: a secret is never written into a config mapping.
    auth_key: bytes | None = field(default=None, repr=False)
    auth_old_keys: tuple[bytes, ...] = field(default=(), repr=False)

    # ---- building ----------------------------------------------------------------------------------------

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> RemoteConfig:
        """Build from a config mapping; unknown keys are rejected by name, every value is checked."""
        given = dict(options or {})
        for a, b in (("url", "urls"), ("password", "password_env")):
            if given.get(a) is not None and given.get(b) is not None:
                raise cls.fail(f"give {cls.where} '{a}' or '{b}', not both")
        return super().from_options(given)

    def check(self) -> None:
        """Rules between options, and the values some options point at (URL, environment, files)."""
        self._resolve_urls()
        eps = [parse_url(u) for u in self.urls]
        if not self.cluster and len(eps) > 1:
            raise self.fail(
                f"{self.where} 'urls' lists {len(eps)} servers but 'cluster' is false; give one url, or set "
                "cluster=true for a Redis Cluster"
            )
        if self.cluster and any(e.db for e in eps):
            raise self.fail("Redis Cluster has only database 0; drop the /db from the cluster urls")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise self.fail(f"{self.where}s 'tls_cert_file' and 'tls_key_file' go together; give both")
        if any(_scheme(u) == "rediss" for u in self.urls):  # as parsed: REDISS:// is TLS too
            self._set(tls=True)
        if not self.tls_verify:
            self._set(tls_check_hostname=False)
        self._resolve_credentials()
        self._resolve_secrets()
        if self.encrypt and self.auth_key is None:
            raise self.fail(
                f"{self.where} 'encrypt' needs a tenant secret: set auth_key_env or auth_key_file"
            )
        if self.auth_old_keys and self.auth_key is None:
            raise self.fail(
                f"{self.where}s 'auth_old_key_envs'/'auth_old_key_files' need the current key too "
                "(auth_key_env or auth_key_file)"
            )

    def validate(self) -> RemoteConfig:
        """Construction has checked everything; kept for callers that validate explicitly."""
        return self

    def _set(self, **values: Any) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _resolve_urls(self) -> None:
        if self.url is not None and self.urls is not None and self.urls != (self.url,):
            raise self.fail(f"give {self.where} 'url' or 'urls', not both")
        if self.urls is None:
            self._set(urls=(self.url or DEFAULT_URL,))

    def _resolve_credentials(self) -> None:
        """password_env, then the URL's user info, fill what was not given explicitly."""
        if self.password is None and self.password_env is not None:
            value = os.environ.get(self.password_env)
            if not value:
                raise self.fail(_unset_env(self.where, "password_env", self.password_env))
            self._set(password=value)
        user, pwd, _ = split_credentials(self.urls[0])
        if self.username is None and user:
            self._set(username=user)
        if self.password is None and pwd:
            self._set(password=pwd)

    def _resolve_secrets(self) -> None:
        """The tenant's secret (and previous ones, for reads during a rotation) from env vars or files."""
        if self.auth_key_env is not None and self.auth_key_file is not None:
            raise self.fail(f"give {self.where} 'auth_key_env' or 'auth_key_file', not both")
        if self.auth_key is None:
            if self.auth_key_env is not None:
                self._set(auth_key=self._secret_from_env("auth_key_env", self.auth_key_env))
            elif self.auth_key_file is not None:
                self._set(auth_key=self._secret_from_file("auth_key_file", self.auth_key_file))
        elif not isinstance(self.auth_key, bytes):
            raise self.fail("RemoteConfig.auth_key must be bytes (the secret itself)")
        else:
            self._long_enough("auth_key", self.auth_key)
        if not self.auth_old_keys:
            old = [self._secret_from_env("auth_old_key_envs", v) for v in self.auth_old_key_envs]
            old += [self._secret_from_file("auth_old_key_files", p) for p in self.auth_old_key_files]
            self._set(auth_old_keys=tuple(old))

    @classmethod
    def _secret_from_env(cls, option: str, var: str) -> bytes:
        value = os.environ.get(var)
        if not value:
            raise cls.fail(_unset_env(cls.where, option, var))
        return cls._long_enough(option, value.encode())

    @classmethod
    def _secret_from_file(cls, option: str, path: str) -> bytes:
        """The secret in the file at `path`: a regular file of at most MAX_KEY_FILE_BYTES. Opened without
        blocking, so a FIFO (which would wait for a writer), a device (/dev/zero) or a huge file is refused
        at once instead of read."""
        try:
            value = _read_key_file(path)
        except OSError as exc:
            why = exc.strerror or str(exc)
            if looks_like_path(path):
                raise cls.fail(f"{cls.where} '{option}': cannot read {path!r}: {why}") from None
            raise cls.fail(
                f"{cls.where} '{option}': cannot read the file it names: {why}; the path is not shown "
                "because it does not look like one (give an absolute path, or one starting with ./): is it "
                "the secret itself?"
            ) from None
        return cls._long_enough(option, value.strip())

    @classmethod
    def _long_enough(cls, option: str, secret: bytes) -> bytes:
        if len(secret) < MIN_SECRET_BYTES:
            raise cls.fail(
                f"{cls.where} '{option}': the secret must be at least {MIN_SECRET_BYTES} bytes (it has "
                f"{len(secret)}; e.g. `openssl rand -hex 32`)"
            )
        return secret

    # ---- use -----------------------------------------------------------------------------------------------

    def __repr__(self) -> str:  # never show the password or a secret
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "auth_key":
                shown = "<hidden>" if value else "None"
            elif f.name == "auth_old_keys":
                shown = f"<{len(value)} hidden>"
            elif f.name == "password":
                shown = hide_secret(value)
            elif f.name == "username" and self._user_is_secret():
                shown = "<hidden>"
            else:
                shown = shown_value(value, f.name)
            parts.append(f"{f.name}={shown}")
        return f"RemoteConfig({', '.join(parts)})"

    __str__ = __repr__

    def _user_is_secret(self) -> bool:
        """A user name taken from a URL whose user info has no password ("redis://pw@host"): it may well
        be a password written without its ':', so like redact_url, reprs and stats never show it."""
        user, pwd, _ = split_credentials(self.urls[0])
        return self.username is not None and pwd is None and user == self.username

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
            "user": HIDDEN if self._user_is_secret() else self.username,
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


# ---- URLs: credentials apart, passwords hidden ------------------------------------------------------------


def _unset_env(where: str, option: str, name: str) -> str:
    """The message for an environment variable an option names that is not set: the name quoted only when it
    looks like one (a secret pasted where its variable's name belongs must not be echoed)."""
    if looks_like_env_name(name):
        return f"{where} '{option}' names ${name}, which is not set or empty"
    return (
        f"{where} '{option}' names an environment variable that is not set or empty; the name is not shown "
        "because it does not look like one (upper-case letters, digits and '_', e.g. UMBP_REDIS_PASSWORD): is "
        "it the secret itself?"
    )


def split_credentials(url: str) -> tuple[str | None, str | None, str]:
    """(user, password, the URL without them) of a URL with "://" (url_problem has rejected any other). The
    user info ends at the LAST '@' (before any later '/', '?' or '#' only if that '@' is not there): a
    password with an unencoded '#', '/', '?', '@' or ':' is still taken whole as the password, never left
    in a host, path or fragment where an error or a log would show it."""
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    if not sep or at < 0:
        return None, None, url
    info, host = rest[:at], rest[at + 1 :]
    user, colon, pwd = info.partition(":")
    return (unquote(user) or None, unquote(pwd) if colon and pwd else None, f"{scheme}://{host}")


def redact_options(value: Any) -> str:
    """repr() of a remote option value (a URL, a list, a dict) with every secret hidden: for errors about a
    malformed `remote` setting, which may hold credentials (umbp.redact.shown_value)."""
    return shown_value(value)


def _scheme(url: str) -> str:
    """The URL's scheme as parsed (lower-case, surrounding blanks ignored), "" if it has none."""
    try:
        return urlsplit(split_credentials(url)[2]).scheme
    except ValueError:
        return ""


_REDIS_SCHEME = re.compile(r"\s*rediss?://", re.IGNORECASE)


def url_problem(url: str) -> str | None:
    """What is wrong with a redis:// or rediss:// URL (None: nothing), with any password hidden."""
    shown = redact_url(url)
    if not _REDIS_SCHEME.match(url):  # checked on the text: "redis:/:pw@host" must not parse as a path
        return f"{shown!r} must start with redis:// or rediss:// (TLS), e.g. {DEFAULT_URL}"
    try:
        parts = urlsplit(split_credentials(url)[2])
    except ValueError:  # e.g. an unclosed IPv6 '['
        return f"{shown!r} is not a valid URL (host[:port] after the user info, e.g. {DEFAULT_URL})"
    if parts.scheme not in ("redis", "rediss"):
        return f"{shown!r} must start with redis:// or rediss:// (TLS), e.g. {DEFAULT_URL}"
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError:
        return f"{shown!r} has a bad port"
    if not parts.hostname:
        return f"{shown!r} has no host"
    path = parts.path.strip("/")
    if path and not path.isdigit():
        return f"{shown!r}: the path must be a database number, e.g. /0"
    return None


def parse_url(url: str) -> Endpoint:
    """host, port and db of a redis:// or rediss:// URL; a clear error (password hidden) for anything else."""
    problem = url_problem(url)
    if problem:
        raise OptionValueError(f"umbp: remote url {problem}")
    parts = urlsplit(split_credentials(url)[2])
    path = parts.path.strip("/")
    return Endpoint(parts.hostname or "", parts.port or 6379, int(path) if path else 0)


def _read_key_file(path: str) -> bytes:
    """The bytes of a key file; OSError (with a strerror for the message) when it is not a regular file
    or is larger than MAX_KEY_FILE_BYTES."""
    fd = open_regular(path)
    try:
        data = b""
        while len(data) <= MAX_KEY_FILE_BYTES and (chunk := os.read(fd, MAX_KEY_FILE_BYTES + 1 - len(data))):
            data += chunk
        if len(data) > MAX_KEY_FILE_BYTES:
            raise OSError(0, f"larger than {MAX_KEY_FILE_BYTES >> 10} KiB; a key file holds one secret")
        return data
    finally:
        os.close(fd)
