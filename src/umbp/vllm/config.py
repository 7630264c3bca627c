"""`kv_connector_extra_config` keys of the UMBPConnector, validated with one clear error per bad key.

Built on the one options layer (umbp.pool.options): strict types, ranges, "did you mean" for unknown keys, the
key's name in every error, and the help strings the README's and docs/vllm.md's tables are generated
from (`python -m umbp.tools.options_doc`). Kept free of vLLM imports so it can be unit-tested, documented
and run before vLLM builds anything (see umbp.vllm.plugin).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from umbp.pool.errors import OptionValueError, UmbpValueError, UnknownOptionError
from umbp.pool.options import Invalid, Options, option, option_set
from umbp.redact import scrub, secrets_of, shown_value

GIB = 1 << 30
ARENA_PAGE = 4096  # the scheduler's slot granularity: a slot spans whole pages, its pad is its own
PIB = 1 << 50


class ConfigError(OptionValueError):
    """A bad `kv_connector_extra_config` value; the message names the key and the fix."""


class UnknownConfigKeyError(ConfigError, UnknownOptionError):
    """A `kv_connector_extra_config` key the connector does not know (usually a typo)."""


def _pinned(value: Any) -> Any:
    return ("on" if value else "off") if isinstance(value, bool) else value


def _remote(value: Any) -> tuple[tuple[str, Any], ...]:
    """A Redis URL or an options dict, validated now by the remote tier's own rules, so a bad shared-tier
    setting stops start-up with the other config errors instead of after the model has loaded."""
    if value == ():
        return ()  # the default: no shared tier
    if isinstance(value, str):
        value = {"url": value}
    elif isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)  # the stored form (sorted pairs), e.g. from dataclasses.replace
    if not isinstance(value, Mapping) or not value or not all(isinstance(k, str) for k in value):
        raise Invalid('a Redis URL or an options dict like {"url": "redis://127.0.0.1:6379/0"}')
    from umbp.pool.remote.config import RemoteConfig

    try:
        RemoteConfig.from_options(value)
    except UmbpValueError as exc:  # its messages are redacted; scrubbing every secret the value holds as well
        # (as written, decoded, or read from the environment) keeps that true for any message quoting it
        raise Invalid("", reason=scrub(str(exc), secrets_of(value)).removeprefix("umbp: ")) from None
    except Exception as exc:  # noqa: BLE001 - a config value must give a config error, never a crash
        raise Invalid("", reason=f"not a valid shared-tier configuration ({type(exc).__name__})") from None
    return tuple(sorted(value.items()))


def _show_remote(value: Any) -> str:
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    return shown_value(value)


@option_set
class UMBPConfig(Options):
    """The connector's options; `from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)`."""

    where: ClassVar[str] = "kv_connector_extra_config key"
    unknown_error: ClassVar[type[Exception]] = UnknownConfigKeyError
    value_error: ClassVar[type[Exception]] = ConfigError

    dram_bytes: int = option(
        4 * GIB,
        help="DRAM arena per worker (per rank); each rank keeps its own shard of every object",
        minimum=ARENA_PAGE,
        maximum=PIB,
        gib_alias="dram_gb",
    )
    high_watermark: float = option(
        0.95,
        help="above this fraction of the arena, least-recently-used objects are evicted ...",
        above=0,
        maximum=1,
    )
    low_watermark: float = option(
        0.85, help="... down to this fraction (at most `high_watermark`)", above=0, maximum=1
    )
    boundary_page: bool = option(
        True,
        help="store the attention page at each hybrid boundary, so a restore reaches the boundary a "
        "local prefix hit would; `false` stores whole pages only, for experiments",
    )
    tail_unit: int = option(
        16,
        help="attention-only models: also store the prompt's partly filled last block, keyed at the prompt's "
        "last whole `tail_unit` tokens, so a repeat resumes there instead of at the block start; 0 = off",
        minimum=0,
        maximum=1 << 20,
    )
    decode_saves: bool = option(
        False,
        help="also store blocks completed during decode (prompt blocks and boundary states are always "
        "stored)",
    )
    load_failure_policy: Literal["recompute", "fail"] = option(
        "recompute",
        help="a failed load makes vLLM recompute the request; `fail` fails it instead. umbp sets "
        "vLLM's `kv_load_failure_policy` to this value (inside a MultiConnector, on the outer config vLLM reads)",
    )
    pinned: str = option(
        "auto",
        help="page-locked arena: `auto` (when CUDA is present), `on`, `off`",
        convert=_pinned,
        choices=("auto", "on", "off"),
        type_doc="`auto`, `on`, `off` (or true/false)",
    )
    tenant: str = option("", help="an isolation label folded into the key namespace")
    checksum: bool = option(True, help="verify each loaded page against the checksum taken when it was saved")
    ssd_dirs: tuple[str, ...] = option(
        (),
        help="SSD tier directories (one per drive); each rank writes its shard under "
        "`<dir>/<namespace>/<rank>`; a restarted engine finds what is there",
        nonempty=True,
    )
    ssd_bytes: int = option(
        64 * GIB, help="SSD capacity per rank", minimum=64 << 10, maximum=PIB, gib_alias="ssd_gb"
    )
    remote: tuple[tuple[str, Any], ...] = option(
        (),
        help='the shared tier on Redis ≥ 7 / Valkey: a URL (`"redis://127.0.0.1:6379/0"`) or an options '
        "dict (`url`/`urls`, `cluster`, `username`, `password`/`password_env`, `tls*`, `timeout_s`, `ttl_s`, "
        "`quarantine_s`, ...; see docs/remote.md); checked at start-up, shown with "
        "passwords masked",
        convert=_remote,
        show=_show_remote,
        type_doc="URL string or options dict",
    )
    quarantine_s: float = option(
        30.0,
        help="after a failed load, the objects at fault are not offered again for this long (unless "
        "re-saved); 0 = off",
        minimum=0,
        maximum=86400,
    )
    handoff_timeout_s: float = option(
        10.0,
        help="store-mediated P/D, on P (`kv_role` `kv_producer`): the longest a hand-off may take to be "
        "visible on the shared tier; then it is released and counted (`handoff_timeouts`)",
        above=0,
        maximum=3600,
    )
    handoff_wait_s: float = option(
        5.0,
        help="store-mediated P/D, on D (`kv_role` `kv_consumer`): the longest a request waits for P's "
        "hand-off before its missing part is recomputed (`handoff_misses`)",
        above=0,
        maximum=3600,
    )

    def check(self) -> None:
        if self.low_watermark > self.high_watermark:
            raise self.fail(
                f"{self.where} 'low_watermark' ({self.low_watermark}) must not exceed "
                f"'high_watermark' ({self.high_watermark})"
            )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> UMBPConfig:
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(
                f"umbp: kv_connector_extra_config must be a JSON object, got a {type(extra).__name__}"
            )
        return cls.from_options(extra)

    def remote_tier(self):
        """A RedisTier for these options (validated by umbp.pool.remote.tier); None when no shared tier is set."""
        if not self.remote:
            return None
        from umbp.pool.remote.tier import RedisTier, RemoteConfig

        return RedisTier(RemoteConfig.from_options(dict(self.remote)))
