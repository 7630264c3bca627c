"""`kv_connector_extra_config` keys of the UMBPConnector, validated with one clear error per bad key.

Kept free of vLLM imports so it can be unit-tested and documented on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

GIB = 1 << 30
ARENA_PAGE = 4096  # the scheduler's slot granularity: a slot spans whole pages, its pad is its own


class ConfigError(ValueError):
    """A bad `kv_connector_extra_config` value; the message names the key and the fix."""


@dataclass(frozen=True)
class UMBPConfig:
    dram_bytes: int = 4 * GIB  # per worker (per rank): each rank holds its shard of every object
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    boundary_page: bool = True  # store the attention page at each hybrid boundary (the seed's fix)
    decode_saves: bool = False  # also store blocks completed during decode
    load_failure_policy: str = "recompute"  # a failed load is a recompute, never a crash
    pinned: str = "auto"  # page-locked arena: "auto" (when CUDA is present), "on", "off"
    tenant: str = ""  # optional isolation label folded into the key namespace
    checksum: bool = True  # verify every loaded page against the checksum taken when it was saved
    ssd_dirs: tuple[str, ...] = ()  # SSD tier directories (one per drive); empty = no SSD tier
    ssd_bytes: int = 64 * GIB  # SSD capacity per worker (per rank)
    remote: tuple[tuple[str, Any], ...] = ()  # shared tier options (umbp.pool.remote.RemoteConfig); empty = off
    quarantine_s: float = 30.0  # how long an object whose load failed is not offered again

    def remote_tier(self):
        """A RedisTier for these options (validated by umbp.pool.remote); None when no shared tier is set."""
        if not self.remote:
            return None
        from umbp.pool.remote import RedisTier, RemoteConfig

        return RedisTier(RemoteConfig.from_options(dict(self.remote)))

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> UMBPConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)} | {"dram_gb", "ssd_gb"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"umbp: unknown kv_connector_extra_config key(s) {unknown}; valid keys are {sorted(known)}"
            )
        values: dict[str, Any] = {}
        if "dram_gb" in extra and "dram_bytes" in extra:
            raise ConfigError("umbp: give either 'dram_gb' or 'dram_bytes' in kv_connector_extra_config, not both")
        if "dram_gb" in extra:
            gb = _number(extra, "dram_gb")
            values["dram_bytes"] = int(gb * GIB)
        if "dram_bytes" in extra:
            values["dram_bytes"] = int(_number(extra, "dram_bytes"))
        if "dram_bytes" in values and values["dram_bytes"] <= 0:
            raise ConfigError(
                f"umbp: DRAM capacity must be positive (got {values['dram_bytes']} bytes); "
                "set kv_connector_extra_config 'dram_gb' to e.g. 64"
            )
        for key in ("high_watermark", "low_watermark"):
            if key in extra:
                values[key] = _number(extra, key)
                if not 0.0 < values[key] <= 1.0:
                    raise ConfigError(f"umbp: '{key}' must be in (0, 1], got {extra[key]!r}")
        for key in ("boundary_page", "decode_saves", "checksum"):
            if key in extra:
                values[key] = _bool(extra, key)
        if "load_failure_policy" in extra:
            values["load_failure_policy"] = _choice(extra, "load_failure_policy", ("recompute", "fail"))
        if "pinned" in extra:
            raw = extra["pinned"]
            if isinstance(raw, bool):
                raw = "on" if raw else "off"
            values["pinned"] = _choice({"pinned": raw}, "pinned", ("auto", "on", "off"))
        if "tenant" in extra:
            if not isinstance(extra["tenant"], str):
                raise ConfigError(f"umbp: 'tenant' must be a string, got {extra['tenant']!r}")
            values["tenant"] = extra["tenant"]
        if "ssd_dirs" in extra:
            dirs = extra["ssd_dirs"]
            dirs = [dirs] if isinstance(dirs, str) else dirs
            if not isinstance(dirs, list | tuple) or not all(isinstance(d, str) and d for d in dirs):
                raise ConfigError(f"umbp: 'ssd_dirs' must be a directory or a list of directories, got {dirs!r}")
            values["ssd_dirs"] = tuple(dirs)
        if "ssd_gb" in extra:
            values["ssd_bytes"] = int(_number(extra, "ssd_gb") * GIB)
            if values["ssd_bytes"] <= 0:
                raise ConfigError(f"umbp: 'ssd_gb' must be positive, got {extra['ssd_gb']!r}")
        if "remote" in extra:
            remote = extra["remote"]
            if isinstance(remote, str):
                remote = {"url": remote}
            if not isinstance(remote, dict) or not remote:
                raise ConfigError(
                    f"umbp: 'remote' must be a Redis URL or an options dict like {{\"url\": "
                    f"\"redis://127.0.0.1:6379/0\"}}, got {remote!r}"
                )
            values["remote"] = tuple(sorted(remote.items()))
        if "quarantine_s" in extra:
            values["quarantine_s"] = _number(extra, "quarantine_s")
        cfg = cls(**values)
        if cfg.low_watermark > cfg.high_watermark:
            raise ConfigError(
                f"umbp: 'low_watermark' ({cfg.low_watermark}) must not exceed 'high_watermark' "
                f"({cfg.high_watermark})"
            )
        return cfg


def _number(extra: dict[str, Any], key: str) -> float:
    value = extra[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"umbp: '{key}' must be a number, got {value!r}") from None
    return float(value)


def _bool(extra: dict[str, Any], key: str) -> bool:
    value = extra[key]
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "on", "off"):
        return value.lower() in ("true", "1", "on")
    raise ConfigError(f"umbp: '{key}' must be true or false, got {value!r}")


def _choice(extra: dict[str, Any], key: str, choices: tuple[str, ...]) -> str:
    value = extra[key]
    if value not in choices:
        raise ConfigError(f"umbp: '{key}' must be one of {list(choices)}, got {value!r}")
    return value
