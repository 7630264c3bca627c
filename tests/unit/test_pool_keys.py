"""Keys are checked the same way at every tier's interface: a str that encodes to UTF-8, else InvalidKeyError."""

from __future__ import annotations

import pytest

from umbp.pool import DramPool, InvalidKeyError, SsdTier, UmbpValueError
from umbp.pool.tiered import TieredPool

BAD_KEYS = [1, b"k", None, ("a",), "lone \ud800 surrogate"]


@pytest.fixture(params=["dram", "ssd", "tiered", "redis"])
def tier(request, tmp_path):
    if request.param == "dram":
        pool = DramPool(capacity_bytes=1 << 20)
    elif request.param == "ssd":
        pool = SsdTier(str(tmp_path), 1 << 20, queue_bytes=64 << 10, io_threads=0)
    elif request.param == "tiered":
        pool = TieredPool([DramPool(capacity_bytes=1 << 20), SsdTier(str(tmp_path), 1 << 20, io_threads=0)])
    else:  # never connects: the key is refused before any I/O (port 1 has no server)
        pytest.importorskip("redis", reason="the shared tier needs the 'redis' extra")
        from umbp.pool.remote.tier import RedisTier, RemoteConfig

        pool = RedisTier(
            RemoteConfig.from_options({"url": "redis://127.0.0.1:1/0", "connect_timeout_s": 0.05})
        )
    yield pool
    pool.close()


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_bad_keys_are_one_clear_error_at_every_tier(tier, key):
    calls = {
        "exists": lambda: tier.exists([key]),
        "put": lambda: tier.put(["ok", key], [b"1", b"2"]),
        "get_into": lambda: tier.get_into([key], [bytearray(1)]),
        "remove": lambda: tier.remove([key]),
    }
    for op, call in calls.items():
        with pytest.raises(InvalidKeyError) as err:
            call()
        msg = str(err.value)
        assert msg.startswith("umbp: ") and (op in msg or "key" in msg), msg
        assert isinstance(err.value, UmbpValueError) and isinstance(err.value, ValueError)
        msg.encode()  # the message itself is printable (a surrogate is escaped, not re-raised)
    if type(tier).__name__ != "RedisTier":
        assert tier.exists(["ok"]) == [False]  # the batch was refused before anything was stored


def test_ssd_key_length_is_the_same_error(tmp_path):
    with SsdTier(str(tmp_path), 1 << 20, io_threads=0) as tier:
        with pytest.raises(InvalidKeyError, match="is 1025 bytes; the SSD tier takes keys up to 1024 bytes"):
            tier.put(["x" * 1025], [b"1"])
        assert tier.put(["é" * 512], [b"1"]) == [True]  # 1024 utf-8 bytes
