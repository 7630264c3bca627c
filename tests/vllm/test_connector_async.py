"""Asynchronous worker transfers on vLLM's real Scheduler (CPU workers): loads from a slow tier do not
stall the engine's step, saves whose copies finish late are confirmed late (and stay pinned until then),
and every restore still holds exactly the right bytes."""

from __future__ import annotations

import os
import threading
import time

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from sched_harness import GroupDef, build  # noqa: E402
from test_connector_scheduler import PROMPT, compute_then_drop, restore  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from umbp.pool.errors import UmbpError  # noqa: E402

GROUPS = [GroupDef("fa", 400), GroupDef("mamba", 400)]
NO_LEAKS = {"index_pinned": 0, "pending_saves": 0, "pending_loads": 0, "gpu_blocks_held": 0}


def _ssd_extra(tmp_path) -> dict:
    return {"dram_bytes": 64 << 20, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_gb": 0.25}


def _ssd_engine_pair(tmp_path):
    """Engine 1 computes PROMPT and exits; engine 2 (empty DRAM) finds it on the SSD tier."""
    extra = _ssd_extra(tmp_path)
    h1 = build(tmp_path, GROUPS, unit=16, extra=extra)
    assert compute_then_drop(h1, "A", PROMPT) == 832
    for w in h1.workers:
        w.shutdown()
    return build(tmp_path, GROUPS, unit=16, extra=extra)


def _before_ssd(h, method: str, before) -> None:
    """Every worker's SSD tier runs before(keys) first whenever `method` (get_into, put) is called."""
    for w in h.workers:
        tier = w._worker.ssd
        real = getattr(tier, method)

        def wrapped(keys, *args, real=real, **kwargs):
            before(keys)
            return real(keys, *args, **kwargs)

        setattr(tier, method, wrapped)


def _gate_tier_reads(h) -> threading.Event:
    """Tier reads block until the returned event is set (a slow disk)."""
    gate = threading.Event()
    _before_ssd(h, "get_into", lambda _keys: _wait(gate))
    return gate


def _gate_tier_writes(h, fail: bool = False) -> threading.Event:
    """SSD puts (made on each worker's feeder thread) block until the returned event is set (a slow
    copy into staging); with fail=True they then raise."""
    gate = threading.Event()

    def slow(_keys):
        _wait(gate)
        if fail:
            raise UmbpError("umbp: test: the SSD tier failed")

    _before_ssd(h, "put", slow)
    return gate


def _wait(gate: threading.Event) -> None:
    assert gate.wait(30), "test gate never opened"


def _restore_in_engine_2(h, tmp_path, req_id):
    """Shut engine 1 (h) down, then restore PROMPT in a new engine with empty DRAM and the same SSD tier."""
    for w in h.workers:
        w.shutdown()
    h2 = build(tmp_path, GROUPS, unit=16, extra=_ssd_extra(tmp_path))
    try:
        return restore(h2, req_id, PROMPT)
    finally:
        for w in h2.workers:
            w.shutdown()


def test_slow_tier_write_does_not_stall_the_step(tmp_path):
    """A save's copy into the SSD tier runs beside the engine's step; the save is confirmed (and its
    objects offered from SSD) only once that copy is done, and engine 2 restores from it exactly."""
    h = build(tmp_path, GROUPS, unit=16, extra=_ssd_extra(tmp_path))
    gate = _gate_tier_writes(h)
    h.add("A", PROMPT, max_tokens=3)
    t0 = time.monotonic()
    h.step()  # prefill + saves; the SSD copies are blocked: were they on the step's path, it would hang
    assert time.monotonic() - t0 < 10
    feeding = [p for w in h.workers for p in w._worker.pending_saves if p.feed is not None]
    assert feeding and not any(p.feed.done() for p in feeding)
    assert h.umbp.saves and not h.umbp.ssd_keys  # unconfirmed: GPU blocks pinned, nothing offered yet
    gate.set()
    h.run()
    assert h.umbp.ssd_keys  # confirmed with the SSD copies
    assert h.leaks() == NO_LEAKS
    assert _restore_in_engine_2(h, tmp_path, "B") == (832, [])


def test_failed_tier_write_keeps_the_dram_copy(tmp_path):
    """An SSD tier that raises while taking a save's objects: counted, the DRAM copy is still confirmed
    and restored exactly, and nothing is offered from (or found on) the SSD tier."""
    h = build(tmp_path, GROUPS, unit=16, extra=_ssd_extra(tmp_path))
    _gate_tier_writes(h, fail=True).set()
    assert compute_then_drop(h, "A", PROMPT) == 832
    assert not h.umbp.ssd_keys
    assert all(w._worker.totals["ssd_saves_dropped"] > 0 for w in h.workers)
    assert restore(h, "B", PROMPT) == (832, [])  # from DRAM
    assert h.leaks() == NO_LEAKS
    assert _restore_in_engine_2(h, tmp_path, "C") == (0, [])


def test_slow_tier_read_does_not_stall_the_step(tmp_path):
    h = _ssd_engine_pair(tmp_path)
    gate = _gate_tier_reads(h)
    req = h.add("B", PROMPT, max_tokens=4)
    t0 = time.monotonic()
    for _ in range(3):  # the read is blocked: were it on the step's path, the first step would hang
        h.step()
    assert time.monotonic() - t0 < 10
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and "B" in h.umbp.loads
    gate.set()
    while "B" in h.umbp.loads:
        time.sleep(0.001)
        h.step()
    assert h.umbp.restored["B"] == 832
    assert h.held_values("B", 832) == []  # checked before any forward touched the request
    h.run()
    assert h.leaks() == NO_LEAKS
    for w in h.workers:
        w.shutdown()


def test_abort_while_a_tier_read_is_in_flight(tmp_path):
    h = _ssd_engine_pair(tmp_path)
    gate = _gate_tier_reads(h)
    h.add("B", PROMPT, max_tokens=4)
    h.step()
    assert "B" in h.umbp.loads
    h.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    gate.set()
    t0 = time.monotonic()
    while "B" in h.umbp.loads:  # vLLM holds B's blocks until the worker reports the load done
        assert time.monotonic() - t0 < 30
        time.sleep(0.001)
        h.step()
    assert h.leaks() == NO_LEAKS
    assert restore(h, "C", PROMPT) == (832, [])  # the promoted objects are intact and reusable
    for w in h.workers:
        w.shutdown()


class _LateHandle:
    def __init__(self, inner, polls: int):
        self.inner, self.left = inner, polls

    def done(self) -> bool:
        self.left -= 1
        return self.left < 0

    def result(self):
        return self.inner.result()

    def wait(self) -> None:
        self.inner.wait()


class _LateEngine:
    """The worker's real engine, but its handles report done only after a few polls, as CUDA copies
    still in flight on the engine's streams would. Counts the fences the worker asks for."""

    def __init__(self, engine, polls: int = 3):
        self.engine, self.polls = engine, polls
        self.fences = 0
        self.unfenced = 0  # save jobs of full blocks only
        self.most_pending = 0
        self.worker = None

    def save(self, batch):
        return _LateHandle(self.engine.save(batch), self.polls)

    def load(self, batch):
        return _LateHandle(self.engine.load(batch), self.polls)

    def fence(self, handle) -> None:
        job = next(p.job for p in self.worker.pending_saves if p.handle is handle)
        assert job.fence, "a save of full blocks only must not hold up the next forward"
        self.fences += 1


@pytest.mark.parametrize("tp", [1, 2])
def test_late_copies_are_confirmed_late_and_restore_exactly(tmp_path, tp):
    h = build(tmp_path, GROUPS, unit=16, tp=tp)
    engines = []
    for w in h.workers:
        late = _LateEngine(w._worker.engine)
        late.worker = w._worker
        w._worker.engine = late
        engines.append(late)
        real_save = w._worker.save

        def save(meta, worker=w._worker, late=late, real_save=real_save):
            real_save(meta)
            late.most_pending = max(late.most_pending, len(worker.pending_saves))
            late.unfenced += sum(not job.fence for job in meta.saves)

        w._worker.save = save
    assert compute_then_drop(h, "A", PROMPT) == 832
    assert all(e.most_pending > 0 for e in engines)  # saves really were in flight past wait_for_save
    assert all(e.fences > 0 for e in engines)  # and the next forward was ordered after the mutable ones
    assert all(e.unfenced > 0 for e in engines)  # while full blocks were left to copy beside it
    assert restore(h, "B", PROMPT) == (832, [])
    assert h.leaks() == NO_LEAKS


class _WatchedEngine:
    """The worker's real engine; records the groups of each save() and load() call's Moves, and refuses
    the calls refuse(direction, groups) picks."""

    def __init__(self, engine, refuse=lambda _direction, _groups: False):
        self.engine, self.refuse = engine, refuse
        self.calls: dict[str, list[list[int]]] = {"save": [], "load": []}

    def save(self, batch):
        return self._call("save", batch)

    def load(self, batch):
        return self._call("load", batch)

    def _call(self, direction: str, batch):
        groups = [m.group for m in batch]
        self.calls[direction].append(groups)
        if self.refuse(direction, groups):
            raise OSError(f"injected: this {direction} is refused")
        return getattr(self.engine, direction)(batch)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _watch_saves(h, failing_group: int | None = None):
    """Swap each worker's engine for a _WatchedEngine (refusing every save that carries a page of
    `failing_group`); collect the jobs of each save() and each rank's confirmed and failed job ids."""
    engines, jobs, saved, failed = [], [], set(), set()
    for w in h.workers:
        worker = w._worker
        worker.engine = _WatchedEngine(
            worker.engine, lambda d, groups: d == "save" and failing_group in groups
        )
        engines.append(worker.engine)
        real_save, real_meta = worker.save, worker.take_worker_meta

        def save(meta, real_save=real_save):
            jobs.append(list(meta.saves))
            real_save(meta)

        def take(real_meta=real_meta):
            meta = real_meta()
            if meta is not None:
                saved.update(meta.saved)
                failed.update(meta.failed)
            return meta

        worker.save, worker.take_worker_meta = save, take
    return engines, jobs, saved, failed


def test_a_steps_save_jobs_share_one_engine_call_per_fence_kind(tmp_path):
    h = build(tmp_path, GROUPS, unit=16)
    engines, jobs, saved, failed = _watch_saves(h)
    assert compute_then_drop(h, "A", PROMPT) == 832
    kinds = [len({j.fence for j in step}) for step in jobs if step]
    assert any(len(step) > n for step, n in zip([s for s in jobs if s], kinds))  # two jobs of one kind
    calls = engines[0].calls["save"]
    assert len(calls) == sum(kinds)  # one engine call per fence kind and step
    assert not failed and saved == {j.job_id for step in jobs for j in step}
    assert restore(h, "B", PROMPT) == (832, [])
    assert h.leaks() == NO_LEAKS


def test_a_failing_job_does_not_fail_the_jobs_it_was_batched_with(tmp_path):
    """The engine refuses every batch holding a Mamba page: the full-attention jobs that shared its batch
    are saved on their own, only the Mamba jobs fail, and nothing partial is ever restored."""
    h = build(tmp_path, GROUPS, unit=16)
    engines, jobs, saved, failed = _watch_saves(h, failing_group=1)
    assert compute_then_drop(h, "A", PROMPT) == 832
    every = [j for step in jobs for j in step]
    shared = [c for c in engines[0].calls["save"] if 1 in c and 0 in c]
    assert shared  # a full-attention job was batched with a Mamba job
    assert failed == {j.job_id for j in every if j.group == 1}
    assert saved == {j.job_id for j in every if j.group == 0}
    assert restore(h, "B", PROMPT) == (0, [])  # no state at any boundary: a miss, never a partial restore
    assert h.leaks() == NO_LEAKS


def test_a_load_reads_its_tier_objects_in_one_call(tmp_path):
    """A restore from the SSD tier asks it for all of the load's objects at once (read in parallel there;
    one round trip on the shared tier), not object by object, and still restores exactly."""
    h = _ssd_engine_pair(tmp_path)
    calls = []
    _before_ssd(h, "get_into", lambda keys: calls.append(len(keys)))
    assert restore(h, "B", PROMPT) == (832, [])
    assert len(calls) == len(h.workers) and all(n >= 2 for n in calls), calls
    assert h.leaks() == NO_LEAKS
    for w in h.workers:
        w.shutdown()


@pytest.mark.parametrize("refuse_combined", [False, True])
def test_restores_started_in_one_step_share_one_engine_call(tmp_path, refuse_combined):
    """Two requests restored from DRAM in the same step: one engine call for both loads (or, when the
    engine refuses the combined call, one each), and each request holds exactly its own prefix."""
    h = build(tmp_path, GROUPS, unit=16)
    other = [7 + (i * 53) % 500 for i in range(840)]
    assert compute_then_drop(h, "A1", PROMPT) == 832
    assert compute_then_drop(h, "A2", other) == 832
    counters = []
    for w in h.workers:  # a combined call carries more than one load's objects (one Moves per group each)
        w._worker.engine = _WatchedEngine(
            w._worker.engine, lambda d, groups: d == "load" and refuse_combined and len(groups) > len(GROUPS)
        )
        counters.append(w._worker.engine)
    h.add("B1", PROMPT, max_tokens=4)
    h.add("B2", other, max_tokens=4)
    h.step()
    t0 = time.monotonic()
    while "B1" in h.umbp.loads or "B2" in h.umbp.loads:
        assert time.monotonic() - t0 < 30
        h.step()
    assert h.umbp.restored.get("B1") == 832 and h.umbp.restored.get("B2") == 832
    assert h.held_values("B1", 832) == [] and h.held_values("B2", 832) == []
    want = [2 * len(GROUPS), len(GROUPS), len(GROUPS)] if refuse_combined else [2 * len(GROUPS)]
    assert all([len(c) for c in e.calls["load"]] == want for e in counters), [e.calls for e in counters]
    h.run()
    assert h.leaks() == NO_LEAKS
