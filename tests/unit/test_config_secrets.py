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


# ---- one redaction for every message, repr and stats line (umbp.redact.redact_url) ------------------------

TOKEN = "Hunter2SecretXYZ123456"  # a secret that is also a valid (mixed-case) identifier


def _no_token(text: str) -> None:
    assert TOKEN not in text and "Hunter2" not in text, f"secret in: {text}"
    _clean(text)


MALFORMED = [
    "redis:/:{}@127.0.0.1:6379/0",  # one slash
    "redis//:{}@127.0.0.1:6379/0",  # no colon
    "redis:{}@127.0.0.1",  # no slashes
    "{}@127.0.0.1:6379/0",  # no scheme at all
]


@pytest.mark.parametrize("template", MALFORMED)
@pytest.mark.parametrize("secret", [TOKEN, PASSWORD])
def test_a_malformed_scheme_never_shows_the_credentials(template, secret):
    from umbp.pool.errors import OptionValueError
    from umbp.pool.remote.config import RemoteConfig

    url = template.format(secret)
    for extra in ({"remote": url}, {"remote": {"urls": [url], "cluster": True}}):
        with pytest.raises(ConfigError) as err:
            UMBPConfig.from_extra_config(extra)
        _no_token(str(err.value))
        assert "remote" in str(err.value) and "***" in str(err.value)
    with pytest.raises(OptionValueError) as err:
        RemoteConfig.from_options({"url": url})
    _no_token(str(err.value))
    assert "must start with redis:// or rediss://" in str(err.value) or "has no host" in str(err.value)
    assert secret in secrets_of({"url": url})  # the connector's second line of defence finds it too


def test_redact_url_masks_user_info_and_credential_query_parameters():
    cases = {
        f"redis:/:{TOKEN}@h:1/0": "redis:/:***@h:1/0",
        f"redis//:{TOKEN}@h": "redis//:***@h",
        f"redis:///:{TOKEN}@h": "redis:///:***@h",
        f"{TOKEN}@h:6379": "***@h:6379",
        f"{PASSWORD}@h:6379": "***@h:6379",
        f"redis:{TOKEN}@h": "redis:***@h",
        f"redis://{TOKEN}@h:1/0": "redis://***@h:1/0",  # user info without a password: a secret as a whole
        f"redis://alice:{TOKEN}@h:1/0": "redis://alice:***@h:1/0",
        f"redis://h:1/0?password={TOKEN}&db=1": "redis://h:1/0?password=***&db=1",
        f"http://h/metrics?x=1&token={TOKEN}": "http://h/metrics?x=1&token=***",
        f"http://h/metrics?api_key={TOKEN}#f": "http://h/metrics?api_key=***",
        f"http://h/m#access_token={TOKEN}": "http://h/m#access_token=***",
        "redis://h:1/0": "redis://h:1/0",
        "http://h/metrics?page=2": "http://h/metrics?page=2",
    }
    for url, shown in cases.items():
        assert redact_url_text(url) == shown, url
    _no_token(redact_url_text(f"redis://h:1/0?password=a@{TOKEN}"))  # an '@' in a query value
    assert url_password(f"redis://{TOKEN}@h") == TOKEN


@pytest.mark.parametrize(
    "url",
    [
        f"redis://127.0.0.1:6379/0?password={TOKEN}",
        f"redis://:{TOKEN}@127.0.0.1:6379/0?password={TOKEN}&x=1",
        f"redis://127.0.0.1:6379/0?token={TOKEN}",
        f"redis://{TOKEN}@127.0.0.1:6379/0",  # password-only user info
        f"redis://{TOKEN}:@127.0.0.1:6379/0",  # ... with an empty password
    ],
)
def test_both_configs_show_a_url_the_same_redacted_way(url):
    from umbp.pool.remote.config import RemoteConfig, redact_url

    shown = redact_url(url)
    assert shown == redact_url_text(url) and "***" in shown
    remote = RemoteConfig.from_options({"url": url})
    for extra in ({"remote": url}, {"remote": {"url": url}}, {"remote": {"urls": [url], "cluster": True}}):
        cfg = UMBPConfig.from_extra_config(extra)
        _no_token(repr(cfg) + str(cfg))
        assert repr(shown) in repr(cfg)
    _no_token(repr(remote) + str(remote) + str(remote.summary()))
    assert repr(shown) in repr(remote)


def test_a_password_only_user_info_is_used_but_never_shown(monkeypatch):
    from umbp.pool.remote.config import RemoteConfig

    bare = RemoteConfig.from_options({"url": f"redis://{TOKEN}@h:1/0"})
    assert bare.username == TOKEN  # passed on as written (the server decides)...
    assert "username=<hidden>" in repr(bare) and bare.summary()["user"] == "***"  # ...never shown
    monkeypatch.setenv("UMBP_TEST_REDIS_PW", PASSWORD)
    named = RemoteConfig.from_options({"url": "redis://alice:pw@h:1/0"})
    assert "username='alice'" in repr(named) and named.summary()["user"] == "alice"
    explicit = RemoteConfig.from_options({"url": "redis://h:1/0", "username": "bob"})
    assert "username='bob'" in repr(explicit)


@pytest.mark.parametrize("option", ["password_env", "auth_key_env", "auth_key_file", "auth_old_key_envs"])
def test_a_secret_pasted_where_a_name_belongs_is_not_echoed(monkeypatch, option):
    extra = {"remote": {"url": "redis://127.0.0.1:6379/0", option: TOKEN}}
    if option == "auth_old_key_envs":  # read after the current key
        monkeypatch.setenv("UMBP_TEST_TENANT_KEY", "0123456789abcdef0123456789abcdef")
        extra["remote"]["auth_key_env"] = "UMBP_TEST_TENANT_KEY"
    with pytest.raises(ConfigError) as err:
        UMBPConfig.from_extra_config(extra)
    text = str(err.value)
    _no_token(text)
    assert f"'{option}'" in text
    assert "not set or empty" in text or "cannot read" in text


def test_a_plausible_name_or_path_is_still_quoted():
    for option, value in (
        ("password_env", "UMBP_TEST_SURELY_UNSET_VAR"),
        ("auth_key_file", "/nonexistent/k"),
    ):
        with pytest.raises(ConfigError) as err:
            UMBPConfig.from_extra_config({"remote": {"url": "redis://127.0.0.1:6379/0", option: value}})
        assert value in str(err.value) and f"'{option}'" in str(err.value)


@pytest.mark.parametrize(
    "extra",
    [
        {"remote": {"url": {"token": TOKEN}}},
        {"remote": {"urls": [{"auth": TOKEN}]}},
        {"remote": {"url": "redis://h:1/0", "username": {"password": TOKEN}}},
        {"remote": {"url": "redis://h:1/0", "password_env": [TOKEN]}},
        {"tenant": {"password": TOKEN}},
        {"tenant": [f"redis://:{TOKEN}@h"]},
        {"ssd_dirs": {"api_key": TOKEN}},
        {"remote": [("url", f"redis://:{TOKEN}@h:1/0"), ("x", 1)]},
    ],
    ids=range(8),
)
def test_wrongly_typed_values_are_shown_redacted(extra):
    with pytest.raises(ConfigError) as err:
        UMBPConfig.from_extra_config(extra)
    _no_token(str(err.value))
    assert "must be" in str(err.value) and "***" in str(err.value)


def test_rediss_in_any_case_or_with_leading_blanks_means_tls():
    from umbp.pool.remote.config import RemoteConfig

    for url in ("REDISS://h:6380/0", " rediss://h:6380/0", "Rediss://h:6380/0"):
        assert RemoteConfig.from_options({"url": url}).tls, url
    assert not RemoteConfig.from_options({"url": "REDIS://h:6379/0"}).tls
