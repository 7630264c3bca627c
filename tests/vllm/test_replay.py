"""`umbp replay` on small traces with hand-computed answers (vLLM's real Scheduler, simulated workers).

The trace: session A computes a 190-token prompt; session B's 440-token prompt then pushes A out of a
12-block GPU pool; A's second turn extends its first prompt by 70 tokens. B=64, u=16, retention 0.

Hand computation for A's second turn (prompt 260, vLLM looks up at most 259 tokens):
* no EAGLE: A's first turn ends its prefill chunks at the block boundary 128 (CoW path only) and at the
  prompt-tail boundary b = floor(189 / 16) * 16 = 176, where the Mamba state is handed off. An unbounded
  GPU cache holds attention blocks 64, 128, the partial page [128, 176) and the states: oracle = 176.
  - page on: umbp holds the same, restores 176 (all of it, nothing local survived).
  - page off: attention reaches only 128; with the CoW path the state at 128 exists: restore 128.
    With an internal prefill checkpoint (Mamba2 / fused KDA) the chunk is not split, no state at 128
    exists, and the old behaviour restores 0 (the README demo's case).
* EAGLE-style drop on the attention group: b = floor(190 / 16) * 16 - 16 = 160 and the attention page is
  keyed one unit past it, at 176; the block-aligned stop backs off one block, to 64: oracle = 160,
  page on 160, page off 64 (attention without the page reaches 128, drops to 112; the newest state at or
  below is 64). With lookahead block hashes (vLLM 0.34 under umbp) nothing is dropped: as without EAGLE.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from umbp.replay.deployments import GroupConfig, LayoutError, ReplayLayout, load_layout
from umbp.replay.generate import AgenticProfile, generate
from umbp.replay.trace import Segment, TokenCache, Turn, parse_line, read_trace, write_trace

pytestmark = pytest.mark.vllm


def tiny_layout(
    *,
    kind="attention",
    checkpoint=None,
    eagle=False,
    blocks=12,
    state_page=256,
    max_model_len=2048,
    dram_gb=0.01,
) -> ReplayLayout:
    """B=64, u=16 attention (or MLA) + Mamba-style state, a GPU pool of ``blocks`` blocks."""
    page = 64 * 2 * 8 if kind == "mla" else 64 * 4 * 4
    return ReplayLayout(
        name="tiny",
        description="test",
        unit=16,
        eagle_drop=eagle,
        num_gpu_blocks=blocks,
        groups=(
            GroupConfig(kind, 64, 1, page, eagle=eagle),
            GroupConfig("state", 64, 1, state_page, checkpoint_alignment=checkpoint),
        ),
        max_num_batched_tokens=1024,
        max_num_seqs=8,
        max_model_len=max_model_len,
        ranks=1,
        dram_gb_per_rank=dram_gb,
        retention=0,
    ).validate()


def two_sessions() -> list[Turn]:
    a0 = Segment("A0", 190)
    return [
        Turn("A", 0, (a0,), arrival_s=0.0),
        Turn("A", 1, (a0, Segment("A-reply", 30), Segment("A-tool", 40)), think_s=100.0),
        Turn("B", 0, (Segment("B0", 440),), arrival_s=1.0),
    ]


def run(tmp_path: Path, layout: ReplayLayout, page: bool):
    from umbp.replay.driver import Setting, replay

    return replay(layout, Setting(page, 0), two_sessions(), concurrency=2, workdir=tmp_path)


@pytest.mark.parametrize(
    "variant,kw,page,oracle,restored",
    [
        ("cow", {}, True, 176, 176),
        ("cow", {}, False, 176, 128),
        ("checkpoint", {"checkpoint": 1}, True, 176, 176),
        ("checkpoint", {"checkpoint": 1}, False, 176, 0),
        ("eagle", {"kind": "mla", "eagle": True}, True, 160, 160),
        ("eagle", {"kind": "mla", "eagle": True}, False, 160, 64),
    ],
)
def test_known_answers(tmp_path, variant, kw, page, oracle, restored):
    from umbp.vllm.compat import connector_lookahead_opt_in

    if variant == "eagle" and connector_lookahead_opt_in():
        # vLLM 0.34 hashes blocks with EAGLE's lookahead token under umbp and drops nothing: the boundary is
        # the prompt tail's, 176, as without EAGLE (and the old behaviour again stops at the state at 128)
        oracle, restored = 176, (176 if page else 128)
    result = run(tmp_path, tiny_layout(**kw), page)
    recs = {r.req_id: r for r in result.records}
    turn = recs["A#1"]
    assert (turn.local, turn.oracle, turn.restorable, turn.restored) == (0, oracle, oracle, restored)
    assert (turn.reason == "") == (restored == oracle)
    if restored < oracle:
        assert turn.reason == "boundary page missing (never stored)"
        assert turn.explain.startswith(f"stopped at {restored} of max 259")
    assert all(r.restorable == 0 for r in (recs["A#0"], recs["B#0"]))
    assert result.totals.get("restored_tokens", 0) == restored
    assert result.totals.get("load_failures", 0) == 0


def test_no_eviction_means_nothing_to_restore(tmp_path):
    result = run(tmp_path, tiny_layout(blocks=64), page=True)
    turn = {r.req_id: r for r in result.records}["A#1"]
    assert (turn.local, turn.oracle, turn.restorable, turn.restored) == (176, 176, 0, 0)


def test_summary_and_leaks(tmp_path):
    from umbp.replay.driver import Replay, Setting
    from umbp.replay.report import summarize, table

    rp = Replay(tiny_layout(), Setting(True, 0), two_sessions(), 2, tmp_path)
    result = rp.run()
    s = summarize(result)
    assert (s["restorable_tokens"], s["restored_tokens"], s["restored_fraction_of_restorable"]) == (
        176,
        176,
        1.0,
    )
    assert s["stored_bytes_all_ranks"] > 0 and s["bytes_stored_per_restored_token"] > 0
    assert "100.00%" in table([s], "tiny")
    umbp = rp.engine.umbp
    assert (umbp.saves, umbp.loads, umbp.index.stats()["pinned"]) == ({}, {}, 0)


def test_oracle_ignores_keys_replaced_within_one_schedule():
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from umbp.replay.oracle import EverCachedMap

    block = KVCacheBlock(block_id=3)
    m = EverCachedMap.empty({3: block})
    m.insert(b"transient", block)
    m.insert(b"kept", block)
    m.pop(b"transient", 3)
    assert m.seen(b"kept") and not m.seen(b"transient")
    m.end_of_schedule()
    m.pop(b"kept", 3)  # evicted later: an unbounded cache would still have it
    assert m.ever == {b"kept"} and m.seen(b"kept")


@pytest.mark.parametrize("eagle", [False, True])  # EAGLE: lookahead hashes where vLLM has them (0.34)
def test_reused_prefix_hashes_equal_vllms(tmp_path, eagle):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from umbp.replay.driver import PrefixHashes, Replay, Setting
    from umbp.vllm.compat import hash_lookahead_tokens

    turns = generate(
        AgenticProfile(
            sessions=4,
            seed=5,
            turns=(3, 5),
            edit_prob=0.5,
            system_tokens=(300, 900),
            tool_tokens_median=200,
            max_context=1900,
        )
    )
    rp = Replay(tiny_layout(kind="mla", eagle=eagle), Setting(True, 0), turns, 2, tmp_path)
    hashes, cache = PrefixHashes(16, hash_lookahead_tokens(rp.engine.vllm_config)), TokenCache()
    for turn in turns:
        prompt = cache.prompt(turn)
        fresh = Request(
            request_id="f",
            prompt_token_ids=prompt,
            pooling_params=None,
            block_hasher=rp.engine.hasher,
            sampling_params=SamplingParams(max_tokens=1),
        )
        reused = Request(
            request_id="r",
            prompt_token_ids=prompt,
            pooling_params=None,
            block_hasher=None,
            sampling_params=SamplingParams(max_tokens=1),
        )
        hashes.attach(reused, turn, rp.engine.hasher)
        assert reused.block_hashes == fresh.block_hashes


def test_cli_replays_a_jsonl_trace(tmp_path, capsys):
    from umbp.cli import main

    trace = tmp_path / "trace.jsonl"
    write_trace(two_sessions(), trace)
    layout = tmp_path / "tiny.json"
    layout.write_text(json.dumps(tiny_layout(checkpoint=1).to_dict()))
    out = tmp_path / "out"
    rc = main(
        [
            "replay",
            "--layout",
            str(layout),
            "--trace",
            str(trace),
            "--concurrency",
            "2",
            "--retention",
            "0",
            "--out",
            str(out),
            "--no-progress",
            "--require",
            "99",
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert "page on, retention 0" in printed and "page off, retention 0" in printed
    data = json.loads((out / "replay.json").read_text())
    on, off = data["layouts"]["tiny"]["settings"]
    assert (on["restored_tokens"], off["restored_tokens"]) == (176, 0)
    assert off["stopped_early_reasons"] == {"boundary page missing (never stored)": 1}
    if importlib.util.find_spec("matplotlib") is not None:  # plots are optional
        assert (out / "replay-tiny.png").stat().st_size > 0
    lines = (out / "requests-tiny-pageoff-retention0.jsonl").read_text().splitlines()
    assert len(lines) == 3


# ------------------------------------------------------------------------------------------ no vLLM


def test_trace_roundtrip_and_mooncake_lines(tmp_path):
    turns = two_sessions() + [Turn("C", 0, (Segment(tokens=(5, 6, 7)),), output_tokens=9)]
    path = tmp_path / "t.jsonl"
    write_trace(turns, path)
    assert read_trace(path) == turns
    mc = parse_line('{"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [4, 9]}', 1)
    assert [(s.id, s.size) for s in mc.segments] == [("mc4", 512), ("mc9", 88)]
    assert (mc.arrival_s, mc.output_tokens, mc.prompt_tokens) == (1.5, 7, 600)
    cache = TokenCache()
    assert cache.tokens(Segment("x", 10)) == cache.tokens(Segment("x", 20))[:10]  # same id, same text


def test_generator_is_seeded_and_agentic():
    profile = AgenticProfile(sessions=6, seed=3, turns=(3, 6))
    a, b = generate(profile), generate(profile)
    assert a == b and a != generate(profile.scaled(seed=4))
    by_session: dict[str, list[Turn]] = {}
    for t in a:
        by_session.setdefault(t.session, []).append(t)
    systems = {turns[0].segments[0].id for turns in by_session.values()}
    assert len(systems) < len(by_session)  # system prompts are shared across sessions
    for turns in by_session.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        assert all(t.think_s > 0 for t in turns[1:])
        assert len({t.segments[0].id for t in turns}) == 1  # the session keeps its system prompt
        assert turns[-1].prompt_tokens > turns[0].prompt_tokens  # the context grows


def test_layouts_validate():
    assert load_layout("kimi").unit == 128 and load_layout("granite").unit == 16
    with pytest.raises(LayoutError, match="retention"):
        tiny_layout().with_overrides(retention=100)
    with pytest.raises(LayoutError, match="unit"):
        ReplayLayout.from_dict({**tiny_layout().to_dict(), "unit": 48})


def test_kimi_layout_runs_vllm_with_dcp_8(tmp_path):
    """The deployment's row is replayed with DCP 8 configured on vLLM's Scheduler, not only modelled: its
    MLA manager allocates 1024-token blocks from 128-token per-rank specs, KDA keeps 128, and umbp's
    connector looks up with DCP 8 over all eight ranks."""
    from umbp.replay.engine import build_engine

    layout = load_layout("kimi-k3")
    engine = build_engine(layout, boundary_page=True, retention=0, workdir=tmp_path)
    assert engine.vllm_config.parallel_config.decode_context_parallel_size == 8
    managers = engine.sched.kv_cache_manager.coordinator.single_type_managers
    assert [(m.block_size, m.dcp_world_size) for m in managers] == [(1024, 8), (128, 1)]
    assert engine.sched.kv_cache_manager.coordinator.enable_partial_hash_hits  # DCP's >= rule (KDA 128 = u)
    assert engine.umbp.layout.dcp == 8 and len(engine.umbp.rank_tags) == 8


@pytest.mark.parametrize("page", [True, False])
def test_dcp_layout_known_answers(tmp_path, page):
    """The tiny trace at DCP 4: attention blocks of 16 tokens per rank span 64, Mamba blocks are 16 = u.
    A's second turn resumes at b = 176 (inside the third 64-token span) only with the boundary page; without
    it nothing older is restorable either (no state at a 64-token boundary was kept: retention 0)."""
    base = tiny_layout(kind="mla").to_dict()
    base["groups"] = [
        {**base["groups"][0], "block_size": 16, "page_bytes": 16 * 2 * 8},
        {**base["groups"][1], "block_size": 16},
    ]
    layout = ReplayLayout.from_dict({**base, "dcp": 4, "ranks": 4})
    assert layout.scheduler_block_size == 64 and layout.gpu_pool_tokens() == 12 * 64
    turn = {r.req_id: r for r in run(tmp_path, layout, page).records}["A#1"]
    assert (turn.local, turn.oracle) == (0, 176)
    assert turn.restored == (176 if page else 0)


@pytest.mark.parametrize("kw", [{}, {"checkpoint": 1}])
def test_a_restored_turn_is_a_local_hit_for_the_next(tmp_path, kw):
    """After a restore, vLLM caches the loaded blocks and the prompt-tail state like computed ones, so the
    session's next turn hits its predecessor's whole prompt on the GPU (docs/replay.md: fewer GPU-local
    hits when restoring come from pool pressure, not from restored blocks missing from the prefix cache)."""
    from umbp.replay.driver import Setting, replay

    a0 = Segment("A0", 190)
    a1 = (a0, Segment("A-reply", 30), Segment("A-tool", 40))
    turns = two_sessions()[:2] + [
        Turn("A", 2, (*a1, Segment("A-reply2", 20), Segment("A-tool2", 30)), think_s=0.1),
        two_sessions()[2],
    ]
    result = replay(tiny_layout(**kw), Setting(True, 0), turns, concurrency=2, workdir=tmp_path)
    recs = {r.req_id: r for r in result.records}
    restored, after = recs["A#1"], recs["A#2"]
    assert restored.local == 0 and restored.restored == 176  # B's prompt evicted A from the 12-block pool
    assert after.local == after.oracle >= restored.prompt_tokens - 16
    assert after.restorable == 0 and after.external == 0


def test_a_restore_waits_for_its_load_not_for_the_next_arrival(tmp_path):
    """A restored turn alone in the engine: its load is queued in a step with nothing to compute, and the
    clock must stop when that load completes, not jump to the next turn's arrival (it did: restored
    turns then took seconds of modelled time where their load takes microseconds)."""
    from umbp.replay.driver import Setting, replay

    layout = tiny_layout()
    turns = two_sessions() + [Turn("C", 0, (Segment("C0", 100),), arrival_s=500.0)]
    result = replay(layout, Setting(True, 0), turns, concurrency=3, workdir=tmp_path)
    recs = {r.req_id: r for r in result.records}
    restored = recs["A#1"]
    assert restored.restored == 176 and restored.submitted_s < 400.0
    timing = layout.timing
    load_s = 2 * (timing.transfer_latency_s + 1e-3)  # a few KiB over the link: latency-bound
    n = restored.prompt_tokens  # at most every prompt token scheduled, each over a context of n
    compute_s = 2 * timing.step_seconds(n, n * n / 1000)
    assert restored.finished_s - restored.submitted_s < load_s + compute_s
