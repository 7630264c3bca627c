"""No Redis password or tenant secret in any error, log line, repr or stats of the shared tier, with a
password holding every URL delimiter unencoded (#/?@:), which used to spill into 'bad port' errors."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import free_port, require_redis, start_server  # noqa: E402

require_redis()

from umbp.pool.errors import OptionValueError  # noqa: E402
from umbp.pool.remote.config import parse_url, redact_options, redact_url  # noqa: E402
from umbp.pool.remote.tier import RedisTier, RemoteConfig  # noqa: E402

PASSWORD = "pa#ss/wo?rd@x:y"
SECRET = "tenant-secret-#/?@:-0123456789"
FRAGMENTS = ("pa#ss", "ss/wo", "wo?rd", "rd@x", "x:y", "tenant-secret", "0123456789")


def assert_hidden(text: str) -> None:
    for frag in FRAGMENTS:
        assert frag not in text, f"{frag!r} leaked in {text!r}"


BAD_URLS = [
    f"redis://user:{PASSWORD}@127.0.0.1:99999/0",  # bad port
    f"redis://user:{PASSWORD}@127.0.0.1:12ab/0",  # bad port
    f"http://user:{PASSWORD}@127.0.0.1:1/0",  # bad scheme
    f"redis://user:{PASSWORD}@:1/0",  # no host
    f"redis://user:{PASSWORD}@127.0.0.1:1/x",  # bad db
    f"redis://:{PASSWORD}@127.0.0.1:1/0?password={PASSWORD}",  # query form
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_url_errors_never_show_the_password(url):
    with pytest.raises(OptionValueError) as e:
        RemoteConfig.from_options({"url": url, "timeout_s": 1}) if "?" not in url else parse_url(
            url + "x:99999"
        )
    assert_hidden(str(e.value))
    with pytest.raises(OptionValueError) as e:
        RemoteConfig.from_options({"urls": [url, "redis://127.0.0.1:1/0"], "cluster": True})
    assert_hidden(str(e.value))
    assert_hidden(redact_url(url))


def test_a_password_with_url_delimiters_is_parsed_whole():
    cfg = RemoteConfig.from_options({"url": f"redis://alice:{PASSWORD}@10.0.0.1:7000/3"})
    assert cfg.password == PASSWORD and cfg.username == "alice"
    assert cfg.endpoints[0].name == "10.0.0.1:7000" and cfg.endpoints[0].db == 3
    assert_hidden(repr(cfg) + str(cfg) + str(cfg.summary()))


def test_option_values_with_secrets_are_redacted_in_errors(monkeypatch):
    for value in (
        [f"redis://:{PASSWORD}@h:1/0"],
        {"url": f"redis://:{PASSWORD}@h:1", "password": PASSWORD},
        (f"redis://u:{PASSWORD}@h:1",),
    ):
        assert_hidden(redact_options(value))
    with pytest.raises(OptionValueError) as e:
        RemoteConfig.from_options({"url": "redis://h:1", "password": 123})
    assert_hidden(str(e.value))


def test_list_form_remote_in_the_engine_config_hides_the_password():
    from umbp.vllm.config import ConfigError, UMBPConfig

    with pytest.raises(ConfigError) as e:
        UMBPConfig.from_extra_config({"remote": [f"redis://:{PASSWORD}@127.0.0.1:6379/0"]})
    assert "remote" in str(e.value)
    assert_hidden(str(e.value))


def test_connection_failures_never_log_the_password(caplog):
    url = f"redis://user:{PASSWORD}@127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.DEBUG):
        t = RedisTier(RemoteConfig.from_options({"url": url, "timeout_s": 0.3, "connect_timeout_s": 0.3}))
        assert t.put(["k"], [b"v"]) == [False]
        assert t.get_into(["k"], [np.empty(1, np.uint8)]) == [False]
        stats = t.stats()
        t.close()
    assert stats["connection_errors"] >= 1
    assert_hidden(caplog.text + str(stats) + repr(t) + repr(t.config))


def test_wrong_password_and_tenant_secret_stay_out_of_errors_and_stats(tmp_path, caplog, monkeypatch):
    s = start_server(tmp_path, password=PASSWORD)
    monkeypatch.setenv("UMBP_TEST_SECRET", SECRET)
    try:
        good = RedisTier(
            RemoteConfig.from_options(
                {"url": f"redis://:{PASSWORD}@127.0.0.1:{s.port}/0", "auth_key_env": "UMBP_TEST_SECRET"}
            )
        )
        assert good.put(["k"], [b"value"]) == [True]  # the unencoded password authenticates
        out = np.empty(5, np.uint8)
        assert good.get_into(["k"], [out]) == [True] and out.tobytes() == b"value"
        with caplog.at_level(logging.DEBUG):
            bad = RedisTier(
                RemoteConfig.from_options(
                    {
                        "url": f"redis://:{PASSWORD[::-1]}@127.0.0.1:{s.port}/0",
                        "auth_key_env": "UMBP_TEST_SECRET",
                    }
                )
            )
            assert bad.put(["k2"], [b"v"]) == [False]
        text = caplog.text + str(bad.stats()) + str(good.stats()) + repr(good.config) + repr(good._codec)
        assert_hidden(text)
        assert PASSWORD[::-1] not in text
        bad.close()
        good.close()
    finally:
        s.stop()
