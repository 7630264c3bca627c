"""The authenticated shared tier against a real redis-server: values sealed per tenant secret (HMAC-SHA256,
AES-GMAC, AES-GCM), forged / altered / copied / cross-tenant values are counted misses, namespaces derived
from the secret, reads under a previous secret during a rotation, and the config errors around it."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_servers import blob, require_redis  # noqa: E402

require_redis()

from umbp.pool.checksum import checksum_u8  # noqa: E402
from umbp.pool.errors import OptionValueError  # noqa: E402
from umbp.pool.remote.auth import SEALED_HEADER_SIZE, namespace_of  # noqa: E402
from umbp.pool.remote.format import key_crc, pack_header  # noqa: E402
from umbp.pool.remote.tier import RedisTier, RemoteConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("impl")

SECRET_A, SECRET_B = "tenant-a-secret-0123456789abcdef", "tenant-b-secret-fedcba9876543210"
SIZES = (4096, 3 * 4096 + 100)  # the batched read (C loop when built) and the value-by-value one
SCHEMES = [{"auth_mac": "hmac-sha256"}, {"auth_mac": "aes-gmac"}, {"encrypt": True}]


def key(i: int) -> str:
    return f"umbp:v1:ns:tp0:pcp0:dcp0:pp0:g0:{i:064x}"


@pytest.fixture
def raw(server):
    c = server.client()
    c.flushall()
    yield c
    c.close()


@pytest.fixture
def make(server, monkeypatch):
    monkeypatch.setenv("UMBP_TEST_KEY_A", SECRET_A)
    monkeypatch.setenv("UMBP_TEST_KEY_B", SECRET_B)
    made: list[RedisTier] = []

    def build(**options):
        t = RedisTier(RemoteConfig.from_options({"url": server.url, "quarantine_s": 0, **options}))
        made.append(t)
        return t

    yield build
    for t in made:
        t.close()


def value_name(secret: str, k: str) -> str:
    return f"umbp:{namespace_of(secret.encode())}:d:{k}"


@pytest.mark.parametrize("scheme", SCHEMES, ids=["hmac", "gmac", "gcm"])
@pytest.mark.parametrize("size", SIZES)
def test_sealed_round_trip_in_a_derived_namespace(make, raw, scheme, size):
    t = make(auth_key_env="UMBP_TEST_KEY_A", **scheme)
    data = [blob(size, i) for i in range(3)]
    assert t.put([key(i) for i in range(3)], data) == [True] * 3
    assert t.put_async([key(3)], [blob(size, 3)]) == [True] and t.flush(5)
    assert t.exists([key(i) for i in range(5)]) == [True] * 4 + [False]
    outs = [np.empty(size, np.uint8) for _ in range(4)]
    assert t.get_into([key(i) for i in range(4)], outs) == [True] * 4
    assert all(np.array_equal(o, blob(size, i)) for i, o in enumerate(outs))
    stored = raw.get(value_name(SECRET_A, key(0)))
    assert stored is not None and len(stored) == SEALED_HEADER_SIZE + size
    assert not raw.exists(f"umbp:d:{key(0)}")  # nothing under the computable, secret-less name
    if scheme.get("encrypt"):  # the server holds ciphertext only
        assert bytes(data[0][:64]) not in stored
    else:
        assert stored[SEALED_HEADER_SIZE:] == data[0].tobytes()
    assert t.stats()["config"]["values"].startswith(("authenticated", "encrypted"))


def plant(raw, name: str, value: bytes) -> None:
    raw.set(name, value)
    raw.set(name.replace(":d:", ":m:", 1), b"1")


@pytest.mark.parametrize("size", SIZES)
def test_a_value_planted_without_the_secret_is_a_miss(make, raw, size):
    """Whoever can write to the server, and knows (e.g. by SCAN) the victim's names, still cannot make a
    value verify: a plain-format value with a correct checksum, and a format-2 value with a correct
    checksum and a made-up tag, are both counted misses."""
    t = make(auth_key_env="UMBP_TEST_KEY_A")
    assert t.put([key(0)], [blob(size, 0)]) == [True]
    genuine = raw.get(value_name(SECRET_A, key(0)))
    evil = np.full(size, 7, np.uint8)
    header = bytearray(genuine[:SEALED_HEADER_SIZE])
    struct.pack_into("<Q", header, 24, checksum_u8(evil))  # psum64 of the forged bytes: public
    header[44:60] = bytes(16)  # any tag
    plant(
        raw,
        value_name(SECRET_A, key(1)),
        bytes(header[:60]) + struct.pack("<I", key_crc(key(1))) + evil.tobytes(),
    )
    plant(raw, value_name(SECRET_A, key(2)), pack_header(key(2), size, checksum_u8(evil)) + evil.tobytes())
    out = np.empty(size, np.uint8)
    assert t.get_into([key(1)], [out]) == [False]
    assert t.stats()["auth_failures"] == 1
    if size % 4096:  # a plain value has another length than a sealed one: a size mismatch
        assert t.get_into([key(2)], [out]) == [False]
    else:
        assert t.get_into([key(2)], [out]) == [False]
        s = t.stats()
        assert s["size_mismatches"] + s["unauthenticated_values"] >= 1


@pytest.mark.parametrize("scheme", SCHEMES, ids=["hmac", "gmac", "gcm"])
def test_a_genuine_value_altered_or_copied_under_another_key_is_a_miss(make, raw, scheme):
    """The tag binds the bytes and the key: flip one payload bit (and fix the public psum64), or copy a
    genuine value under another key (and fix its key crc): both fail verification."""
    size = 4096
    t = make(auth_key_env="UMBP_TEST_KEY_A", **scheme)
    assert t.put([key(0)], [blob(size, 0)]) == [True]
    genuine = bytearray(raw.get(value_name(SECRET_A, key(0))))
    flipped = bytearray(genuine)
    flipped[SEALED_HEADER_SIZE + 100] ^= 1
    struct.pack_into(
        "<Q", flipped, 24, checksum_u8(np.frombuffer(bytes(flipped[SEALED_HEADER_SIZE:]), np.uint8))
    )
    plant(raw, value_name(SECRET_A, key(0)), bytes(flipped))
    copied = bytearray(genuine)
    struct.pack_into("<I", copied, 60, key_crc(key(1)))
    plant(raw, value_name(SECRET_A, key(1)), bytes(copied))
    outs = [np.empty(size, np.uint8) for _ in range(2)]
    assert t.get_into([key(0), key(1)], outs) == [False, False]
    assert t.stats()["auth_failures"] == 2
    # the failed values were deleted, so the next saves store genuine ones (SET NX would keep a plant)
    assert t.stats()["corrupt_removed"] == 2
    assert t.put([key(0), key(1)], [blob(size, 0), blob(size, 1)]) == [True, True]
    assert t.get_into([key(0), key(1)], outs) == [True, True]
    assert np.array_equal(outs[1], blob(size, 1))


def test_tenants_are_sealed_from_each_other(make, raw):
    """Tenant B (another secret) and an unauthenticated client see none of tenant A's objects, and A's
    value copied into B's namespace (key id patched to B's) does not verify for B."""
    a = make(auth_key_env="UMBP_TEST_KEY_A")
    b = make(auth_key_env="UMBP_TEST_KEY_B")
    plain = make()
    assert a.put([key(0)], [blob(4096, 0)]) == [True]
    assert b.exists([key(0)]) == [False] and plain.exists([key(0)]) == [False]
    genuine = bytearray(raw.get(value_name(SECRET_A, key(0))))
    b_id = raw.get(value_name(SECRET_B, key(9))) if b.put([key(9)], [blob(4096, 9)]) == [True] else None
    genuine[20:24] = b_id[20:24]
    plant(raw, value_name(SECRET_B, key(0)), bytes(genuine))
    assert b.get_into([key(0)], [np.empty(4096, np.uint8)]) == [False]
    assert b.stats()["auth_failures"] == 1


def test_key_rotation_reads_values_sealed_with_the_previous_secret(make, raw):
    old = make(auth_key_env="UMBP_TEST_KEY_A")
    assert old.put([key(0), key(1)], [blob(4096, 0), blob(8192, 1)]) == [True, True]
    rotated = make(auth_key_env="UMBP_TEST_KEY_B", auth_old_key_envs=["UMBP_TEST_KEY_A"])
    only_new = make(auth_key_env="UMBP_TEST_KEY_B")
    assert only_new.exists([key(0), key(1)]) == [False, False]
    assert rotated.exists([key(0), key(1), key(2)]) == [True, True, False]
    outs = [np.empty(4096, np.uint8), np.empty(8192, np.uint8)]
    assert rotated.get_into([key(0), key(1)], outs) == [True, True]
    assert np.array_equal(outs[0], blob(4096, 0)) and np.array_equal(outs[1], blob(8192, 1))
    assert rotated.stats()["old_key_hits"] == 2
    assert rotated.put([key(2)], [blob(4096, 2)]) == [True]  # new writes use the new secret
    assert raw.exists(value_name(SECRET_B, key(2))) and not raw.exists(value_name(SECRET_A, key(2)))


def test_auth_options_are_checked(monkeypatch, tmp_path):
    monkeypatch.setenv("UMBP_TEST_SHORT", "short")
    with pytest.raises(OptionValueError, match="at least 16 bytes"):
        RemoteConfig.from_options({"auth_key_env": "UMBP_TEST_SHORT"})
    with pytest.raises(OptionValueError, match="not set"):
        RemoteConfig.from_options({"auth_key_env": "UMBP_TEST_SURELY_UNSET"})
    with pytest.raises(OptionValueError, match="cannot read"):
        RemoteConfig.from_options({"auth_key_file": str(tmp_path / "missing")})
    with pytest.raises(OptionValueError, match="'encrypt' needs a tenant secret"):
        RemoteConfig.from_options({"encrypt": True})
    with pytest.raises(OptionValueError, match="auth_mac"):
        RemoteConfig.from_options({"auth_mac": "md5"})
    f = tmp_path / "k"
    f.write_bytes(SECRET_A.encode() + b"\n")
    cfg = RemoteConfig.from_options({"auth_key_file": str(f), "auth_old_key_files": [str(f)]})
    assert (
        cfg.auth_key == SECRET_A.encode() and SECRET_A not in repr(cfg) and SECRET_A not in str(cfg.summary())
    )


def test_encryption_without_the_package_is_a_clear_config_error(make, raw, monkeypatch):
    sealed_with_gmac = make(auth_key_env="UMBP_TEST_KEY_A", auth_mac="aes-gmac")
    assert sealed_with_gmac.put([key(1)], [blob(4096, 1)]) == [True]
    for name in (
        "cryptography",
        "cryptography.hazmat.primitives.ciphers.aead",
        "cryptography.hazmat.primitives.ciphers",
        "cryptography.exceptions",
    ):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(OptionValueError, match="remote-crypto"):
        make(auth_key_env="UMBP_TEST_KEY_A", encrypt=True)
    with pytest.raises(OptionValueError, match="remote-crypto"):
        make(auth_key_env="UMBP_TEST_KEY_A", auth_mac="aes-gmac")
    t = make(auth_key_env="UMBP_TEST_KEY_A")  # auto: HMAC-SHA256 without the package
    assert t.stats()["config"]["values"] == "authenticated (hmac-sha256)"
    assert t.put([key(0)], [blob(4096, 0)]) == [True]
    assert t.get_into([key(0)], [np.empty(4096, np.uint8)]) == [True]
    # a value another writer sealed with AES-GMAC cannot be verified here: a counted miss, not an error
    assert t.get_into([key(1)], [np.empty(4096, np.uint8)]) == [False]
    assert t.stats()["unsupported_values"] == 1 and t.stats()["connection_errors"] == 0


def test_an_unauthenticated_tier_warns_at_start(make, caplog):
    with caplog.at_level("WARNING", logger="umbp.remote"):
        make()
    assert "unauthenticated" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="umbp.remote"):
        make(auth_key_env="UMBP_TEST_KEY_A")
    assert "unauthenticated" not in caplog.text


@pytest.mark.parametrize("scheme", [1, 2], ids=["hmac", "gmac"])
@pytest.mark.parametrize("size", [0, 4096, 256 << 10, (256 << 10) + 1])
def test_one_shot_and_streamed_tags_agree(scheme, size):
    """A value sealed in one call verifies when its tag is fed chunk by chunk while it is received."""
    from umbp.pool.remote.auth import TagStream, TenantKeys, _mac

    keys = TenantKeys.derive(SECRET_A.encode())
    payload, nonce, fields = blob(size, 5), bytes(range(12)), bytes(range(64))
    stream = TagStream(scheme, keys, fields, key(1), nonce)
    for at in range(0, size, 10_000):
        stream.update(memoryview(payload[at : at + 10_000]))
    assert stream.digest() == _mac(scheme, keys, fields, key(1), payload, nonce)
