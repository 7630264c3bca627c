"""The queued timing of the GPU benchmarks refuses a transfer that finished while the stream it was
ordered behind was still busy: such a figure would read above the link. The device is replaced by a
clock the test drives (CI has no GPU); the check itself is the benchmark's own code."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from umbp.tools import cuda_timing  # noqa: E402


class _Sleep:
    """A device stream whose queued sleep ends after `busy_polls` queries of the event behind it."""

    def __init__(self, busy_polls: int) -> None:
        self.busy_polls = busy_polls
        self.polls = 0

    def event(self, enable_timing: bool = False) -> _Event:
        return _Event(self)


class _Event:
    def __init__(self, sleep: _Sleep) -> None:
        self.sleep = sleep

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        self.sleep.polls += 1
        return self.sleep.polls > self.sleep.busy_polls

    def elapsed_time(self, other: _Event) -> float:
        return 2.0  # ms


class _Handle:
    def __init__(self, done: bool) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done

    def wait(self) -> None:
        self._done = True


@pytest.fixture
def device(monkeypatch):
    sleep = _Sleep(busy_polls=10**9)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "Event", sleep.event)
    return sleep


def test_a_transfer_done_while_the_stream_is_busy_is_an_error(device):
    with pytest.raises(RuntimeError, match="still busy"):
        cuda_timing.queued(lambda: [_Handle(done=True)], reps=3, warmup=0)


def test_transfers_ordered_behind_the_busy_stream_are_timed(device):
    seconds, ahead = cuda_timing.queued(lambda: [_Handle(done=False), _Handle(done=False)], reps=3, warmup=0)
    assert seconds == pytest.approx(0.002)
    assert ahead == 1.0  # every call issued everything before the sleep ended


def test_a_call_issued_after_the_sleep_ended_counts_as_late(device):
    device.busy_polls = 0  # the sleep is over before the engine returns: the host was the bottleneck
    seconds, ahead = cuda_timing.queued(lambda: [_Handle(done=True)], reps=4, warmup=0)
    assert ahead == 0.0
    assert seconds == pytest.approx(0.002)


def test_interleaved_runs_every_call_each_repetition_in_a_fresh_order(device):
    seen: list[str] = []
    calls = {k: (lambda k=k: seen.append(k)) for k in "abcd"}
    times = cuda_timing.interleaved(calls, reps=6, warmup=2, seed=1)
    assert {k: len(v) for k, v in times.items()} == dict.fromkeys("abcd", 6)
    assert seen[:8] == ["a", "a", "b", "b", "c", "c", "d", "d"]  # each warmed up first
    rounds = [tuple(seen[8 + 4 * r : 12 + 4 * r]) for r in range(6)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    assert len(set(rounds)) > 1  # the order changes between repetitions


def test_wall_runs_the_call_after_its_warm_up_and_returns_a_median(device):
    runs = []
    seconds = cuda_timing.wall(lambda: runs.append(1), reps=5, warmup=2)
    assert len(runs) == 7 and seconds >= 0.0


def test_submitted_times_the_issue_not_the_wait():
    """`umbp bench restore`'s host column: the seconds until the transfer call returned its handle, not
    the wait for its result, so that a call whose host time is its whole time reads as host-bound."""
    import time

    from umbp.tools.bench_restore import submitted

    class Handle:
        def result(self):
            time.sleep(0.2)
            return "verdicts"

    def issue():
        time.sleep(0.05)
        return Handle()

    times: list[float] = []
    call = submitted(issue, times)
    assert call() == "verdicts" and call() == "verdicts"
    assert len(times) == 2 and all(0.05 <= t < 0.2 for t in times)


def test_held_streams_wait_for_the_sleep(device):
    """An engine's own streams named in `hold` wait for the event after the sleep, every repetition: a
    load's copies, not ordered after the caller's stream, would otherwise run during the sleep and out of
    the figure."""
    waits = []

    class _Stream:
        def wait_event(self, event) -> None:
            waits.append(event)

    cuda_timing.queued(lambda: [_Handle(done=False)], reps=3, warmup=0, hold=(_Stream(), _Stream()))
    assert len(waits) == 6 and all(isinstance(e, _Event) for e in waits)
