"""Keep secrets (Redis passwords) out of messages, reprs and logs, even when the URL holding them is malformed.

`urllib.parse` stops the network location at the first '/', '?' or '#', so a password written without
percent-encoding ("redis://:pa/ss#1@host") is not recognised as a password at all and a "bad port" or
"bad URL" message built from the parsed parts, or from the raw string, would print it. These helpers
never trust the parse: everything between "://" and the LAST '@' is taken as credentials.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

HIDDEN = "***"
_SECRET_WORDS = ("password", "secret", "token", "auth_key")  # option names whose values are secrets
_NAME_SUFFIXES = ("_env", "_file")  # ...unless they only name where the secret is (password_env)


def is_secret_option(name: str) -> bool:
    low = name.lower()
    return any(w in low for w in _SECRET_WORDS) and not low.endswith(_NAME_SUFFIXES)


def url_password(url: str) -> str | None:
    """The password part of a URL's credentials, as written (None if it has none), parsed leniently."""
    scheme_end = url.find("://")
    if scheme_end < 0:
        return None
    rest = url[scheme_end + 3 :]
    at = rest.rfind("@")
    if at < 0:
        return None
    creds = rest[:at]
    colon = creds.find(":")
    return creds[colon + 1 :] if colon >= 0 and colon + 1 < len(creds) else None


def redact_url_text(url: str) -> str:
    """The URL with any password replaced by ***, however the URL is malformed."""
    password = url_password(url)
    if not password:
        return url
    scheme_end = url.find("://") + 3
    at = url.rfind("@")
    creds = url[scheme_end:at]
    user = creds[: creds.find(":")]
    return f"{url[:scheme_end]}{user}:{HIDDEN}{url[at:]}"


def secrets_of(options: Mapping[str, Any]) -> list[str]:
    """Every secret string a remote options mapping carries: URL passwords (as written and decoded),
    secret-named options, and the values of the environment variables `*_env` options name."""
    found: list[str] = []
    urls: list[Any] = [options.get("url")]
    many = options.get("urls")
    urls += list(many) if isinstance(many, list | tuple) else [many]
    for url in urls:
        if isinstance(url, str):
            for part in url.split(","):
                pw = url_password(part.strip())
                if pw:
                    found += [pw, unquote(pw)]
    for name, value in options.items():
        if not isinstance(name, str):
            continue
        if is_secret_option(name) and isinstance(value, str):
            found.append(value)
        elif name.lower().endswith("_env") and isinstance(value, str) and is_secret_option(name[:-4]):
            env = os.environ.get(value)
            if env:
                found.append(env)
    return sorted({s for s in found if s}, key=len, reverse=True)  # longest first: no partial leftovers


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each secret replaced by ***."""
    for secret in secrets:
        text = text.replace(secret, HIDDEN)
    return text


def redacted_value(value: Any, name: str = "") -> Any:
    """A copy of a config value safe to show: secret options hidden, URL passwords masked, odd objects
    reduced to their type (an arbitrary object's repr could hold anything)."""
    if name and is_secret_option(name):
        return HIDDEN if value else value
    if isinstance(value, str):
        return redact_url_text(value)
    if isinstance(value, Mapping):
        return {k: redacted_value(v, k if isinstance(k, str) else "") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redacted_value(v) for v in value)
    if value is None or isinstance(value, bool | int | float):
        return value
    return f"<{type(value).__name__}>"
