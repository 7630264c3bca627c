"""The deployments `umbp replay` models (each a "layout"): cache groups, GPU pool, transfer and step-time model.

A layout is a small config (built in, or a JSON file with the same fields). Bytes are per rank: every
rank holds its shard of every object at the same arena slot, so transfers run in parallel across ranks
(latency uses per-rank bytes) while the reported bytes stored are multiplied by ``ranks``.

Why the built-in numbers are what they are (assumptions, stated in docs/replay.md):

* ``kimi-k3``: Kimi K3's exact KV-cache config is not public. We take Kimi-Linear's shape (MLA full
  attention beside KDA recurrent layers, 1 MLA : 3 KDA, MLA latent 576 x bf16 = 1152 B per layer-token),
  vLLM's unified page (a KDA state page equals one attention page per layer, so one boundary attention
  page costs a third of a KDA checkpoint, as the upstream pull request says), the deployment's TP8/DCP8 (a 1024-token scheduler
  block = 128-token pages on each of 8 DCP ranks), prefix_match_unit 128, and DSpark's EAGLE-style drop
  confined to the MLA group (vLLM 0.32 flags MLA specs with ``non_causal_multi_token_decode``). KDA
  exports its prompt-tail checkpoint inside the final chunk (vLLM's ROCm Kimi-K3 fused KDA, alignment 64).
* ``granite-4.0-h``: the README demo's Granite-4.0-H-350M case: 400-token blocks, u=16, 4 attention layers
  (4 KV heads x 64 x bf16) and 28 Mamba2 layers, unified 409,600-byte pages, one GPU, no EAGLE; Mamba2
  exports its prompt-tail checkpoint inside the final chunk (vLLM's mamba_mixer2, alignment 1).

Stdlib only: building the vLLM specs from a layout lives in :mod:`umbp.replay.engine`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

GB = 10**9
KINDS = ("mla", "attention", "state")
MAX_LAYOUT_BYTES = 1 << 20  # a layout file is a small config
# the sane range of each count (a layout is a deployment the replay simulates in one process)
BOUNDS = {
    "unit": (1, 1 << 20),
    "block_size": (1, 1 << 20),
    "layers": (1, 1 << 16),
    "page_bytes": (1, 1 << 40),
    "checkpoint_alignment": (1, 1 << 20),
    "num_gpu_blocks": (4, 1 << 20),
    "max_num_batched_tokens": (1, 1 << 24),
    "max_num_seqs": (1, 1 << 16),
    "max_model_len": (1, 1 << 24),
    "ranks": (1, 1 << 16),
    "retention": (0, 1 << 24),
    "dcp": (1, 1 << 16),
}
DRAM_GB = (4096 / 2**30, 2.0**20)  # umbp's dram_bytes takes 4 KiB to 1 PiB per rank (dram_gb in GiB)


class LayoutError(ValueError):
    """A bad layout config; the message names the field."""


@dataclass(frozen=True)
class GroupConfig:
    """One KV-cache group. ``page_bytes``: one layer's page for one block, on one rank. ``block_size`` is
    per rank, as in vLLM's specs: under the layout's DCP an attention block spans ``block_size * dcp``."""

    kind: str  # "mla" | "attention" (full attention) | "state" (Mamba2/GDN/KDA recurrent state, align mode)
    block_size: int
    layers: int
    page_bytes: int
    eagle: bool = False  # takes EAGLE/DSpark's drop when the layout's drop is on (vLLM: is_eagle_group)
    # state groups: the kernel exports the prompt-tail state inside the final chunk (vLLM MambaSpec
    # num_prefill_checkpoint_blocks=1 with this alignment; Mamba2: 1, Kimi-K3 fused KDA on gfx950: 64).
    # None: no internal checkpoint, the scheduler stops a chunk at the tail and hands off a CoW copy.
    checkpoint_alignment: int | None = None

    @property
    def object_bytes(self) -> int:
        return self.layers * self.page_bytes


@dataclass(frozen=True)
class TimingConfig:
    """The modelled clock. Bandwidths are per rank and default to hardware-limits.md's H200 numbers:
    bulk H2D + index_copy_ scatter 47 GB/s (loads), index_select gather + bulk D2H 51.5 GB/s (saves)."""

    step_overhead_s: float = 0.005  # per engine step with work
    prefill_s_per_token: float = 40e-6  # per scheduled token
    attention_s_per_token_per_ktoken: float = 0.0  # extra per scheduled token per 1k tokens of its context
    h2d_gbps: float = 47.0
    d2h_gbps: float = 51.5
    transfer_latency_s: float = 50e-6  # fixed cost per load/save job

    def step_seconds(self, scheduled_tokens: int, context_ktoken_tokens: float) -> float:
        """Seconds one step with ``scheduled_tokens`` takes; ``context_ktoken_tokens`` = sum over requests
        of scheduled tokens x context length / 1000."""
        if scheduled_tokens <= 0:
            return 0.0
        return (
            self.step_overhead_s
            + self.prefill_s_per_token * scheduled_tokens
            + self.attention_s_per_token_per_ktoken * context_ktoken_tokens
        )


@dataclass(frozen=True)
class ReplayLayout:
    name: str
    description: str
    groups: tuple[GroupConfig, ...]
    unit: int  # vLLM prefix_match_unit (= hash_block_size)
    eagle_drop: bool  # EAGLE/DSpark-style drop on (a fake EAGLE draft config is attached)
    num_gpu_blocks: int  # small on purpose: turns must fall out of the GPU prefix cache
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    ranks: int  # ranks holding a shard of every object (bytes stored are reported x ranks)
    dram_gb_per_rank: float
    retention: int  # the positive prefix_cache_retention_interval of the ablation (0 is always run)
    timing: TimingConfig = field(default_factory=TimingConfig)
    dcp: int = 1  # vLLM decode_context_parallel_size (configured on the Scheduler, with TP = dcp)

    def span(self, g: GroupConfig) -> int:
        """Tokens one block of ``g`` covers: attention blocks are DCP-sharded, recurrent state is not."""
        return g.block_size * (self.dcp if g.kind != "state" else 1)

    @property
    def scheduler_block_size(self) -> int:
        return math.lcm(*(self.span(g) for g in self.groups))

    def gpu_pool_tokens(self) -> int:
        """Tokens of full attention the GPU pool holds (what a request's attention table can use)."""
        return self.num_gpu_blocks * self.span(self.groups[0])

    def validate(self) -> ReplayLayout:
        if not self.groups:
            raise LayoutError(f"layout {self.name!r}: 'groups' is empty")
        _check_fields(self, f"layout {self.name!r}: ", skip=("groups", "timing"))
        _check_fields(self.timing, f"layout {self.name!r}: timing ")
        for i, g in enumerate(self.groups):
            _check_fields(g, f"layout {self.name!r}: group {i} ")
            if g.kind not in KINDS:
                raise LayoutError(f"layout {self.name!r}: group {i} kind {g.kind!r} is not one of {KINDS}")
            if g.block_size <= 0 or self.span(g) % self.unit:
                raise LayoutError(
                    f"layout {self.name!r}: group {i} block span {self.span(g)} is not a "
                    f"positive multiple of unit {self.unit}"
                )
            if g.layers <= 0 or g.page_bytes <= 0:
                raise LayoutError(f"layout {self.name!r}: group {i} needs positive 'layers' and 'page_bytes'")
        if not any(g.kind == "state" for g in self.groups) or self.groups[0].kind == "state":
            raise LayoutError(f"layout {self.name!r}: needs an attention group first and a 'state' group")
        if self.retention < 0 or self.retention % self.scheduler_block_size:
            raise LayoutError(
                f"layout {self.name!r}: retention {self.retention} must be a non-negative "
                f"multiple of the scheduler block size {self.scheduler_block_size}"
            )
        if self.num_gpu_blocks < 4 or self.ranks < 1 or self.dram_gb_per_rank <= 0:
            raise LayoutError(f"layout {self.name!r}: num_gpu_blocks >= 4, ranks >= 1, dram_gb_per_rank > 0")
        if self.dcp < 1 or self.ranks % self.dcp:
            raise LayoutError(
                f"layout {self.name!r}: dcp {self.dcp} must be >= 1 and divide ranks {self.ranks}"
            )
        return self

    def with_overrides(self, **changes: Any) -> ReplayLayout:
        return replace(self, **{k: v for k, v in changes.items() if v is not None}).validate()

    def summary(self) -> str:
        parts = [
            f"{g.kind} B={g.block_size}"
            + (f" (x{self.dcp} = {self.span(g)})" if self.span(g) != g.block_size else "")
            for g in self.groups
        ]
        drop = "on" if self.eagle_drop else "off"
        dcp = f", DCP {self.dcp}" if self.dcp > 1 else ""
        return (
            f"{self.name}: {' + '.join(parts)}, u={self.unit}{dcp}, EAGLE/DSpark drop {drop}, "
            f"GPU pool {self.num_gpu_blocks} blocks"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplayLayout:
        if not isinstance(data, dict):
            raise LayoutError(f"layout: expected a JSON object of layout fields, got {type(data).__name__}")
        data = dict(data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LayoutError(f"layout: unknown field(s) {unknown}; valid: {sorted(known)}")
        groups, timing = data.get("groups", ()), data.get("timing", {})
        if not isinstance(groups, list | tuple) or not all(isinstance(g, dict) for g in groups):
            raise LayoutError("layout: 'groups' must be a list of objects")
        if not isinstance(timing, dict):
            raise LayoutError("layout: 'timing' must be an object")
        try:
            data["groups"] = tuple(GroupConfig(**g) for g in groups)
            data["timing"] = TimingConfig(**timing)
            return cls(**data).validate()
        except TypeError as exc:
            raise LayoutError(f"layout: {exc}") from None


def _check_fields(obj: Any, where: str, skip: tuple[str, ...] = ()) -> None:
    """Each field of a layout dataclass has its declared type (bool is not an int, a float is finite),
    counts are in their BOUNDS, times and sizes are >= 0 and bandwidths > 0: a value that would divide by
    zero, spin the clock or allocate without bound is refused here, with its name."""
    for f in fields(obj):
        if f.name in skip:
            continue
        value, kind = getattr(obj, f.name), str(f.type)
        if value is None and "None" in kind:
            continue
        if kind.startswith("int"):
            lo, hi = BOUNDS.get(f.name, (0, 1 << 62))
            if type(value) is not int or not lo <= value <= hi:
                raise LayoutError(
                    f"{where}{f.name!r} must be an integer in [{lo}, {hi}], got {value!r}"[:300]
                )
        elif kind == "float":
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            lo, hi = DRAM_GB if f.name == "dram_gb_per_rank" else (0.0, 1e12)
            positive = f.name.endswith("gbps")
            if not ok or not lo <= value <= hi or (positive and value == 0):
                raise LayoutError(
                    f"{where}{f.name!r} must be a finite number {'> 0 and up' if positive else f'from {lo:g}'} "
                    f"to {hi:g}, got {value!r}"
                )
        elif kind in ("bool", "str") and type(value).__name__ != kind:
            raise LayoutError(f"{where}{f.name!r} must be a {kind}, got {type(value).__name__}")


KIMI_PAGE = 128 * 1152  # one layer's page on one rank: 1024-token block / DCP 8 = 128 tokens x 1152 B
GRANITE_PAGE = 2 * 400 * 4 * 64 * 2  # K and V, 400 tokens, 4 KV heads x 64, bf16

LAYOUTS: dict[str, ReplayLayout] = {
    "kimi-k3": ReplayLayout(
        name="kimi-k3",
        description="Kimi-K3-like: MLA (16 layers) + KDA (48 layers), 128-token blocks per rank (MLA spans 1024 "
        "over DCP 8), u=128, DSpark drop on the MLA group, TP8/DCP8 on vLLM's Scheduler, 1799 GB DRAM",
        groups=(
            GroupConfig("mla", 128, 16, KIMI_PAGE, eagle=True),
            GroupConfig("state", 128, 48, KIMI_PAGE, checkpoint_alignment=64),
        ),
        unit=128,
        eagle_drop=True,
        num_gpu_blocks=320,
        max_num_batched_tokens=16384,
        max_num_seqs=32,
        max_model_len=131072,
        ranks=8,
        dram_gb_per_rank=1799 / 8,
        retention=8192,
        timing=TimingConfig(step_overhead_s=0.01, prefill_s_per_token=40e-6),
        dcp=8,
    ),
    "granite-4.0-h": ReplayLayout(
        name="granite-4.0-h",
        description="Granite-4.0-H-350M (400-token blocks): attention (4 layers) + Mamba2 (28 layers), "
        "400-token blocks, u=16, no EAGLE, one GPU",
        groups=(
            GroupConfig("attention", 400, 4, GRANITE_PAGE),
            GroupConfig("state", 400, 28, GRANITE_PAGE, checkpoint_alignment=1),
        ),
        unit=16,
        eagle_drop=False,
        num_gpu_blocks=800,
        max_num_batched_tokens=8192,
        max_num_seqs=32,
        max_model_len=131072,
        ranks=1,
        dram_gb_per_rank=128,
        retention=2000,
        timing=TimingConfig(step_overhead_s=0.004, prefill_s_per_token=4e-6),
    ),
}
ALIASES = {"kimi": "kimi-k3", "granite": "granite-4.0-h"}


def load_layout(name_or_path: str) -> ReplayLayout:
    """A built-in layout by name (``kimi-k3``, ``granite-4.0-h``) or a JSON file with the same fields."""
    key = ALIASES.get(name_or_path, name_or_path)
    if key in LAYOUTS:
        return LAYOUTS[key].validate()
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise LayoutError(f"layout {name_or_path!r}: not a built-in ({sorted(LAYOUTS)}) nor a JSON file")
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_LAYOUT_BYTES + 1)
    except OSError as exc:
        raise LayoutError(f"layout {path}: cannot read it: {exc.strerror or exc}") from None
    if len(raw) > MAX_LAYOUT_BYTES:
        raise LayoutError(
            f"layout {path}: larger than {MAX_LAYOUT_BYTES >> 20} MiB; a layout is a small JSON file"
        )
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise LayoutError(f"layout {path}: not UTF-8 (byte {exc.start + 1})") from None
    except RecursionError:
        raise LayoutError(f"layout {path}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python converts
        raise LayoutError(f"layout {path}: not valid JSON ({exc})") from None
    try:
        return ReplayLayout.from_dict(data)
    except LayoutError as exc:
        why = str(exc)
        raise LayoutError(f"layout {path}: {why[8:]}" if why.startswith("layout: ") else why) from None
