"""Object identity: namespaces and rank-local object keys.

An *object* is one cache group's page (an attention page or a recurrent-state page) for one prefix
boundary on one parallel rank. Its key must change whenever the bytes it names would change, so two
deployments that could produce different bytes for the same tokens never read each other's objects.

Key string format (documented in docs/keys.md)::

    umbp:v<FORMAT>:<namespace>:tp<r>:pcp<r>:dcp<r>:pp<r>:g<group>:<prefix-hash hex>

* ``namespace`` -- 32 hex chars, SHA-256 over the canonical JSON of a :class:`ModelIdentity`
  (model, revision, dtypes, per-group layout, parallel sizes, speculative config, the engine options
  that change what the model computes, format version).
* ``tp/pcp/dcp/pp`` -- the rank that wrote the object (each rank stores its own shard).
* ``g<group>`` -- the KV-cache group index.
* ``prefix-hash`` -- the engine's chained hash of the tokens ``[0, t)`` where ``t`` is the object's
  token end (for vLLM: ``request.block_hashes[t // unit - 1]``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

FORMAT_VERSION = 1
_PREFIX = f"umbp:v{FORMAT_VERSION}"
_KEY_RE = re.compile(
    r"^umbp:v(?P<fmt>\d+):(?P<ns>[0-9a-f]{32}):tp(?P<tp>\d+):pcp(?P<pcp>\d+):dcp(?P<dcp>\d+)"
    r":pp(?P<pp>\d+):g(?P<group>\d+):(?P<hash>[0-9a-f]+)$"
)


@dataclass(frozen=True)
class GroupLayout:
    """What one cache group's page looks like on one rank; any change means different bytes."""

    kind: str  # "full_attention", "sliding_window", "recurrent_state", ...
    block_size: int
    layer_names: tuple[str, ...]
    page_shapes: tuple[tuple[int, ...], ...] = ()  # one per layer, this rank's shard
    dtypes: tuple[str, ...] = ()
    extra: tuple[tuple[str, str], ...] = ()  # e.g. (("sliding_window", "128"),)


@dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    pp: int = 1


@dataclass(frozen=True)
class ModelIdentity:
    """Everything that changes the bytes of a stored page, digested into the key namespace."""

    model: str
    revision: str | None = None
    dtype: str = ""
    groups: tuple[GroupLayout, ...] = ()
    parallel: ParallelSizes = field(default_factory=ParallelSizes)
    speculative_method: str | None = None
    draft_model: str | None = None
    draft_revision: str | None = None
    prefix_hash_algo: str = ""
    tenant: str = ""  # optional user-chosen isolation label (e.g. per deployment)
    # engine options beyond the above that change what the model computes, as sorted (name, canonical
    # text) pairs, only those set away from their defaults: quantization, config overrides, other weights
    model_options: tuple[tuple[str, str], ...] = ()

    def canonical_json(self) -> str:
        doc = asdict(self)
        if not self.model_options:  # absent when none is set: such deployments keep their namespace
            del doc["model_options"]
        doc["umbp_format_version"] = FORMAT_VERSION
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    def namespace(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:32]


@dataclass(frozen=True, order=True)
class RankCoord:
    """A worker's position; DP ranks are deliberately absent so DP replicas share objects."""

    tp: int = 0
    pcp: int = 0
    dcp: int = 0
    pp: int = 0

    def tag(self) -> str:
        return f"tp{self.tp}:pcp{self.pcp}:dcp{self.dcp}:pp{self.pp}"


def dcp_rank(tp: int, pcp: int, sizes: ParallelSizes) -> int:
    """The DCP rank of the worker at (tp, pcp), as vLLM 0.32 forms its DCP groups (parallel_state): the
    (PCP, TP) grid is walked TP-major, PCP-minor and cut into groups of ``dcp`` ranks. With PCP 1 that is
    ``tp % dcp``; with DCP == PCP it is the PCP rank; with DCP == TP x PCP, ``tp * pcp_size + pcp``."""
    return (tp * sizes.pcp + pcp) % sizes.dcp


def all_ranks(sizes: ParallelSizes) -> list[RankCoord]:
    """Every rank whose shard a logical hit needs."""
    ranks = []
    for pp in range(sizes.pp):
        for pcp in range(sizes.pcp):
            for tp in range(sizes.tp):
                ranks.append(RankCoord(tp=tp, pcp=pcp, dcp=dcp_rank(tp, pcp, sizes), pp=pp))
    return ranks


@dataclass(frozen=True)
class ObjectKey:
    namespace: str
    rank: RankCoord
    group: int
    prefix_hash: bytes

    def __str__(self) -> str:
        return object_key(self.namespace, self.rank, self.group, self.prefix_hash)


def object_key(namespace: str, rank: RankCoord, group: int, prefix_hash: bytes) -> str:
    if len(namespace) != 32:
        raise ValueError(
            f"namespace {namespace!r} must be 32 hex chars; build it with ModelIdentity.namespace()"
        )
    if not prefix_hash:
        raise ValueError("prefix_hash is empty; pass the engine's hash of the prefix [0, token_end)")
    return f"{_PREFIX}:{namespace}:{rank.tag()}:g{group}:{bytes(prefix_hash).hex()}"


def parse_key(key: str) -> ObjectKey:
    m = _KEY_RE.match(key)
    if m is None:
        raise ValueError(
            f"{key!r} is not a umbp object key; expected "
            "umbp:v<N>:<32 hex>:tp<r>:pcp<r>:dcp<r>:pp<r>:g<group>:<hash hex>"
        )
    if int(m["fmt"]) != FORMAT_VERSION:
        raise ValueError(f"key {key!r} has format v{m['fmt']}; this umbp reads v{FORMAT_VERSION}")
    rank = RankCoord(tp=int(m["tp"]), pcp=int(m["pcp"]), dcp=int(m["dcp"]), pp=int(m["pp"]))
    return ObjectKey(m["ns"], rank, int(m["group"]), bytes.fromhex(m["hash"]))
