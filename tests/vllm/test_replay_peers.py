"""`umbp replay --peers`: vLLM 0.32's own OffloadingConnector (real scheduler side, simulated copy step) in
umbp's place, on the same trace and DRAM budget, against the same oracle.

Invariants, not figures: no connector restores more than the oracle allows (non-EAGLE layouts, where umbp
cannot legitimately reach beyond it either), umbp with the boundary page restores at least as much as
without it on hybrids, every load either connector started is acknowledged and nothing is left in flight,
and both connectors get the same DRAM budget in bytes. One hand-computed case proves the peer harness
really restores (vLLM's partial-tail path): the two-session trace of test_replay.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_replay import tiny_layout, two_sessions  # the same tiny layouts and two-session trace

from umbp.replay.deployments import ReplayLayout
from umbp.replay.generate import AgenticProfile, generate
from umbp.replay.trace import Turn, write_trace

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def hybrid(
    checkpoint: int | None, *, eagle: bool = False, dram_gb: float = 0.05, blocks: int = 40
) -> ReplayLayout:
    """B=64, u=16 attention (or MLA with EAGLE) + Mamba-style state pages as large as the attention ones, a
    GPU pool of ``blocks`` blocks."""
    kind = "mla" if eagle else "attention"
    page = 64 * 2 * 8 if eagle else 64 * 4 * 4
    return tiny_layout(
        kind=kind,
        checkpoint=checkpoint,
        eagle=eagle,
        blocks=blocks,
        state_page=page,
        max_model_len=4096,
        dram_gb=dram_gb,
    )


def agentic_turns() -> list[Turn]:
    return generate(
        AgenticProfile(
            sessions=8,
            seed=11,
            turns=(3, 6),
            edit_prob=0.3,
            system_tokens=(200, 600),
            user_tokens=(20, 200),
            reply_tokens=(20, 120),
            tool_tokens_median=150,
            tool_tokens_max=600,
            max_context=1500,
            think_s_mean=2.0,
        )
    )


def run(tmp_path: Path, layout: ReplayLayout, setting, turns=None):
    from umbp.replay.driver import replay

    return replay(layout, setting, turns or agentic_turns(), concurrency=4, workdir=tmp_path)


def restored(result) -> int:
    return sum(r.restored_of_oracle for r in result.records)


@pytest.mark.parametrize("checkpoint", [None, 1], ids=["cow", "checkpoint"])
def test_peer_invariants_on_hybrids(tmp_path, checkpoint):
    from umbp.replay.driver import Setting

    layout = hybrid(checkpoint)
    on = run(tmp_path, layout, Setting(True, 0))
    off = run(tmp_path, layout, Setting(False, 0))
    peer = run(tmp_path, layout, Setting(False, 0, "offloading"))
    for result in (on, off, peer):
        assert sum(r.restorable for r in result.records) > 0  # the trace leaves something to restore
        for r in result.records:
            assert r.restored <= r.restorable, (result.setting.label, r.to_json())
            assert r.load_ok in (None, True), (result.setting.label, r.to_json())  # every load acknowledged
    assert restored(on) >= restored(off)
    # the same trace, request for request (their order follows each run's own timing)
    assert sorted(r.req_id for r in on.records) == sorted(r.req_id for r in peer.records)
    assert restored(peer) > 0 or checkpoint == 1  # the peer harness restores where vLLM's rules allow


def test_peer_same_budget_and_nothing_left_in_flight(tmp_path):
    from umbp.replay.driver import Setting
    from umbp.replay.offloading import cpu_bytes
    from umbp.replay.peer import OffloadingReplay

    layout = hybrid(None, dram_gb=0.0003)  # 73 CPU chunks of 4 KiB: the CPU tier must evict
    rp = OffloadingReplay(layout, Setting(False, 0, "offloading"), agentic_turns(), 4, tmp_path)
    result = rp.run()
    sched_side = rp.engine.connector.connector_scheduler
    assert rp.engine.vllm_config.kv_transfer_config.kv_connector_extra_config["cpu_bytes_to_use"] == int(
        layout.dram_gb_per_rank * 1e9
    )
    assert cpu_bytes(layout) == int(layout.dram_gb_per_rank * 1e9) * layout.dcp
    assert sched_side.manager._num_chunks * rp._chunk_bytes() <= cpu_bytes(layout)
    assert result.totals["evicted_objects"] > 0  # eviction pressure really applied
    assert not sched_side._jobs and rp.workers.next_event() is None  # every job acknowledged
    assert all(r.restored <= r.restorable for r in result.records)


def test_peer_eagle_never_beyond_oracle(tmp_path):
    from umbp.replay.driver import Setting

    result = run(tmp_path, hybrid(None, eagle=True), Setting(False, 0, "offloading"))
    assert all(r.restored <= r.restorable for r in result.records)


def test_peer_partial_tail_known_answer(tmp_path):
    """A's second turn (see test_replay.py): the CoW path keeps the state at 128 and hands off the tail at
    176, which vLLM's OffloadingConnector stores with the attention page [128, 176) and restores (its
    partial-tail rule); with the internal checkpoint no block-aligned state exists, the complete-chunk hit
    is 0 and vLLM looks for a partial tail only in the block after it: nothing restored."""
    from umbp.replay.driver import Setting

    for checkpoint, want in ((None, 176), (1, 0)):
        layout = hybrid(checkpoint, blocks=12)
        result = run(tmp_path, layout, Setting(False, 0, "offloading"), two_sessions())
        turn = {r.req_id: r for r in result.records}["A#1"]
        assert (turn.oracle, turn.restored) == (176, want)


def test_cli_peer_table_and_refusal(tmp_path, capsys, monkeypatch):
    """`--peers` adds the peer row to the same run; a peer that refuses a layout is a row with its error."""
    from umbp.cli import main

    trace, layout_file, out = tmp_path / "t.jsonl", tmp_path / "tiny.json", tmp_path / "out"
    write_trace(two_sessions(), trace)
    layout_file.write_text(json.dumps(hybrid(None, blocks=12).to_dict()))
    args = ["replay", "--layout", str(layout_file), "--trace", str(trace), "--concurrency", "2"]
    args += ["--retention", "0", "--peers", "--no-progress", "--no-plots", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "peers, tiny" in printed and "vLLM OffloadingConnector, retention 0" in printed
    assert "worker copy step is SIMULATED" in printed  # the harness says what it replaced
    rows = json.loads((out / "replay.json").read_text())["layouts"]["tiny"]["settings"]
    assert [s["connector"] for s in rows] == ["umbp", "umbp", "offloading"]
    assert rows[2]["restored_tokens"] <= rows[2]["restorable_tokens"]
    peers = json.loads((out / "peers.json").read_text())["layouts"]["tiny"]["rows"]
    assert [r["label"] for r in peers] == [s["label"] for s in rows]
    assert peers[2]["offloading_totals"]["stored_objects"] > 0

    import umbp.replay.offloading as offloading

    def refuse(*_a, **_k):
        raise ValueError("offloading refuses this layout")

    monkeypatch.setattr(offloading, "build_offloading_engine", refuse)
    monkeypatch.setattr("umbp.replay.peer.build_offloading_engine", refuse)
    monkeypatch.setattr("umbp.tools.replay._run_all", _in_this_process)  # so the patch above applies
    assert main(args) == 0
    assert "refused: ValueError: offloading refuses this layout" in capsys.readouterr().out
    rows = json.loads((out / "replay.json").read_text())["layouts"]["tiny"]["settings"]
    assert rows[2]["refused"] == "ValueError: offloading refuses this layout"
    peers = json.loads((out / "peers.json").read_text())["layouts"]["tiny"]["rows"]
    assert peers[2] == {k: rows[2][k] for k in ("connector", "label", "retention", "refused")}


def _in_this_process(layouts, settings, turns, args):
    """`umbp replay`'s settings run here rather than in its seeded worker processes."""
    from umbp.tools.replay import _one

    class NoProgress:
        def put(self, n: int) -> None:
            pass

    workdir = str(Path(args.out) / "work")
    return {
        (lay.name, s.label): _one(lay, s, turns, args.concurrency, workdir, args.max_explain, NoProgress())
        for lay in layouts
        for s in settings[lay.name]
    }
