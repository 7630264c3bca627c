"""No Redis password in UMBPConfig's repr/str or in any config error, however the URL is written."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from umbp.redact import redact_url_text, secrets_of, url_password
from umbp.vllm.config import ConfigError, UMBPConfig

PASSWORD = "s3#cr/et?x@y:z"  # every character that confuses URL parsing
PIECES = [PASSWORD, quote(PASSWORD, safe=""), "s3#cr", "cr/et", "et?x", "x@y", "y:z"]


def _clean(text: str) -> None:
    leaked = [p for p in PIECES if p in text]
    assert not leaked, f"secret fragments {leaked} in: {text}"


def _ok_configs(monkeypatch):
    monkeypatch.setenv("UMBP_TEST_REDIS_PW", PASSWORD)
    return [
        {"remote": "redis://:" + quote(PASSWORD, safe="") + "@127.0.0.1:6379/0"},
        {"remote": "redis://alice:" + quote(PASSWORD, safe="") + "@127.0.0.1:6379/0"},
        {
            "remote": "redis://:" + PASSWORD + "@127.0.0.1:6379/0"
        },  # unencoded: the user info ends at the last @
        {"remote": {"url": "redis://:" + PASSWORD + "@h:1", "password": PASSWORD}},
        {"remote": {"url": "redis://127.0.0.1:6379/0", "password": PASSWORD}},
        {"remote": {"url": "redis://127.0.0.1:6379/0", "password_env": "UMBP_TEST_REDIS_PW"}},
    ]


def test_repr_and_str_hide_the_password(monkeypatch):
    for extra in _ok_configs(monkeypatch):
        cfg = UMBPConfig.from_extra_config(extra)
        _clean(repr(cfg))
        _clean(str(cfg))
        _clean(f"{cfg!r} {cfg}")
        assert "***" in repr(cfg) or "password_env" in repr(cfg)


BAD = [
    {"remote": ["redis://:" + PASSWORD + "@127.0.0.1:6379"]},  # list form: not a URL or dict
    {"remote": ("redis://:" + PASSWORD + "@h:1", "redis://h:2")},
    {"remote": "redis://:" + PASSWORD + "@127.0.0.1:99999/0"},  # unencoded (read whole), then a bad port
    {"remote": "redis://alice:" + PASSWORD + "@127.0.0.1:70000/0"},
    {"remote": "redis://:" + PASSWORD + "@127.0.0.1:notaport/0"},
    {"remote": "http://:" + PASSWORD + "@127.0.0.1:6379/0"},  # wrong scheme
    {"remote": "redis://:" + quote(PASSWORD, safe="") + "@127.0.0.1:6379/notadb"},
    {"remote": {"url": "redis://:" + PASSWORD + "@h:1", "password": PASSWORD, "db": -1}},
    {"remote": {"url": "redis://h:1", "password": PASSWORD, "bogus": 1}},
    {"remote": {"url": "redis://h:1", "password": PASSWORD, "timeout_s": -1}},
    {"remote": {"url": "redis://h:1", "password": PASSWORD, "tls_cert_file": "/c"}},
    {"remote": {"urls": ["redis://:" + PASSWORD + "@h:1", "redis://h:2"], "password": PASSWORD}},
    {"remote": {"url": "redis://h:1", "password": [PASSWORD]}},
    {"remote": {"url": "redis://h:1", "password_env": "UMBP_TEST_REDIS_PW", "max_connections": 0}},
    {"remote": {"url": "redis://h:1", "password": PASSWORD}, "dram_gbs": 1},
    {"remote": {"url": "redis://h:1", "password": PASSWORD}, "dram_gb": float("nan")},
    {"remote": {"url": "redis://h:1", "password": PASSWORD}, "high_watermark": 0.5, "low_watermark": 0.9},
]


@pytest.mark.parametrize("extra", BAD, ids=range(len(BAD)))
def test_every_config_error_hides_the_password(monkeypatch, extra):
    monkeypatch.setenv("UMBP_TEST_REDIS_PW", PASSWORD)
    with pytest.raises(ConfigError) as err:
        UMBPConfig.from_extra_config(extra)
    _clean(str(err.value))
    _clean(repr(err.value))
    assert err.value.__cause__ is None or PASSWORD not in str(err.value.__cause__)
    assert err.value.__suppress_context__ or err.value.__context__ is None  # no chained message leaks it


def test_lenient_url_password_parsing():
    url = "redis://bob:" + PASSWORD + "@10.0.0.1:6379/2"
    assert url_password(url) == PASSWORD
    assert redact_url_text(url) == "redis://bob:***@10.0.0.1:6379/2"
    assert redact_url_text("redis://10.0.0.1:6379/2") == "redis://10.0.0.1:6379/2"
    opts = {"url": "redis://:" + quote(PASSWORD, safe="") + "@h:1", "password": "other"}
    assert {PASSWORD, quote(PASSWORD, safe=""), "other"} <= set(secrets_of(opts))
