"""The UMBPConnector under decode context parallelism, on vLLM 0.32's real Scheduler (CPU, no model).

vLLM is configured with DCP 2, 4 and 8 (``ParallelConfig.decode_context_parallel_size``): its scheduler
allocates attention blocks that span ``block_size * dcp`` tokens, and the simulated workers hold only their
DCP shard of each block, token-interleaved the way vLLM's slot mapping shards it (``sched_harness.
shard_slot``); recurrent state is per rank (each rank's copy distinct). Every restore is byte-checked on
every rank and must land exactly on the local prefix hit vLLM itself reaches for the same prompt.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # redis_servers
from sched_harness import GroupDef, build, shard_slot  # noqa: E402
from test_connector_scheduler import PROMPT, compute_then_drop, restore  # noqa: E402

from umbp.identity import ParallelSizes, RankCoord, all_ranks  # noqa: E402
from umbp.vllm.kv_layout import UnsupportedLayout, check_parallel  # noqa: E402
from umbp.vllm.scheduler import logical_key  # noqa: E402

NO_LEAKS = {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}

# (dcp, per-rank groups, unit, interleave): spans 64 / 64 / 128; DCP 8 has Mamba's block equal to the unit,
# so a hit inside a block needs vLLM's DCP-only ">=" rule
CASES = {
    "dcp2": (2, [GroupDef("fa", 32), GroupDef("mamba", 64)], 16, 1),
    "dcp4-interleave4": (4, [GroupDef("fa", 16), GroupDef("mamba", 32)], 16, 4),
    "dcp8": (8, [GroupDef("fa", 16), GroupDef("mamba", 16)], 16, 1),
}


def make(tmp_path, name, **kw):
    dcp, groups, unit, interleave = CASES[name]
    return build(tmp_path, groups, unit=unit, tp=dcp, dcp=dcp, interleave=interleave, **kw)


def test_shard_slot_is_vllms_interleaving():
    """Token p of a 4-rank, 8-token-per-rank block with interleave 2: runs of 2 tokens round-robin."""
    owners = [next(r for r in range(4) if shard_slot(p, 8, 4, r, 2)) for p in range(16)]
    assert owners == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2, 2, 3, 3]
    assert shard_slot(9, 8, 4, 0, 2) == (0, 3) and shard_slot(32 + 9, 8, 4, 0, 2) == (1, 3)


@pytest.mark.parametrize("name", sorted(CASES))
def test_restore_at_the_boundary_on_every_dcp_rank(tmp_path, name):
    """The prompt tail b lies inside a DCP-scaled block: the page at b (every rank's shard of block
    b // span) and the state at b are restored, byte for byte, on all ranks."""
    h = make(tmp_path, name)
    dcp = h.dcp
    span = h.groups[0].block_size * dcp
    prompt = PROMPT[:300]
    b = 299 // 16 * 16
    assert b % span, "the tail must lie inside a block"
    assert compute_then_drop(h, "A", prompt) == b  # vLLM's own local hit under DCP
    assert {w._worker.rank.dcp for w in h.workers} == set(range(dcp))
    assert restore(h, "B", prompt) == (b, [])
    assert h.leaks() == NO_LEAKS


@pytest.mark.parametrize(
    "name,flagged",
    [("dcp2", frozenset()), ("dcp8", frozenset()), ("dcp8", frozenset({0}))],
    ids=["dcp2-eagle", "dcp8-eagle", "dcp8-dspark"],
)
def test_eagle_dspark_keying_under_dcp(tmp_path, name, flagged):
    """EAGLE/DSpark's drop: the state is keyed at b, the attention page one unit past it (b + u), which is
    where vLLM's DCP-aware lookup probes; the restore reaches vLLM's local hit. DSpark: only the attention
    group is annotated ``is_eagle_group`` (vLLM 0.32 does so for Kimi-K3's MLA spec)."""
    h = make(tmp_path, name, eagle=True, eagle_groups=flagged, lookahead=False)  # the drop: plain hashes
    assert h.umbp.layout.eagle_groups == (flagged or frozenset({0, 1}))
    prompt = PROMPT[:300]
    b = 300 // 16 * 16 - 16
    assert compute_then_drop(h, "A", prompt) == b
    umbp, hashes = h.umbp, h.add("probe", prompt, max_tokens=1).block_hashes

    def held(group, end):
        return umbp.index.lookup([logical_key(umbp.layout.namespace, group, hashes[end // 16 - 1])])[0]

    assert held(0, b + 16) and not held(0, b) and held(1, b)
    h.run()
    assert h.sched.reset_prefix_cache()
    assert restore(h, "B", prompt) == (b, [])
    assert h.leaks() == NO_LEAKS


@pytest.mark.parametrize("name", ["dcp4-interleave4", "dcp8"])
def test_multi_turn_under_dcp(tmp_path, name):
    """Agentic turn 2 = turn 1 + its reply + a tool output; every turn falls out of the GPU cache first."""
    h = make(tmp_path, name, retention=None)
    turn1 = PROMPT[:300]
    req = h.add("A", turn1, max_tokens=40)
    h.run()
    turn2 = turn1 + list(req.output_token_ids) + PROMPT[300:460]
    local2 = h.local_hit(turn2)
    assert h.sched.reset_prefix_cache()
    hit, mism = restore(h, "B", turn2)
    assert mism == [] and 0 < hit <= local2
    assert h.sched.reset_prefix_cache()
    turn3 = turn2 + PROMPT[460:600]
    local3 = h.local_hit(turn3)
    assert local3 == 0  # nothing local: turn 3 resumes from umbp alone
    hit3, mism3 = restore(h, "C", turn3)
    assert mism3 == [] and hit3 >= hit
    assert h.leaks() == NO_LEAKS


@pytest.mark.parametrize("name", ["dcp2", "dcp8"])
def test_missing_shard_on_one_dcp_rank_is_no_hit(tmp_path, name):
    """One DCP rank's saves fail: its shards never exist, so no object becomes visible and nothing is
    restored, although every other rank holds its shard."""
    h = make(tmp_path, name)
    h.failing_save_ranks = {len(h.workers) - 1}
    compute_then_drop(h, "A", PROMPT[:300])
    assert h.umbp.index.stats()["objects"] == 0
    assert sum(len(w._worker.slots) for w in h.workers[:-1]) > 0  # the other ranks did write theirs
    assert restore(h, "B", PROMPT[:300]) == (0, [])
    assert h.leaks() == NO_LEAKS


def test_corrupt_shard_on_one_dcp_rank_is_a_recompute(tmp_path):
    h = make(tmp_path, "dcp8")
    compute_then_drop(h, "A", PROMPT[:300])
    h.fail_next_load = True  # flips bytes of one shard on the last DCP rank right before its load
    h.add("B", PROMPT[:300], max_tokens=4)
    h.admit("B")
    assert h.umbp.restored.get("B", 0) == 0
    h.run()
    assert h.umbp.totals["load_failures"] == 1
    assert h.sched.reset_prefix_cache()
    assert restore(h, "C", PROMPT[:300]) == (288, [])


def test_keys_carry_each_workers_dcp_rank(tmp_path):
    h = make(tmp_path, "dcp4-interleave4")
    for rank, w in enumerate(h.workers):
        assert f":tp{rank}:pcp0:dcp{rank}:pp0:g0:01" in w._worker.rank_key(0, b"\x01")
    assert {r.tag() for r in h.umbp.layout.ranks} == {w._worker.rank.tag() for w in h.workers}
    # the interleave changes which token a shard holds: it is part of the namespace
    again = make(tmp_path, "dcp4-interleave4")
    other = build(tmp_path, CASES["dcp4-interleave4"][1], unit=16, tp=4, dcp=4, interleave=1)
    assert again.umbp.layout.namespace == h.umbp.layout.namespace != other.umbp.layout.namespace


def test_dcp_ranks_follow_vllms_group_layout():
    """vLLM 0.32 (parallel_state): DCP groups cut the TP-major (TP, PCP) grid into runs of dcp ranks."""
    assert [r.dcp for r in all_ranks(ParallelSizes(tp=8, dcp=8))] == list(range(8))
    assert [r.dcp for r in all_ranks(ParallelSizes(tp=8, dcp=2))] == [0, 1] * 4
    assert [(r.tp, r.pcp, r.dcp) for r in all_ranks(ParallelSizes(tp=2, pcp=2, dcp=2))] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 1, 1),
        (1, 1, 1),
    ]
    assert [r.dcp for r in all_ranks(ParallelSizes(tp=2, pcp=2, dcp=4))] == [0, 2, 1, 3]


def test_worker_with_an_unexpected_rank_fails_at_start_up(tmp_path):
    h = make(tmp_path, "dcp2")
    w = h.workers[0]._worker
    w.rank = RankCoord(tp=0, dcp=1)  # tp0 is dcp0 in vLLM's layout
    with pytest.raises(RuntimeError, match="not one the scheduler expects"):
        w.register({})


def test_what_umbp_cannot_serve_fails_at_start_up_with_one_line():
    from umbp.hybrid import FullAttention, SlidingWindow

    with pytest.raises(UnsupportedLayout, match="prefill_context_parallel_size=2") as exc:
        check_parallel(ParallelSizes(tp=2, pcp=2), (FullAttention(16),))
    assert "\n" not in str(exc.value)
    with pytest.raises(UnsupportedLayout, match="decode_context_parallel_size=2.*sliding window"):
        check_parallel(ParallelSizes(tp=2, dcp=2), (FullAttention(16), SlidingWindow(16, 32)))
    check_parallel(ParallelSizes(tp=8, dcp=8), (FullAttention(16), SlidingWindow(16, 32, dcp_sharded=False)))


def test_shared_tier_needs_every_dcp_ranks_shard(tmp_path):
    """Instance 1 (DCP 4) writes through to Redis; a fresh instance restores byte-exact from it. With one
    DCP rank's shards deleted from the server, a third instance finds no hit at all."""
    import redis

    from redis_servers import require_redis, start_server

    require_redis()
    server = start_server(tmp_path / "redis")
    try:
        extra = {
            "dram_bytes": 64 << 20,
            "remote": {"url": server.url, "timeout_s": 0.5, "retry_interval_s": 0.2},
        }
        prompt = PROMPT[:300]
        instances = []
        h1 = make(tmp_path, "dcp4-interleave4", extra=extra)
        instances.append(h1)
        assert compute_then_drop(h1, "A", prompt) == 288
        for w in h1.workers:
            w.shutdown()  # flushes the asynchronous writes
        h2 = make(tmp_path, "dcp4-interleave4", extra=extra)
        instances.append(h2)
        assert restore(h2, "B", prompt) == (288, [])
        client = redis.Redis.from_url(server.url)
        gone = [k for k in client.scan_iter(count=1000) if b":dcp2:" in k]
        assert gone and client.delete(*gone) == len(gone)
        h3 = make(tmp_path, "dcp4-interleave4", extra=extra)
        instances.append(h3)
        assert restore(h3, "C", prompt) == (0, [])
    finally:
        for h in instances[1:]:
            for w in h.workers:
                w.shutdown()
        server.stop()


def test_worker_reads_its_dcp_rank_from_vllms_parallel_state(monkeypatch):
    """The worker's key coordinates come from vLLM's own groups (here stand-ins for a TP8/DCP8 rank 5):
    never derived from the TP rank, so a layout vLLM forms differently cannot mislabel a shard."""
    from types import SimpleNamespace

    from vllm.distributed import parallel_state as ps

    from umbp.vllm.worker import current_rank

    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 5)
    monkeypatch.setattr(ps, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    monkeypatch.setattr(ps, "get_dcp_group", lambda: SimpleNamespace(rank_in_group=5))
    monkeypatch.setattr(ps, "get_pcp_group", lambda: SimpleNamespace(rank_in_group=0))
    assert current_rank() == RankCoord(tp=5, pcp=0, dcp=5, pp=0)

    def not_initialised():
        raise AssertionError("decode context model parallel group is not initialized")

    monkeypatch.setattr(ps, "get_dcp_group", not_initialised)
    assert current_rank() == RankCoord(tp=5)


def test_interleave_in_the_namespace_is_what_the_workers_use(tmp_path):
    """vLLM adjusts the interleave only in its worker processes; the scheduler side applies the same rules
    (a deprecated dcp_kv_cache_interleave_size wins; beside NIXL, the smallest per-rank block size)."""
    from types import SimpleNamespace

    from umbp.vllm.kv_layout import dcp_interleave

    h = make(tmp_path, "dcp4-interleave4")
    cfg, kv = h.vllm_config, h.kv_cache_config
    assert dcp_interleave(cfg, kv) == 4
    legacy = SimpleNamespace(
        parallel_config=SimpleNamespace(cp_kv_cache_interleave_size=4, dcp_kv_cache_interleave_size=2),
        kv_transfer_config=cfg.kv_transfer_config,
    )
    assert dcp_interleave(legacy, kv) == 2
    nixl = SimpleNamespace(
        parallel_config=cfg.parallel_config,
        kv_transfer_config=SimpleNamespace(has_connector=lambda name: name == "NixlConnector"),
    )
    assert dcp_interleave(nixl, kv) == 16  # min per-rank block size: FA 16, Mamba 32


@pytest.mark.parametrize("name", sorted(CASES))
def test_restore_beyond_a_local_hit_under_dcp(tmp_path, name):
    """Turn 1 is held locally (restored from umbp, then cached by vLLM), turn 2 only in umbp: the restore
    starts from vLLM's local hit (rounded down to the scheduler block) and loads the DCP-scaled blocks past
    it, byte-exact on every rank."""
    h = make(tmp_path, name)
    turn1, turn2 = PROMPT[:300], PROMPT[:600]
    for req_id, prompt in (("A", turn1), ("A2", turn2)):
        h.add(req_id, prompt, max_tokens=2)
        h.run()
    assert h.sched.reset_prefix_cache()
    assert restore(h, "A-again", turn1) == (288, [])
    assert h.local_hit(turn2) == 288
    before = h.umbp.totals["restored_tokens"]
    assert restore(h, "C", turn2) == (592, [])
    block = h.sched.block_size  # the scheduler block: lcm of the DCP spans (here 64 or 128)
    assert block in (64, 128) and h.umbp.totals["restored_tokens"] - before == 592 - 288 // block * block
    assert h.leaks() == NO_LEAKS
