"""kv_connector_extra_config parsing: every bad value names its key and the fix (no vLLM needed)."""

import pytest

from umbp.vllm.config import GIB, ConfigError, UMBPConfig


def test_defaults():
    cfg = UMBPConfig.from_extra_config(None)
    assert cfg.dram_bytes == 4 * GIB and cfg.boundary_page and cfg.load_failure_policy == "recompute"


def test_values_parse():
    cfg = UMBPConfig.from_extra_config(
        {
            "dram_gb": 0.5,
            "boundary_page": "false",
            "decode_saves": True,
            "pinned": False,
            "high_watermark": 0.9,
            "low_watermark": 0.5,
            "tenant": "a",
            "checksum": "TRUE",
        }
    )
    assert cfg.dram_bytes == GIB // 2 and not cfg.boundary_page and cfg.decode_saves
    assert cfg.pinned == "off" and cfg.tenant == "a" and cfg.checksum


@pytest.mark.parametrize(
    "extra,names",
    [
        ({"dram_gbs": 1}, "dram_gbs"),
        ({"dram_gb": 0}, "dram_gb"),
        ({"dram_gb": -1}, "dram_gb"),
        ({"dram_gb": "lots"}, "dram_gb"),
        ({"dram_gb": 1, "dram_bytes": 5}, "dram_bytes"),
        ({"high_watermark": 1.5}, "high_watermark"),
        ({"high_watermark": 0.5, "low_watermark": 0.8}, "low_watermark"),
        ({"boundary_page": "maybe"}, "boundary_page"),
        ({"load_failure_policy": "crash"}, "load_failure_policy"),
        ({"pinned": "sometimes"}, "pinned"),
        ({"tenant": 3}, "tenant"),
    ],
)
def test_bad_values_name_the_key(extra, names):
    with pytest.raises(ConfigError, match=names):
        UMBPConfig.from_extra_config(extra)
