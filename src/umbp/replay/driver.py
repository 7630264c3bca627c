"""The replay loop: sessions -> vLLM's Scheduler (with umbp) -> simulated workers, on a modelled clock.

Closed loop, like an agent fleet: at most ``concurrency`` sessions are active; an active session submits
its next turn ``think_s`` after its previous turn finished; a finished session hands its slot to the next
one. The engine is the prefill instance of 1P1D: every request generates one token (its reply is decoded
elsewhere and comes back inside the next turn's prompt).

Per request, at the lookup that admitted it, the replay records vLLM's local hit, umbp's hit and the
oracle (:mod:`umbp.replay.oracle`); after admission, what vLLM took (``prefill_stats``) and whether the
load completed. A request whose restore fell short of the oracle gets a reason and, for the first few,
umbp's own explanation (``SchedulerSide.explain``, the ``umbp explain`` text).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from umbp.hybrid import Space, hit_alignment
from umbp.replay import oracle
from umbp.replay.deployments import ReplayLayout
from umbp.replay.engine import Engine, build_engine
from umbp.replay.simworker import SimWorkers
from umbp.replay.trace import Segment, TokenCache, Turn, sessions
from umbp.vllm.compat import hash_lookahead_tokens, runner_output

ADMITTED = (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS)
STALL_STEPS = 10_000  # empty steps in a row without the clock moving: the replay is stuck


# the connector under test; "offloading": vLLM's OffloadingConnector as a peer (umbp.replay.offloading)
CONNECTORS = ("umbp", "offloading")


@dataclass(frozen=True)
class Setting:
    boundary_page: bool  # umbp's boundary page (a peer connector has no such switch: False)
    retention: int
    connector: str = "umbp"

    @property
    def label(self) -> str:
        if self.connector == "offloading":
            return f"vLLM OffloadingConnector, retention {self.retention}"
        return f"page {'on' if self.boundary_page else 'off'}, retention {self.retention}"


@dataclass
class RequestRecord:
    req_id: str
    session: str
    turn: int
    prompt_tokens: int
    submitted_s: float
    admitted_s: float | None = None
    finished_s: float | None = None
    local: int = 0  # vLLM's local hit at the admitting lookup (incl. a sub-block tail)
    oracle: int = 0  # an unbounded local GPU prefix cache's hit at that lookup
    umbp_hit: int = 0  # the boundary the connector's lookup found (umbp's, or the peer's in a peer run)
    served: int = 0  # tokens vLLM did not compute at admission (local + external, prefill_stats)
    external: int = 0
    load_ok: bool | None = None  # None: no load
    preemptions: int = 0
    reason: str = ""  # why the restore stopped short of the oracle ("" if it did not)
    explain: str = ""

    @property
    def restorable(self) -> int:
        return max(0, self.oracle - self.local)

    @property
    def restored(self) -> int:
        """Tokens umbp supplied beyond the local hit (0 if the load failed: vLLM recomputed them)."""
        if self.external and not self.load_ok:
            return 0
        return max(0, self.served - self.local)

    @property
    def restored_of_oracle(self) -> int:
        """The part of ``restored`` the oracle also reaches (umbp can reach further: see docs/replay.md)."""
        return min(self.restored, self.restorable)

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if v not in ("", None)}
        out["restorable"], out["restored"] = self.restorable, self.restored
        out["restored_of_oracle"] = self.restored_of_oracle
        return out


@dataclass
class ReplayResult:
    layout: ReplayLayout
    setting: Setting
    concurrency: int
    records: list[RequestRecord]
    totals: dict[str, int]
    sim_s: float
    wall_s: float
    steps: int
    load_seconds: list[float]
    link_bytes: dict[str, int]


@dataclass
class _Session:
    turns: list[Turn]
    next: int = 0


class _Observer:
    """Records local hit, oracle and umbp's hit at each lookup of a not-yet-admitted request."""

    def __init__(self, replay: Replay):
        self.replay = replay

    def on_lookup(self, connector, request, num_computed_tokens: int, ext: int | None) -> None:
        rec = self.replay.pending.get(request.request_id)
        if rec is not None:
            self.replay.observe_lookup(rec, request, num_computed_tokens, ext)


@dataclass
class Replay:
    layout: ReplayLayout
    setting: Setting
    turns: list[Turn]
    concurrency: int
    workdir: Path
    max_explain: int = 20
    on_finish: Callable[[RequestRecord], None] | None = None
    engine: Engine = field(init=False)
    now: float = 0.0
    steps: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    pending: dict[str, RequestRecord] = field(default_factory=dict)  # submitted, not yet admitted

    def __post_init__(self) -> None:
        self._build()
        self.engine.connector.observer = _Observer(self)
        self.ever = oracle.install(self.engine.sched.kv_cache_manager.block_pool)
        self.tokens = TokenCache()
        self.hashes = PrefixHashes(self.layout.unit, hash_lookahead_tokens(self.engine.vllm_config))
        self.sessions = [_Session(s) for s in sessions(self.turns)]
        self.waiting_sessions = list(range(len(self.sessions)))[::-1]  # pop() gives the next one
        self.ready: list[tuple[float, int, int]] = []  # (time, seq, session index)
        self.live: dict[str, tuple[Request, RequestRecord, int]] = {}
        self.loading: dict[str, RequestRecord] = {}
        self.explained = 0
        self.active = 0  # sessions holding a concurrency slot
        self._seq = 0

    def _build(self) -> None:
        """The engine with the connector under test and its simulated workers (a peer run overrides)."""
        self.engine = build_engine(
            self.layout,
            boundary_page=self.setting.boundary_page,
            retention=self.setting.retention,
            workdir=self.workdir,
        )
        self.committed = record_commits(self.engine.umbp.index)
        self.workers = SimWorkers(self.layout.timing, frozenset(self.engine.umbp.rank_tags))

    def _loads_done(self):
        """Requests whose load the connector has seen completed."""
        return self.engine.umbp.restored

    def _totals(self) -> dict[str, int]:
        return dict(self.engine.umbp.totals)

    # ------------------------------------------------------------------ sessions
    def _start_sessions(self) -> None:
        while self.waiting_sessions and self.active < self.concurrency:
            idx = self.waiting_sessions.pop()
            first = self.sessions[idx].turns[0]
            self._schedule_turn(idx, max(self.now, first.arrival_s or 0.0))
            self.active += 1

    def _schedule_turn(self, idx: int, at: float) -> None:
        self._seq += 1
        heapq.heappush(self.ready, (at, self._seq, idx))

    def _submit_ready(self) -> None:
        while self.ready and self.ready[0][0] <= self.now:
            _, _, idx = heapq.heappop(self.ready)
            self._submit(idx)

    def _submit(self, idx: int) -> None:
        sess = self.sessions[idx]
        turn = sess.turns[sess.next]
        prompt = self.tokens.prompt(turn)
        req_id = f"{turn.session}#{turn.turn}"
        req = Request(
            request_id=req_id,
            prompt_token_ids=prompt,
            pooling_params=None,
            block_hasher=None,
            sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
        )
        self.hashes.attach(req, turn, self.engine.hasher)
        rec = RequestRecord(req_id, turn.session, turn.turn, len(prompt), self.now)
        self.records.append(rec)
        self.pending[req_id] = rec
        self.live[req_id] = (req, rec, idx)
        self.engine.sched.add_request(req)

    def _turn_done(self, idx: int) -> None:
        sess = self.sessions[idx]
        sess.next += 1
        if sess.next < len(sess.turns):
            self._schedule_turn(idx, self.now + sess.turns[sess.next].think_s)
            return
        self.hashes.forget(sess.turns[0].session)
        self.tokens.forget(seg.id for t in sess.turns for seg in t.segments if seg.id.startswith(t.session))
        self.active -= 1
        self._start_sessions()

    # ------------------------------------------------------------------ observation
    def observe_lookup(self, rec: RequestRecord, request, num_computed_tokens: int = 0, ext=None) -> None:
        sched, umbp = self.engine.sched, self.engine.umbp
        rec.local = oracle.local_hit(sched.kv_cache_manager, request)
        rec.oracle = oracle.oracle_hit(self.ever, request, umbp.layout)
        tracked = umbp.requests.get(request.request_id)
        rec.umbp_hit = tracked.hit.tokens if tracked is not None and tracked.hit is not None else 0
        rec.reason, rec.explain = "", ""
        if max(rec.local, rec.umbp_hit) < rec.oracle:
            rec.reason = stop_reason(umbp, request, rec.oracle, self.committed)
            if self.explained < self.max_explain:
                rec.explain = umbp.explain(request)

    def _note_admissions(self) -> None:
        """A request is admitted once it leaves WAITING (vLLM fills ``prefill_stats`` at every attempt,
        including ones whose block allocation then fails, so its presence alone proves nothing)."""
        for req_id in list(self.pending):
            req, rec, _ = self.live[req_id]
            stats = req.prefill_stats
            if req.status not in ADMITTED or stats is None or stats.num_prompt_tokens == 0:
                continue
            del self.pending[req_id]
            rec.admitted_s = self.now
            rec.served, rec.external = stats.num_cached_tokens, stats.num_external_cached_tokens
            if rec.external:
                rec.load_ok = False
                self.loading[req_id] = rec

    def _note_loads(self) -> None:
        restored = self._loads_done()
        for req_id in [r for r in self.loading if r in restored]:
            self.loading.pop(req_id).load_ok = True

    def _note_finished(self) -> None:
        requests = self.engine.sched.requests
        for req_id in [r for r in self.live if r not in requests]:
            req, rec, idx = self.live.pop(req_id)
            rec.finished_s = self.now
            rec.preemptions = req.num_preemptions
            self.loading.pop(req_id, None)
            self.pending.pop(req_id, None)
            self._settle(rec)
            if self.on_finish is not None:
                self.on_finish(rec)
            self._turn_done(idx)

    def _settle(self, rec: RequestRecord) -> None:
        """Keep a reason only for a restore that really fell short of the oracle."""
        if rec.restored_of_oracle >= rec.restorable:
            rec.reason, rec.explain = "", ""
            return
        if rec.external and not rec.load_ok:
            rec.reason = "load failed"
        elif not rec.reason:
            rec.reason = "vLLM took less than umbp's hit"
        if rec.explain:
            self.explained += 1

    # ------------------------------------------------------------------ the loop
    def run(self) -> ReplayResult:
        t0 = time.perf_counter()
        self._start_sessions()
        stalled = 0
        while True:
            self._submit_ready()
            if self.engine.sched.has_requests():
                moved = self.step()
                stalled = 0 if moved else stalled + 1
                if stalled > STALL_STEPS:
                    raise RuntimeError(
                        f"replay stalled at t={self.now:.3f}s with "
                        f"{len(self.engine.sched.requests)} requests in the scheduler"
                    )
            elif self.ready:
                self.now = max(self.now, self.ready[0][0])
            else:
                break
        return ReplayResult(
            self.layout,
            self.setting,
            self.concurrency,
            self.records,
            self._totals(),
            self.now,
            time.perf_counter() - t0,
            self.steps,
            self.workers.load_seconds,
            {"h2d": self.workers.h2d.bytes, "d2h": self.workers.d2h.bytes},
        )

    def step(self) -> bool:
        """One engine step; True when it computed tokens or moved the clock."""
        sched = self.engine.sched
        so = sched.schedule()
        self.ever.end_of_schedule()
        self.steps += 1
        self._note_admissions()
        start = self.now
        dt = self.layout.timing.step_seconds(so.total_num_scheduled_tokens, self._context_load(so))
        if dt > 0:  # a peer's worker may hold the forward back (vLLM's OffloadingConnector: jobs_to_flush)
            start = self.workers.barrier(so.kv_connector_metadata, start)
            end = start + dt
            self.workers.dispatch(so.kv_connector_metadata, start, end)
        else:  # queued before the jump, so that the jump can stop at this step's own jobs
            self.workers.dispatch(so.kv_connector_metadata, start, start)
            end = self._next_event(start)
        self.now = end
        sched.update_from_output(so, self._runner_output(so))
        self._note_loads()
        self._note_finished()
        return dt > 0 or end > start

    def _next_event(self, now: float) -> float:
        """With nothing to compute, time jumps to the next transfer completion or turn submission."""
        events = [
            t for t in (self.workers.next_event(), self.ready[0][0] if self.ready else None) if t is not None
        ]
        return max(now, min(events)) if events else now

    def _context_load(self, so) -> float:
        requests = self.engine.sched.requests
        return sum(n * requests[r].num_computed_tokens for r, n in so.num_scheduled_tokens.items()) / 1000

    def _runner_output(self, so) -> ModelRunnerOutput:
        requests = self.engine.sched.requests
        ids = list(so.num_scheduled_tokens)
        sampled = [[1] if requests[r].num_computed_tokens >= requests[r].num_tokens else [] for r in ids]
        return runner_output(ids, sampled, self.workers.collect(self.now))


class PrefixHashes:
    """vLLM's chained block hashes, reused for the prefix a prompt shares with the session's previous turn
    (or with any prompt that starts with the same first segment, e.g. a system prompt).

    Hash ``i`` covers tokens ``[0, (i + 1) * unit + lookahead)`` and nothing else (``lookahead``: vLLM's
    ``num_hash_lookahead_tokens``, 0 without lookahead hashes), so reusing it for an identical token
    prefix that long gives exactly the list vLLM's hasher would compute; only the time differs (at u=16
    the hashing is most of the replay's cost otherwise).
    """

    def __init__(self, unit: int, lookahead: int = 0) -> None:
        self.unit = unit
        self.lookahead = lookahead
        self.by_session: dict[str, tuple[tuple[Segment, ...], list]] = {}
        self.by_first_segment: dict[str, tuple[int, list]] = {}

    def attach(self, request: Request, turn: Turn, hasher) -> None:
        reuse = self._reusable(turn)
        request.block_hashes = reuse
        request._block_hasher = hasher
        request.update_block_hashes()
        self.by_session[turn.session] = (turn.segments, request.block_hashes)
        first = turn.segments[0]
        if first.tokens is None and first.id not in self.by_first_segment:
            n = self._count(first.length)
            self.by_first_segment[first.id] = (first.length, list(request.block_hashes[:n]))

    def _reusable(self, turn: Turn) -> list:
        best: list = []
        prev = self.by_session.get(turn.session)
        if prev is not None:
            best = prev[1][: self._count(common_tokens(prev[0], turn.segments))]
        first = turn.segments[0]
        cached = self.by_first_segment.get(first.id) if first.tokens is None else None
        if cached is not None:
            n = self._count(min(cached[0], first.length))
            if n > len(best):
                best = cached[1][:n]
        return list(best)

    def _count(self, shared_tokens: int) -> int:
        """Hashes that depend only on the first ``shared_tokens`` tokens."""
        return max(0, shared_tokens - self.lookahead) // self.unit

    def forget(self, session: str) -> None:
        self.by_session.pop(session, None)


def common_tokens(a: tuple[Segment, ...], b: tuple[Segment, ...]) -> int:
    """Length of the token prefix two segment lists certainly share."""
    n = 0
    for x, y in zip(a, b):
        if x == y:
            n += x.size
            continue
        if x.tokens is None and y.tokens is None and x.id == y.id:
            n += min(x.length, y.length)  # the same stream, cut at different lengths
        break
    return n


def record_commits(index) -> set[str]:
    """Every key umbp's DRAM index ever made visible (so a missing key can be told apart as evicted).
    Wraps the index instance's ``commit``; behaviour is unchanged."""
    committed: set[str] = set()
    commit = index.commit

    def recording_commit(key: str, *args, **kwargs):
        committed.add(key)
        return commit(key, *args, **kwargs)

    index.commit = recording_commit
    return committed


def stop_reason(umbp, request, target: int, committed: set[str] = frozenset()) -> str:
    """Which object umbp lacks for a resume at ``target`` (the oracle), checked group by group."""
    layout = umbp.layout
    groups, unit = list(layout.spans), layout.unit  # block spans of vLLM's tables (DCP-scaled attention)
    hashed = len(request.block_hashes) * unit
    present = umbp.present_sets(request, hashed)
    space = Space(unit, hit_alignment(layout.groups, unit, layout.dcp), hashed)
    for g, spec in enumerate(groups):
        eagle = g in layout.eagle_groups
        has = present[g].__contains__
        if spec.kind == "recurrent_state":
            if not has(target):
                return _tag(umbp, request, g, target, "state", committed)
            continue
        # vLLM looks attention up once, to the request's limit (+ EAGLE's margin), then only trims it
        margin = spec.eagle_margin(space) if eagle else 0
        reach = spec.longest(has, min(request.num_tokens - 1 + margin, hashed), space, eagle).tokens
        if reach >= target:
            continue
        for need in spec.needs(target, space, eagle):
            if not has(need.end):
                kind = (
                    "boundary page"
                    if need.what.startswith("partial page")
                    else need.what.split(" ")[0] + " block"
                )
                return _tag(umbp, request, g, need.end, kind, committed)
        return f"g{g} lookup stops below"
    return "every object present; lookup rule"


def _tag(umbp, request, group: int, end: int, kind: str, committed: set[str]) -> str:
    key = umbp.key(group, request, end) if end <= len(request.block_hashes) * umbp.layout.unit else None
    if key is not None and key in umbp.in_flight_keys:
        return f"{kind} missing (save in flight)"
    if key is not None and key in committed:
        return f"{kind} missing (evicted from DRAM)"
    return f"{kind} missing (never stored)"


def replay(
    layout: ReplayLayout,
    setting: Setting,
    turns: list[Turn],
    concurrency: int,
    workdir: Path,
    on_finish: Callable[[RequestRecord], None] | None = None,
    max_explain: int = 20,
) -> ReplayResult:
    cls = Replay
    if setting.connector == "offloading":
        from umbp.replay.peer import OffloadingReplay as cls  # imports vLLM's offloading connector
    elif setting.connector != "umbp":
        raise ValueError(f"unknown connector {setting.connector!r}; one of {CONNECTORS}")
    return cls(
        layout, setting, turns, concurrency, workdir, max_explain=max_explain, on_finish=on_finish
    ).run()


def reason_counts(records: list[RequestRecord]) -> Counter[str]:
    return Counter(r.reason for r in records if r.reason)
