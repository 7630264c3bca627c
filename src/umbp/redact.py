"""Keep secrets (Redis passwords, tokens, tenant keys) out of messages, reprs and logs, even when the
value holding them is malformed.

One rule for every URL-like text (`redact_url`), used by the connector's config, the shared tier's config
and `umbp stats`:

* user info: everything between the scheme-like prefix (a scheme, its ':' and any slashes, however many:
  "redis://", "redis:/", "redis//", "redis:") and the LAST '@' is credentials. `urllib.parse` stops the
  network location at the first '/', '?' or '#' and needs "://", so a password written without
  percent-encoding ("redis://:pa/ss#1@host") or after a mistyped scheme ("redis:/:pw@host") would not be
  recognised as one, and a message built from the parsed parts, or from the raw string, would print it.
  The password part (after the first ':') is shown as ***, and the user name before it only after a
  well-formed "scheme://": user info without a password ("redis://pw@host", a password written without its
  ':'), or after a malformed scheme ("redis:a:b@host"), is a secret as a whole and shown as ***.
* credential-like query or fragment parameters (`?password=`, `&token=`, `#access_token=`, `api_key`,
  `auth`, `sig`, ...): their values are shown as ***.

Option values are shown through `redacted_value`/`shown_value`: a secret-named key's value is hidden
wherever it sits (`{"token": ...}` inside a wrongly typed option), URL strings are redacted, and a value
that should only NAME where a secret is (`password_env`, `auth_key_file`) is shown only when it looks like
a name (an upper-case environment variable name, an explicit path): anything else may be the secret
itself, pasted into the wrong key.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

HIDDEN = "***"

# Option and query-parameter names whose values are secrets: a name holding one of these substrings, or
# one of these words (the name split at '_', '-', '.' and camelCase humps).
_SECRET_SUBSTRINGS = (
    "password",
    "passwd",
    "secret",
    "token",
    "credential",
    "signature",
    "session",
    "cookie",
    "apikey",
    "authkey",
    "private",
)
_SECRET_WORDS = frozenset({"pass", "pwd", "pw", "auth", "authorization", "key", "sig"})
# ...unless the name only says where the secret is (password_env, auth_key_file), or is about something
# else that happens to hold such a word (key_prefix, auth_mac).
_WHERE_ENV = frozenset({"env", "envs"})
_WHERE_PATH = frozenset({"file", "files", "path", "paths"})
_NOT_SECRET_LAST = frozenset({"prefix", "mac", "chars", "mode", "type", "method", "name", "names"})

_SCHEME_PREFIX = re.compile(r"\s*(?:[A-Za-z][A-Za-z0-9+.\-]*)?(?::/*|/+)")
_WELL_FORMED = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.\-]*://")
_PARAM = re.compile(r"[?&;#]([^=&;#?/]*)=")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,63}")
_PATH = re.compile(r"(?:/|\./|\.\./|~/)[\w./~ \-]*")
_MAX_DEPTH = 8


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()) if w]


def _names_a_secret(words: list[str]) -> bool:
    joined = "".join(words)
    return any(w in _SECRET_WORDS for w in words) or any(s in joined for s in _SECRET_SUBSTRINGS)


def name_kind(name: str) -> str | None:
    """What an option (or query parameter) named `name` holds: "secret", "env" (the name of an environment
    variable holding a secret), "path" (the path of a file holding one) or None (nothing secret)."""
    words = _words(name)
    if not words:
        return None
    last = words[-1]
    if last in _WHERE_ENV:
        return "env" if _names_a_secret(words[:-1]) else None
    if last in _WHERE_PATH:
        return "path" if _names_a_secret(words[:-1]) else None
    if last in _NOT_SECRET_LAST:
        return None
    return "secret" if _names_a_secret(words) else None


def is_secret_option(name: str) -> bool:
    return name_kind(name) == "secret"


def looks_like_env_name(name: Any) -> bool:
    """An environment variable name as deployments write them (upper-case letters, digits, '_', not mostly
    digits): the only `*_env` values a message may quote. Anything else may be the secret itself."""
    return (
        isinstance(name, str)
        and _ENV_NAME.fullmatch(name) is not None
        and 2 * sum(c.isdigit() for c in name) <= len(name)
    )


def looks_like_path(path: Any) -> bool:
    """An explicit file path (absolute, or starting with ./ ../ ~/, of word characters, '.', '-', '/', ' '):
    the only `*_file` values a message may quote. Anything else may be the secret itself."""
    return isinstance(path, str) and _PATH.fullmatch(path) is not None


def _userinfo(text: str) -> tuple[int, int, int] | None:
    """(start of the user info, start of its secret part, index of the last '@'), or None without one."""
    at = text.rfind("@")
    if at < 0:
        return None
    m = _SCHEME_PREFIX.match(text)
    start = m.end() if m else 0
    creds = text[start:at]
    if not creds:
        return None
    colon = creds.find(":")
    if colon + 1 >= len(creds) or colon < 0:
        return start, start, at  # no password: the whole user info may be one
    if colon == 0 or (m and _WELL_FORMED.fullmatch(m.group())):
        return start, start + colon + 1, at  # scheme://user:password, or any prefix then :password
    # after a malformed scheme ("redis:a:b@h") the first ':' may well be inside the password: hide it all
    return start, start, at


def _query_spans(text: str) -> list[tuple[int, int]]:
    """Spans of credential-like parameter values: from the '=' to the next '&' (a value is never cut short
    at a '#' or ';', so no part of it is left showing)."""
    spans = []
    for m in _PARAM.finditer(text):
        if name_kind(unquote(m.group(1)).strip()) == "secret":
            end = text.find("&", m.end())
            spans.append((m.end(), len(text) if end < 0 else end))
    return spans


def _secret_spans(text: str) -> list[tuple[int, int]]:
    spans = _query_spans(text)
    info = _userinfo(text)
    if info is not None:
        spans.append((info[1], info[2]))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def redact_url(text: str) -> str:
    """`text` (a URL, however malformed, or a message holding one) with the secret part of its user info
    and the values of credential-like query parameters replaced by ***. The one redaction of umbp: errors,
    logs, reprs, stats."""
    out, pos = [], 0
    for a, b in _secret_spans(text):
        out += [text[pos:a], HIDDEN]
        pos = b
    out.append(text[pos:])
    return "".join(out)


redact_url_text = redact_url  # the former name


def url_password(url: str) -> str | None:
    """The secret part of a URL's user info, as written (None if it has none), parsed leniently: the
    password, or the whole user info when it has no password."""
    info = _userinfo(url)
    return url[info[1] : info[2]] if info is not None else None


def url_secrets(url: str) -> list[str]:
    """Every secret a URL-like text carries, as written and percent-decoded."""
    found = [url[a:b] for a, b in _secret_spans(url)]
    pw = url_password(url)
    found += [pw] if pw else []
    found += [unquote(s) for s in found]
    return [s for s in found if s]


def secrets_of(options: Mapping[str, Any]) -> list[str]:
    """Every secret string a remote options mapping carries: URL passwords and credential query values (as
    written and decoded), secret-named options, and the values of the environment variables `*_env` options
    name."""
    found: list[str] = []
    urls: list[Any] = [options.get("url")]
    many = options.get("urls")
    urls += list(many) if isinstance(many, list | tuple) else [many]
    for url in urls:
        if isinstance(url, str):
            found += url_secrets(url)
            for part in url.split(","):
                found += url_secrets(part.strip())
    for name, value in options.items():
        if not isinstance(name, str):
            continue
        kind = name_kind(name)
        values = value if isinstance(value, list | tuple) else [value]
        if kind == "secret":
            found += [v for v in values if isinstance(v, str)]
        elif kind == "env":
            found += [os.environ.get(v, "") for v in values if isinstance(v, str)]
    return sorted({s for s in found if s}, key=len, reverse=True)  # longest first: no partial leftovers


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each secret replaced by ***."""
    for secret in secrets:
        text = text.replace(secret, HIDDEN)
    return text


class _TypeOnly:
    """Stands for a value shown only by its type (an arbitrary object's repr could hold anything)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _shown_text(value: str) -> str:
    # a string is redacted as a URL when it could be one holding credentials: an '@' with a ':' or '//'
    # around it, or a '?'/'#'/'&'/';' parameter (paths such as "/mnt/nvme@1" stay as written)
    if ("@" in value and (":" in value or "//" in value)) or _PARAM.search(value):
        return redact_url(value)
    return value


def redacted_value(value: Any, name: str = "", _depth: int = 0) -> Any:
    """A copy of a config value safe to show: secret-named options hidden, URL credentials masked,
    `*_env`/`*_file` values that do not look like a name hidden, odd objects reduced to their type."""
    kind = name_kind(name) if name else None
    if kind == "secret":
        return HIDDEN if value else value
    if _depth > _MAX_DEPTH:
        return _TypeOnly("...")
    if isinstance(value, str):
        if kind == "env" and not looks_like_env_name(value):
            return HIDDEN
        if kind == "path" and not looks_like_path(value):
            return HIDDEN
        return _shown_text(value)
    if isinstance(value, Mapping):
        return {
            _shown_text(k) if isinstance(k, str) else redacted_value(k, "", _depth + 1): redacted_value(
                v, k if isinstance(k, str) else "", _depth + 1
            )
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        items = [redacted_value(v, name if kind else "", _depth + 1) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if value is None or isinstance(value, bool | int | float):
        return value
    return _TypeOnly(type(value).__name__)


def shown_value(value: Any, name: str = "") -> str:
    """repr() of `redacted_value(value, name)`: how messages and reprs show an option's value."""
    return repr(redacted_value(value, name))
