"""The one options layer: strict types and ranges, the key's name in every error, generated doc tables."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest

from umbp.pool import DramPool, SsdTier
from umbp.pool.dram.tier import DramOptions
from umbp.pool.errors import OptionValueError, UmbpValueError, UnknownOptionError
from umbp.pool.options import _META
from umbp.pool.remote.config import RemoteConfig
from umbp.pool.ssd.options import SsdOptions
from umbp.tools import options_doc
from umbp.vllm.config import GIB, ConfigError, UMBPConfig, UnknownConfigKeyError

OPTION_SETS = [UMBPConfig, DramOptions, SsdOptions, RemoteConfig]
REQUIRED = {
    DramOptions: {"capacity_bytes": 1 << 20},
    SsdOptions: {"dirs": "/nonexistent", "capacity_bytes": 1 << 20},
}


def _bad_values(hint) -> list:
    """Values no option of this annotation may accept (whatever its range)."""
    args = set(typing.get_args(hint))
    if hint is bool or args == {bool, str}:
        return [1, 0, "yes", "on", "1", None, math.nan, [True]]
    if hint is int or args == {int, type(None)}:
        return [math.nan, math.inf, -math.inf, True, False, "8", 1.5, [1], {}] + (
            [] if type(None) in args else [None]
        )
    if hint is float or args == {float, type(None)}:
        return [math.nan, math.inf, -math.inf, True, "0.5", [0.5]] + ([] if type(None) in args else [None])
    if hint is str or args == {str, type(None)}:
        return [3, b"x", ["a"]] + ([] if type(None) in args else [None])
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (str, ...):
        return [3, None, [1], [""], {"a": 1}]
    if args == {tuple[str, ...], type(None)}:
        return [3, [1], [""], {"a": 1}, []]
    return [object(), 3.5, None]


def _shown(value) -> str:
    """A test id that is the same in every run (a bare object's repr holds its address)."""
    return "object()" if type(value) is object else repr(value)


def _cases():
    for cls in OPTION_SETS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if _META in f.metadata:
                for value in _bad_values(hints[f.name]):
                    yield pytest.param(cls, f.name, value, id=f"{cls.__name__}.{f.name}={_shown(value)}")
        for alias in (n for n in cls.option_names() if n not in {f.name for f in dataclasses.fields(cls)}):
            for value in (math.nan, math.inf, True, "8", None, 0, -1, 1e300):
                yield pytest.param(cls, alias, value, id=f"{cls.__name__}.{alias}={value!r}")


@pytest.mark.parametrize("cls,name,value", list(_cases()))
def test_every_option_rejects_wrong_types_naming_the_key(cls, name, value):
    base = dict(REQUIRED.get(cls, {}))
    if name in ("dram_gb", "ssd_gb"):  # an alias replaces its byte option
        base.pop("capacity_bytes", None)
    with pytest.raises(OptionValueError) as err:
        cls.from_options({**base, name: value})
    assert f"'{name}'" in str(err.value) and str(err.value).startswith("umbp: ")
    assert isinstance(err.value, UmbpValueError)


@pytest.mark.parametrize(
    "extra,key",
    [
        ({"dram_gb": math.nan}, "dram_gb"),
        ({"dram_gb": math.inf}, "dram_gb"),
        ({"ssd_gb": math.nan}, "ssd_gb"),
        ({"ssd_gb": -math.inf}, "ssd_gb"),
        ({"dram_gb": True}, "dram_gb"),
        ({"quarantine_s": -1}, "quarantine_s"),
        ({"quarantine_s": math.nan}, "quarantine_s"),
        ({"quarantine_s": 1e9}, "quarantine_s"),
        ({"dram_bytes": 1.5}, "dram_bytes"),
        ({"dram_bytes": 100}, "dram_bytes"),
        ({"dram_gb": 1e300}, "dram_gb"),
        ({"checksum": "on"}, "checksum"),
        ({"checksum": 1}, "checksum"),
        ({"decode_saves": "yes"}, "decode_saves"),
        ({"pinned": 1}, "pinned"),
        ({"ssd_dirs": ["/a", ""]}, "ssd_dirs"),
        ({"load_failure_policy": True}, "load_failure_policy"),
        ({"remote": {}}, "remote"),
        ({"remote": {"url": "redis://h:1", "timeout_s": 0}}, "remote"),
    ],
)
def test_connector_values_the_old_parser_let_through(extra, key):
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config key '{key}'"):
        UMBPConfig.from_extra_config(extra)


def test_accepted_spellings_are_normalised():
    cfg = UMBPConfig.from_extra_config(
        {
            "dram_bytes": 2e9,
            "checksum": "False",
            "pinned": False,
            "ssd_dirs": "/d",
            "ssd_gb": 1,
            "quarantine_s": 0,
        }
    )
    assert cfg.dram_bytes == 2_000_000_000 and type(cfg.dram_bytes) is int
    assert cfg.checksum is False and cfg.pinned == "off" and cfg.ssd_dirs == ("/d",) and cfg.ssd_bytes == GIB
    assert dataclasses.replace(cfg, tenant="t").dram_bytes == cfg.dram_bytes  # revalidates the stored form
    assert UMBPConfig.from_extra_config({"remote": "redis://h:1/0"}).remote == (("url", "redis://h:1/0"),)


def test_unknown_keys_suggest_and_list():
    with pytest.raises(UnknownConfigKeyError) as err:
        UMBPConfig.from_extra_config({"quarantine_sec": 1, "zzz": 2})
    msg = str(err.value)
    assert (
        "'quarantine_sec', 'zzz' (did you mean 'quarantine_s'?); valid options: dram_bytes, dram_gb," in msg
    )
    assert isinstance(err.value, UnknownOptionError) and isinstance(err.value, ConfigError)
    with pytest.raises(
        UnknownOptionError, match="SSD tier option.*'queue_byte' \\(did you mean 'queue_bytes'\\?\\)"
    ):
        SsdOptions.from_options({"dirs": "/d", "capacity_bytes": 1 << 20, "queue_byte": 1})
    with pytest.raises(UnknownConfigKeyError, match="names must be strings, got 1"):
        UMBPConfig.from_extra_config({1: 2})
    with pytest.raises(ConfigError, match="must be a JSON object, got a list"):
        UMBPConfig.from_extra_config(["dram_gb", 1])


def test_both_forms_of_a_size_is_an_error():
    with pytest.raises(
        ConfigError, match="give kv_connector_extra_config key 'ssd_gb' or 'ssd_bytes', not both"
    ):
        UMBPConfig.from_extra_config({"ssd_gb": 1, "ssd_bytes": GIB})


def test_direct_construction_is_checked_too(tmp_path):
    with pytest.raises(OptionValueError, match="DRAM pool option 'high_watermark'.*got nan"):
        DramPool(capacity_bytes=1 << 20, high_watermark=math.nan)
    with pytest.raises(OptionValueError, match="SSD tier option 'health_interval_s'.*got inf"):
        SsdTier(str(tmp_path), 1 << 20, health_interval_s=math.inf)
    with pytest.raises(OptionValueError, match="SSD tier option 'io_threads'.*got True"):
        SsdTier(str(tmp_path), 1 << 20, io_threads=True)
    with pytest.raises(
        ConfigError, match="'low_watermark' \\(0.9\\) must not exceed 'high_watermark' \\(0.5\\)"
    ):
        UMBPConfig(high_watermark=0.5, low_watermark=0.9)


def test_ssd_tier_from_options(tmp_path):
    tier = SsdTier.from_options(
        {"dirs": [str(tmp_path)], "ssd_gb": 0.01, "direct_io": "false", "io_threads": 0}
    )
    try:
        assert tier.put(["k"], [b"abc"]) == [True]
        out = bytearray(3)
        assert tier.get_into(["k"], [out]) == [True] and out == b"abc"
    finally:
        tier.close()


def test_every_doc_table_matches_the_definitions():
    root = Path(__file__).resolve().parents[2]
    assert options_doc.stale(root) == []
    readme = (root / "README.md").read_text()
    broken = readme.replace("| `quarantine_s` | number >= 0", "| `quarantine_s` | number > 0", 1)
    assert broken != readme and options_doc.render(broken) == readme  # an edited row is caught and restored
    for cls in OPTION_SETS:  # every option (and alias) has a row and a help string
        table = cls.table()
        assert all(f"| `{name}` |" in table for name in cls.option_names())
        assert all(text.strip() for text in cls.option_help().values())
