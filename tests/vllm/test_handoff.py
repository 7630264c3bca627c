"""Store-mediated P/D on vLLM 0.32's real Scheduler (umbp.vllm.handoff), TP 1 and 2, a real Redis tier.

P (kv_producer) reports a hand-off sent only when every rank's objects are visible on the shared tier, and
gives up after its timeout (counted, blocks released); D (kv_consumer) waits for the named boundary, and
past its wait restores what there is and recomputes the rest.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sched_harness import GroupDef, build  # noqa: E402
from test_connector_scheduler import PROMPT  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from redis_servers import require_redis, start_server  # noqa: E402
from umbp.vllm.config import ConfigError, UMBPConfig  # noqa: E402
from umbp.vllm.handoff import Consumer, Producer  # noqa: E402
from umbp.vllm.scheduler import SchedulerSide  # noqa: E402

GROUPS = [GroupDef("fa", 400), GroupDef("mamba", 400)]
TO_DECODE = {"do_remote_decode": True}
LEAK_FREE = {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}


@pytest.fixture
def server(tmp_path):
    require_redis()
    srv = start_server(tmp_path / "redis")
    yield srv
    srv.stop()


def extra(url: str) -> dict:
    return {"dram_bytes": 64 << 20, "remote": {"url": url, "timeout_s": 0.5, "retry_interval_s": 0.2}}


def add(h, req_id: str, params: dict | None, max_tokens: int = 1) -> Request:
    req = Request(
        request_id=req_id,
        prompt_token_ids=list(PROMPT),
        pooling_params=None,
        block_hasher=h.hasher,
        sampling_params=SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params else None,
        ),
    )
    h.sched.add_request(req)
    return req


def finished_params(h, req_id: str, max_steps: int = 500) -> dict:
    """Step until the request finished; its kv_transfer_params as the scheduler returned them."""
    for _ in range(max_steps):
        so = h.sched.schedule()
        for outs in h.sched.update_from_output(so, h.execute(so)).values():
            for out in outs.outputs:
                if out.request_id == req_id and out.finished:
                    return out.kv_transfer_params
        time.sleep(0.001)
    raise AssertionError(f"{req_id} did not finish")


def decode_admits(tmp_path, url: str, req_id: str, tp: int):
    """D (kv_consumer) admitting `req_id`, which P handed off at 832: the harness, once the load ran."""
    d = build(tmp_path, GROUPS, unit=16, tp=tp, extra=extra(url))
    d.umbp.consumer = Consumer(d.umbp, 0.5)
    add(d, req_id, {"do_remote_prefill": True, "umbp_handoff": {"tokens": 832}}, max_tokens=2)
    d.admit(req_id)
    return d


def producer(tmp_path, url: str, tp: int, timeout_s: float = 10.0, stage_layers=None):
    h = build(tmp_path, GROUPS, unit=16, tp=tp, extra=extra(url), stage_layers=stage_layers)
    h.umbp.producer = Producer(h.umbp, timeout_s)  # what kv_role "kv_producer" sets up
    return h


@pytest.mark.parametrize("tp", [1, 2])
def test_producer_reports_sent_once_every_rank_is_visible(tmp_path, server, tp):
    h = producer(tmp_path, server.url, tp)
    add(h, "A", TO_DECODE)
    params = finished_params(h, "A")
    assert params["umbp_handoff"] == {"tokens": 832}
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert "A" in h.sched.requests  # vLLM holds the request's blocks until the hand-off is reported
    h.run()  # has_requests() stays true (pending push work) until the workers report finished_sending
    assert "A" not in h.sched.requests
    assert h.umbp.totals["handoffs_delivered"] == 1 and h.umbp.totals["handoff_timeouts"] == 0
    assert h.leaks() == LEAK_FREE
    # what "visible" meant: every rank's objects of the 832 hit are on the tier
    for w in h.workers:
        w.shutdown()
    d = decode_admits(tmp_path, server.url, "B", tp)
    assert d.umbp.restored["B"] == 832 and d.held_values("B", 832) == []
    assert d.umbp.totals["handoffs_received"] == 1


def test_pipeline_stages_hand_off_once_every_stage_reported(tmp_path, server):
    """Stage 1 holds no state layer, so its keys of that group are not waited for. A request whose saves
    were dropped before the stages reported is not handed off (D computes it), never held until the
    timeout."""
    stages = [[1, 1], [2, 0]]
    h = producer(tmp_path, server.url, 1, stage_layers=stages)
    add(h, "A", TO_DECODE)  # planned in the first step, before any stage reported
    assert finished_params(h, "A")["umbp_handoff"] == {"tokens": 0}
    h.run()
    assert h.sched.reset_prefix_cache()
    add(h, "B", TO_DECODE)
    assert finished_params(h, "B")["umbp_handoff"] == {"tokens": 832}
    h.run()
    assert h.umbp.totals["handoffs_delivered"] == 1 and h.umbp.totals["handoff_timeouts"] == 0
    assert h.leaks() == LEAK_FREE
    for w in h.workers:
        w.shutdown()
    d = build(tmp_path, GROUPS, unit=16, extra=extra(server.url), stage_layers=stages)
    d.umbp.consumer = Consumer(d.umbp, 0.5)
    d.add("warm-up", [1, 2, 3], max_tokens=1)  # D's stages report with its output
    d.run()
    add(d, "C", {"do_remote_prefill": True, "umbp_handoff": {"tokens": 832}}, max_tokens=2)
    d.admit("C")
    assert d.umbp.restored["C"] == 832
    assert [d.held_values("C", 832, rank=r) for r in range(len(d.workers))] == [[], []]
    assert d.umbp.totals["handoffs_received"] == 1


def test_producer_gives_up_after_its_timeout(tmp_path, server):
    """Writes that never reach the tier: the hand-off is released after handoff_timeout_s, counted."""
    h = producer(tmp_path, server.url, 1, timeout_s=0.3)
    h.workers[0]._worker.remote.put_async = lambda keys, views, checksums=None: [False] * len(keys)
    add(h, "A", TO_DECODE)
    assert finished_params(h, "A")["umbp_handoff"] == {"tokens": 832}
    t0 = time.monotonic()
    h.run()
    assert 0.3 <= time.monotonic() - t0 < 5.0
    assert h.umbp.totals["handoff_timeouts"] == 1 and h.umbp.totals["handoffs_delivered"] == 0
    assert h.leaks() == LEAK_FREE


def _lost_on_the_tier(tmp_path, url, tp=1):
    """P hands A off, then the shared tier loses A's objects (expired, evicted or flushed there) while P's
    DRAM keeps them, and B with the same prompt finishes on P: P never saves those objects again."""
    h = producer(tmp_path, url, tp, timeout_s=0.5)
    add(h, "A", TO_DECODE)
    assert finished_params(h, "A")["umbp_handoff"] == {"tokens": 832}
    h.run()
    assert h.umbp.totals["handoffs_delivered"] == 1
    h.workers[0]._worker.remote.clear()  # one shared tier: every rank's objects are gone
    time.sleep(0.6)  # older than the timeout: no write of them can still be queued
    assert h.sched.reset_prefix_cache()
    add(h, "B", TO_DECODE)
    return h


@pytest.mark.parametrize("tp", [1, 2])
def test_producer_writes_objects_the_tier_lost_again_from_dram(tmp_path, server, tp):
    h = _lost_on_the_tier(tmp_path, server.url, tp)
    assert finished_params(h, "B")["umbp_handoff"] == {"tokens": 832}
    h.run()
    totals = h.umbp.totals
    assert totals["republished_objects"] == 4 and totals["handoffs_delivered"] == 2
    assert totals["handoff_timeouts"] == 0 and h.leaks() == LEAK_FREE
    for w in h.workers:
        w.shutdown()
    d = decode_admits(tmp_path, server.url, "C", tp)
    assert d.umbp.restored["C"] == 832  # every rank's shard, each the bytes P's prefill wrote
    assert [d.held_values("C", 832, rank=r) for r in range(tp)] == [[]] * tp


def test_producer_does_not_start_a_hand_off_it_cannot_complete(tmp_path, server):
    """Lost on the tier and not in P's DRAM either (on its SSD only, say): not started (tokens 0, D
    computes the prompt) instead of holding P's blocks and D for the whole timeouts."""
    h = _lost_on_the_tier(tmp_path, server.url)
    h.umbp.publish = lambda keys, group, hashes: False
    t0 = time.monotonic()
    assert finished_params(h, "B")["umbp_handoff"] == {"tokens": 0}
    h.run()
    assert time.monotonic() - t0 < 0.5
    assert h.umbp.totals["handoffs_unavailable"] == 1 and h.umbp.totals["handoff_timeouts"] == 0
    assert h.leaks() == LEAK_FREE


def test_producer_does_not_hand_off_what_it_could_not_save(tmp_path, server):
    """A save dropped for want of a DRAM slot never reaches the shared tier: no hand-off is announced."""
    h = build(tmp_path, GROUPS, unit=16, extra=extra(server.url) | {"dram_bytes": 64 << 10})
    h.umbp.producer = Producer(h.umbp, 5.0)
    add(h, "A", TO_DECODE)
    t0 = time.monotonic()
    assert finished_params(h, "A")["umbp_handoff"] == {"tokens": 0}
    h.run()
    assert time.monotonic() - t0 < 4.0
    assert h.umbp.totals["saves_dropped_no_space"] >= 1 and h.umbp.totals["handoff_timeouts"] == 0
    assert h.leaks() == LEAK_FREE


def test_aborted_request_is_not_handed_off(tmp_path, server):
    from vllm.v1.request import RequestStatus

    h = producer(tmp_path, server.url, 1)
    add(h, "A", TO_DECODE, max_tokens=4)
    h.step()
    h.sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    h.run()
    assert h.umbp.totals["handoffs_started"] == 0 and not h.umbp.producer.busy()
    assert h.leaks() == LEAK_FREE


def test_request_without_do_remote_decode_is_not_a_handoff(tmp_path, server):
    h = producer(tmp_path, server.url, 1)
    add(h, "A", None)
    assert "umbp_handoff" not in (finished_params(h, "A") or {})
    assert h.umbp.totals["handoffs_started"] == 0


def test_lost_state_object_is_a_shorter_restore_never_a_wrong_value(tmp_path, server):
    """P's hand-off was complete, then the tier lost one rank's recurrent state at 832: D waits, counts the
    miss and restores only a boundary it fully holds, every value equal to a recompute."""
    from umbp.identity import RankCoord, object_key

    h = producer(tmp_path, server.url, 2)
    add(h, "A", TO_DECODE)
    finished_params(h, "A")
    h.run()
    assert h.umbp.totals["handoffs_delivered"] == 1
    probe = Request(
        request_id="probe",
        prompt_token_ids=list(PROMPT),
        pooling_params=None,
        block_hasher=h.hasher,
        sampling_params=SamplingParams(max_tokens=1),
    )
    lost = object_key(h.umbp.layout.namespace, RankCoord(tp=1), 1, probe.block_hashes[832 // 16 - 1])
    assert h.umbp.remote.remove([lost]) == 1
    for w in h.workers:
        w.shutdown()
    d = build(tmp_path, GROUPS, unit=16, tp=2, extra=extra(server.url))
    d.umbp.consumer = Consumer(d.umbp, 0.3)
    add(d, "B", {"do_remote_prefill": True, "umbp_handoff": {"tokens": 832}}, max_tokens=2)
    d.admit("B")
    hit = d.umbp.restored.get("B", 0)
    assert hit < 832
    for rank in range(2) if hit else ():
        assert d.held_values("B", hit, rank=rank) == []
    d.run()
    assert d.umbp.totals["handoff_misses"] == 1


def test_consumer_waits_then_recomputes_what_is_missing(tmp_path, server):
    """Nothing on the tier: D holds the request for handoff_wait_s, then recomputes it all (counted)."""
    d = build(tmp_path, GROUPS, unit=16, extra=extra(server.url))
    d.umbp.consumer = Consumer(d.umbp, 0.3)
    req = add(d, "B", {"do_remote_prefill": True, "umbp_handoff": {"tokens": 832}}, max_tokens=2)
    t0 = time.monotonic()
    so = d.step()
    assert so.total_num_scheduled_tokens == 0 and req.num_computed_tokens == 0  # held: asked again later
    d.run()
    assert time.monotonic() - t0 >= 0.3
    assert d.umbp.totals["handoff_misses"] == 1 and d.umbp.totals["restored_tokens"] == 0


def test_store_mediated_roles_need_the_shared_tier(tmp_path):
    h = build(tmp_path, GROUPS, unit=16)
    for role in ("kv_producer", "kv_consumer"):
        with pytest.raises(ConfigError, match="needs the shared tier"):
            SchedulerSide(UMBPConfig(), h.umbp.layout, role=role)


def test_handoff_options_are_validated():
    assert UMBPConfig.from_extra_config({"handoff_timeout_s": 2, "handoff_wait_s": 0.5}).handoff_wait_s == 0.5
    with pytest.raises(ConfigError, match="handoff_wait_s"):
        UMBPConfig.from_extra_config({"handoff_wait_s": 0})
