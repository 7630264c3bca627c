"""RemoteConfig validation, the value header, the RESP helpers and the get window: no server needed."""

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("redis")

from umbp.pool.errors import OptionValueError, UnknownOptionError  # noqa: E402
from umbp.pool.remote.config import RemoteConfig, parse_url, redact_url  # noqa: E402
from umbp.pool.remote.format import (  # noqa: E402
    CHECKSUM_AT,
    CHECKSUM_SIZE,
    HEADER_SIZE,
    header_after_checksum,
    header_before_checksum,
    header_problem,
    pack_header,
    stored_checksum,
)
from umbp.pool.remote.reader import GET_WINDOW_BYTES, _GetWindow  # noqa: E402
from umbp.pool.remote.resp import ProtocolError, bulk_keys, multi_key_command, scan_markers  # noqa: E402
from umbp.pool.remote.tier import RedisTier  # noqa: E402


def test_defaults_and_round_trip_of_options():
    cfg = RemoteConfig.from_options(
        {
            "url": "redis://10.1.2.3:7000/2",
            "ttl_s": 60,
            "quarantine_s": 5,
            "timeout_s": 0.25,
            "max_connections": 4,
            "key_prefix": "umbp:t1:",
        }
    )
    assert cfg.urls == ("redis://10.1.2.3:7000/2",) and cfg.ttl_s == 60 and cfg.quarantine_s == 5.0
    assert cfg.endpoints[0].name == "10.1.2.3:7000" and cfg.endpoints[0].db == 2
    assert cfg.max_connections == 4 and cfg.key_prefix == "umbp:t1:" and not cfg.cluster and not cfg.tls


def test_unknown_keys_are_named_with_a_hint():
    with pytest.raises(UnknownOptionError) as e:
        RemoteConfig.from_options({"url": "redis://h:1", "quarantine_sec": 3, "bogus": 1})
    msg = str(e.value)
    assert "'bogus'" in msg and "'quarantine_sec'" in msg and "did you mean 'quarantine_s'" in msg


@pytest.mark.parametrize(
    "name, value",
    [
        ("timeout_s", 3e6),
        ("timeout_s", 1e7),
        ("timeout_s", float("inf")),
        ("timeout_s", "inf"),
        ("timeout_s", float("nan")),
        ("timeout_s", "nan"),
        ("timeout_s", True),
        ("connect_timeout_s", 1e9),
        ("ttl_s", 1e300),
        ("ttl_s", float("inf")),
        ("quarantine_s", float("nan")),
        ("quarantine_s", -0.5),
        ("retry_interval_s", float("inf")),
        ("max_connections", True),
        ("max_connections", 10**12),
        ("quarantine_max_keys", 0),
        ("write_queue_bytes", 0),
        ("write_queue_bytes", 1.5),
        ("write_batch", False),
        ("hash_tag_chars", 0),
        ("min_throughput_mib_s", 0),
        ("min_throughput_mib_s", float("inf")),
        ("max_connections", "1e400"),
        ("quarantine_s", "5"),
        ("timeout_s", "2"),
    ],
)
def test_numbers_out_of_what_the_tier_can_honour_are_refused_by_name(name, value):
    """Values that used to pass and then break every call (a timeout too large for poll(), an infinite
    one), NaN, booleans or strings taken as numbers: one error naming the option, whichever way the config
    is built."""
    with pytest.raises(OptionValueError) as e:
        RemoteConfig.from_options({name: value})
    assert f"remote tier option '{name}' must be" in str(e.value)
    with pytest.raises(OptionValueError, match=f"remote tier option '{name}' must be"):
        RemoteConfig(**{name: value})


def test_largest_accepted_timeout_still_serves(tmp_path):
    """The top of the timeout_s range works end to end (it is turned into poll() milliseconds)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from redis_servers import require_redis, start_server

    require_redis()
    s = start_server(tmp_path)
    try:
        t = RedisTier(RemoteConfig.from_options({"url": s.url, "timeout_s": 3600, "connect_timeout_s": 3600}))
        assert t.put(["k"], [np.ones(8192, np.uint8)]) == [True]
        assert t.get_into(["k"], [np.empty(8192, np.uint8)]) == [True]
        assert t.exists(["k"]) == [True]
        t.close()
    finally:
        s.stop()


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"url": "http://h:1"}, "must start with redis://"),
        ({"url": "redis://h:99999"}, "bad port"),
        ({"url": "redis://h:1/x"}, "database number"),
        ({"url": ""}, "non-empty string"),
        ({"urls": []}, "non-empty list"),
        ({"url": "redis://a:1", "urls": ["redis://b:1"]}, "not both"),
        ({"urls": ["redis://a:1", "redis://b:1"]}, "'cluster' is false"),
        ({"urls": ["redis://a:1/3"], "cluster": True}, "only database 0"),
        ({"timeout_s": 0}, "'timeout_s' must be a finite number >= 0.001 and <= 3600"),
        ({"timeout_s": "fast"}, "timeout_s"),
        ({"max_connections": 2.5}, "an integer"),
        ({"quarantine_s": -1}, "quarantine_s"),
        ({"cluster": "maybe"}, "true or false"),
        ({"ttl_s": True}, "ttl_s"),
        ({"hash_tag_chars": 5}, "'hash_tag_chars' must be an integer >= 1 and <= 4"),
        ({"key_prefix": "umbp:{x}"}, "free of '{' and '}'"),
        ({"tls_cert_file": "/c.pem"}, "go together"),
        ({"password_env": "UMBP_TEST_SURELY_UNSET_VAR"}, "not set"),
        ({"password": "x", "password_env": "UMBP_TEST_SURELY_UNSET_VAR"}, "not both"),
        ({"cluster": "yes"}, "true or false"),
        ({"tls": 1}, "true or false"),
        ({"auth_mac": "md5"}, "'auth_mac' must be 'auto' or 'hmac-sha256' or 'aes-gmac'"),
        ({"encrypt": True}, "needs a tenant secret"),
        ({"auth_old_key_envs": ["UMBP_TEST_SURELY_UNSET_VAR"]}, "not set"),
        ({"auth_key_env": "A", "auth_key_file": "/b"}, "not both"),
    ],
)
def test_bad_values_have_clear_errors(options, fragment):
    with pytest.raises(OptionValueError, match=None) as e:
        RemoteConfig.from_options(options)
    assert fragment in str(e.value)


def test_password_never_shown(monkeypatch):
    monkeypatch.setenv("UMBP_TEST_PW", "hunter2")
    cfg = RemoteConfig.from_options({"url": "redis://alice:s3cr3t@h:1/0"})
    assert cfg.username == "alice" and cfg.password == "s3cr3t"
    for text in (repr(cfg), str(cfg.summary())):
        assert "s3cr3t" not in text
    assert (
        RemoteConfig.from_options({"url": "redis://h:1", "password_env": "UMBP_TEST_PW"}).password
        == "hunter2"
    )
    with pytest.raises(OptionValueError) as e:
        RemoteConfig.from_options({"url": "redis://h:1", "password": 123})
    assert "123" not in str(e.value)
    assert redact_url("rediss://u:pw@h:6380/0") == "rediss://u:***@h:6380/0"


def test_tls_implied_by_rediss_and_hostname_check_follows_verify():
    cfg = RemoteConfig.from_options({"url": "rediss://h:6380"})
    assert cfg.tls and cfg.tls_verify and cfg.tls_check_hostname
    cfg = RemoteConfig.from_options({"url": "rediss://h:6380", "tls_verify": False})
    assert not cfg.tls_check_hostname
    assert parse_url("redis://[::1]:7/0").host == "::1"


def test_values_resolved_from_the_environment_survive_replace(monkeypatch):
    """password_env, the URL's user and rediss:// are resolved once; dataclasses.replace re-checks the
    options without reading the environment again (it may have changed) or losing what was resolved."""
    import dataclasses

    monkeypatch.setenv("UMBP_TEST_PW", "hunter2")
    cfg = RemoteConfig.from_options(
        {"url": "rediss://alice@h:6380/1", "password_env": "UMBP_TEST_PW", "tls_verify": False}
    )
    monkeypatch.delenv("UMBP_TEST_PW")
    again = dataclasses.replace(cfg, timeout_s=1.0)
    assert again.password == "hunter2" and again.username == "alice" and again.urls == cfg.urls
    assert again.tls and not again.tls_check_hostname and again.timeout_s == 1.0
    assert "hunter2" not in repr(again)
    with pytest.raises(OptionValueError, match="remote tier option 'timeout_s'"):
        dataclasses.replace(cfg, timeout_s=float("nan"))


def test_header_checks():
    h = pack_header("k", 100, 0xDEADBEEF)
    assert len(h) == HEADER_SIZE == 32 and h[:4] == b"UMBP"
    assert header_problem(h, "k", 100) is None and stored_checksum(h) == 0xDEADBEEF
    assert header_problem(h, "k", 99) == "size_mismatches"
    assert header_problem(h, "other", 100) == "key_mismatches"
    assert header_problem(b"X" + h[1:], "k", 100) == "header_failures"
    assert header_problem(h[:4] + b"\x02\x00" + h[6:], "k", 100) == "version_mismatches"


def test_bulk_keys_fast_and_general_paths_agree():
    same = ["aa", "bb", "cc"]
    assert bulk_keys("p:", same) == b"$4\r\np:aa\r\n$4\r\np:bb\r\n$4\r\np:cc\r\n"
    mixed = ["a", "bbb", "é"]  # different lengths, and a non-ASCII key (2 bytes in UTF-8)
    assert bulk_keys("p:", mixed) == b"$3\r\np:a\r\n$5\r\np:bbb\r\n$4\r\np:\xc3\xa9\r\n"
    assert bulk_keys("p:", ["é", "ü"]) == b"$4\r\np:\xc3\xa9\r\n$4\r\np:\xc3\xbc\r\n"
    assert b"".join(multi_key_command(b"MGET", "", ["x"])) == b"*2\r\n$4\r\nMGET\r\n$1\r\nx\r\n"


def test_marker_scan_needs_whole_reply_and_rejects_foreign_values():
    reply = b"$1\r\n1\r\n$-1\r\n$1\r\n1\r\n"
    flags, used = scan_markers(reply + b"*2\r\n$-1", 3)  # the next reply of a pipeline may follow
    assert flags.tolist() == [True, False, True] and used == len(reply)
    for cut in range(1, 8):
        assert scan_markers(reply[:-cut], 3) == (None, 0)  # incomplete: wait for more bytes
    with pytest.raises(ProtocolError):
        scan_markers(b"$1\r\nX\r\n$-1\r\n", 2)
    with pytest.raises(ProtocolError):
        scan_markers(b"$-1\r\n$7\r\n$1\r\n1\r\n\r\n", 2)


class _Sends:
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def send(self, parts: list[bytes]) -> None:
        self.sizes.append(len(parts))


def _replay_window(sizes: list[int]) -> list[int]:
    """Drive a _GetWindow as RedisTier's get job does; check that every reply was asked for before it is
    read and that the pipeline never holds more than the window plus one value. Returns the sends."""
    w, sends = _GetWindow([b"GET"] * len(sizes), sizes), _Sends()
    w.top_up(sends, 0)  # the send phase
    for r in range(len(sizes)):
        if r >= w.due:
            w.top_up(sends, r)
        assert w.sent > r
        assert sum(sizes[r : w.sent]) <= GET_WINDOW_BYTES + max(sizes)
    assert w.sent == len(sizes) and sum(sends.sizes) == len(sizes)
    return sends.sizes


def test_get_window_sends_in_half_windows():
    kib, mib = 1 << 10, 1 << 20
    assert _replay_window([64 * kib] * 16) == [16]  # a batch within the window: one send
    sends = _replay_window([64 * kib] * 1024)  # 64 MiB of small values: refilled half a window at a time
    assert sends[0] == GET_WINDOW_BYTES // (64 * kib) and len(sends) <= 1 + 1024 // (
        GET_WINDOW_BYTES // (128 * kib)
    )
    assert _replay_window([4 * mib] * 5) == [1] * 5  # a value as large as the window: one at a time
    assert _replay_window([mib, 8 * mib, mib, kib, 3 * mib]) == [2, 3]  # the big one drains first
    assert _replay_window([7]) == [1]


@pytest.mark.parametrize(
    "key, n, digest",
    [
        ("k", 0, 0),
        ("umbp:v1:x:tp0:g0:" + "ab" * 32, 65536, (1 << 64) - 1),
        ("ключ", 12345, 0x0123456789ABCDEF),
    ],
)
def test_header_fields_around_the_checksum_rebuild_the_header(key, n, digest):
    """get_into's batched path matches a header as these two pieces with any checksum between."""
    header = pack_header(key, n, digest)
    before, after = header_before_checksum(n), header_after_checksum(key)
    assert len(before) == CHECKSUM_AT and len(before) + CHECKSUM_SIZE + len(after) == HEADER_SIZE
    assert header == before + digest.to_bytes(CHECKSUM_SIZE, "little") + after
    assert header_after_checksum(key + "x") != after and header_before_checksum(n + 1) != before


@pytest.mark.parametrize(
    "rest, namespace",
    [
        (b"m:umbp:v1:x", ""),  # a marker of unauthenticated values
        (b"{ab}m:umbp:v1:x", ""),  # ... in a cluster (hash tag)
        (b"t0123456789abcdef:m:umbp:v1:x", "t0123456789abcdef"),  # a tenant key's namespace
        (b"t0123456789abcdef:{ab}m:umbp:v1:x", "t0123456789abcdef"),
        (b"d:umbp:v1:x", None),  # a value, not a marker
        (b"t0123456789abcdef:{ab}d:umbp:v1:x", None),
        (b"t1:m:umbp:v1:x", None),  # another deployment's key_prefix nested under ours ("umbp:t1:")
        (b"{ab", None),
    ],
)
def test_marker_names_give_their_namespace(rest, namespace):
    """How `umbp stats` tells the namespaces under key_prefix apart (RedisTier.scan_namespaces)."""
    from umbp.pool.remote.admin import _marker_namespace

    assert _marker_namespace(rest) == namespace
