"""The pool's sub-packages keep every public import path users had: `umbp.pool`, and the old module
paths (`umbp.pool.ssd`, `umbp.pool.remote`, `umbp.pool.dram`), which are now the packages themselves."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_old_module_paths_still_export_their_names():
    from umbp.pool import Arena, DramIndex, DramPool, PageAllocator, RecordInfo, Slot, SsdTier, TieredPool
    from umbp.pool.dram import OPTIONS, DramOptions
    from umbp.pool.dram import DramPool as DramPool2
    from umbp.pool.ssd import SsdDirectoryError, SsdError, SsdLockedError, SsdOptions, scan_directory
    from umbp.pool.ssd import SsdTier as SsdTier2

    assert DramPool2 is DramPool and SsdTier2 is SsdTier and issubclass(SsdLockedError, SsdError)
    assert OPTIONS and DramOptions and callable(scan_directory) and SsdDirectoryError and SsdOptions
    assert Arena and DramIndex and PageAllocator and RecordInfo and Slot and TieredPool


def test_remote_names_resolve_through_the_package():
    pytest.importorskip("redis")
    from umbp.pool.remote import GET_WINDOW_BYTES, PUT_SEND_BYTES, RedisTier, RemoteConfig
    from umbp.pool.remote.config import RemoteConfig as RemoteConfig2
    from umbp.pool.remote.tier import RedisTier as RedisTier2

    assert RedisTier is RedisTier2 and RemoteConfig is RemoteConfig2 and GET_WINDOW_BYTES > 0 < PUT_SEND_BYTES
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        from umbp.pool import remote

        _ = remote.Nope


def test_remote_config_and_value_format_do_not_need_redis_py():
    """Validating the shared tier's options or reading a value's header must work without the `redis`
    extra: the package resolves RedisTier (which needs redis-py) only when asked for it."""
    code = (
        "import sys; sys.modules['redis'] = None\n"
        "from umbp.pool.remote import RemoteConfig\n"
        "from umbp.pool.remote.format import HEADER_SIZE\n"
        "from umbp.pool.remote.auth import namespace_of\n"
        "RemoteConfig.from_options({'url': 'redis://127.0.0.1:6379/0'})\n"
        "try:\n"
        "    from umbp.pool.remote import RedisTier\n"
        "except ImportError:\n"
        "    print('ok', HEADER_SIZE > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok True", out.stderr[-2000:]
