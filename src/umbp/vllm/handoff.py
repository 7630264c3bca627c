"""Store-mediated P/D: the prefill instance hands a request to the decode instance through umbp's shared tier.

No second connector. P's umbp (``kv_role: kv_producer``) stores the prompt as usual, writing through to the
shared Redis/Valkey tier; D's umbp (``kv_role: kv_consumer``) restores it from there like any prefix hit.
What this module adds is the delivery contract between the two:

* P (``Producer``): for a request sent with ``do_remote_decode``, ``request_finished`` names the boundary D
  will resume at (``umbp_handoff.tokens``: the hit a lookup with every object present reaches) and returns
  "sending": vLLM keeps the request's blocks and keeps stepping. Every step, one pipelined EXISTS asks the
  shared tier for the objects of that hit on every rank that are not yet seen; when all are visible the
  workers report the request ``finished_sending``. After ``handoff_timeout_s`` it is reported anyway, counted
  as ``handoff_timeouts`` and logged: the blocks must not be held forever, and D recomputes what is missing.
* D (``Consumer``): a request carrying ``umbp_handoff`` waits (its lookup answers "ask again later") until
  its hit reaches the named boundary or ``handoff_wait_s`` passes, so a proxy that sends to D as soon as P's
  output arrives (before P's writes are visible) still gets the full hit. Past the wait D takes whatever
  hit it finds (counted as ``handoff_misses``): a missing or corrupt object is a recompute, never a wrong
  token, because every object is keyed by its prefix hash and verified by its checksum.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from umbp.hybrid import longest_hit

logger = logging.getLogger("umbp.vllm")

COMPLETED = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")  # aborted, errored, ...: nothing to hand off
POLL_INTERVAL_S = 0.002  # the fastest D re-asks the shared tier while it waits (vLLM re-asks every step)
PARAMS_KEY = "umbp_handoff"


@dataclass
class Delivery:
    req_id: str
    tokens: int  # the boundary D resumes at
    missing: list[str]  # rank keys not yet seen on the shared tier
    started: float
    deadline: float


@dataclass
class Wait:
    deadline: float
    started: float
    last_poll: float = 0.0
    decided: bool = False  # received or missed: never held (or counted) again, e.g. after a preemption


def wants_decode_elsewhere(request) -> bool:
    params = getattr(request, "kv_transfer_params", None)
    return bool(params) and bool(params.get("do_remote_decode"))


def handoff_tokens(request) -> int:
    """The boundary P named for this request (0: not a store-mediated hand-off)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    spec = params.get(PARAMS_KEY)
    if not isinstance(spec, dict):
        return 0
    tokens = spec.get("tokens")
    return tokens if isinstance(tokens, int) and tokens > 0 else 0


def full_hit(side, request):
    """The hit a lookup of this request reaches when every object is present: what D will need."""
    unit = side.layout.unit
    hashed = len(request.block_hashes) * unit
    everything = set(range(unit, hashed + 1, unit))
    groups = list(side.layout.groups)
    return longest_hit(
        groups,
        unit=unit,
        present=[everything] * len(groups),
        max_tokens=request.num_prompt_tokens - 1,
        eagle_groups=side.layout.eagle_groups,
        hashed_tokens=hashed,
    )


@dataclass
class Producer:
    side: Any  # umbp.vllm.scheduler.SchedulerSide
    timeout_s: float
    pending: dict[str, Delivery] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)  # delivered (or given up), not yet sent to the workers
    # logical key -> when its save completed, for the last timeout_s: the shared tier's writer may still
    # hold such a write in its queue, so its absence there is no sign that it will never come (_coming)
    recent: dict[str, float] = field(default_factory=dict)

    def saved(self, keys: list[str]) -> None:
        now = time.monotonic()
        self.recent.update(dict.fromkeys(keys, now))
        if len(self.recent) > 1024:  # prune now and then: dicts keep insertion order, oldest first
            cutoff = now - self.timeout_s
            old = next((i for i, t in enumerate(self.recent.values()) if t >= cutoff), len(self.recent))
            for key in list(self.recent)[:old]:
                del self.recent[key]

    def begin(self, request, hexes: list[str], complete: bool = True) -> tuple[bool, dict[str, Any] | None]:
        """At request_finished: the params D needs, and whether the workers will report it later.
        ``complete=False``: some of its saves were dropped (pipeline stages not yet known), so its objects
        would never all become visible: nothing is handed off, D computes the prompt."""
        if not wants_decode_elsewhere(request) or getattr(request.status, "name", "") not in COMPLETED:
            return False, None
        hit = full_hit(self.side, request)
        tokens = hit.tokens if request.num_computed_tokens >= hit.tokens else 0
        if not complete or not self.side.stages.ready:
            tokens = 0
        unit = self.side.layout.unit
        cut = [(g, hexes[end // unit - 1]) for g, ends in enumerate(hit.loads) for end in ends]
        if tokens and not self._coming(request, hit, cut):
            tokens = 0
        params = {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: {"tokens": tokens}}
        if tokens == 0:
            return False, params  # nothing to hand off: D computes the prompt
        keys, _ = self.side.rank_keys(cut)
        now = time.monotonic()
        self.pending[request.request_id] = Delivery(
            request.request_id, hit.tokens, keys, now, now + self.timeout_s
        )
        self.side.count("handoffs_started")
        return True, params

    def _coming(self, request, hit, cut: list[tuple[int, str]]) -> bool:
        """Whether every object of the hit will be on the shared tier: there already, being saved now,
        saved within the last timeout_s (its write may still be queued), or written again now from P's
        DRAM. The last is for objects the shared tier lost (expired, evicted or flushed there, a failed
        write) while P holds them: P never saves those again, and waiting for them held P's blocks and D
        for the whole timeouts. False when one is in none of these places (the hand-off is not started)."""
        flying, cutoff = self.side.in_flight_keys, time.monotonic() - self.timeout_s
        ends = [(g, end) for g, group_ends in enumerate(hit.loads) for end in group_ends]
        keys = [self.side.key(g, request, end) for g, end in ends]
        ask = [
            (c, key, g, end)
            for c, key, (g, end) in zip(cut, keys, ends, strict=True)
            if key not in flying and self.recent.get(key, cutoff - 1) < cutoff
        ]
        held = self.side._held_by_every_rank([a[0] for a in ask]) if ask else []
        lost: dict[int, tuple[list[str], list[bytes]]] = {}
        for (_, key, g, end), ok in zip(ask, held, strict=True):
            if not ok:
                lost.setdefault(g, ([], []))[0].append(key)
                lost[g][1].append(self.side.prefix_hash(request, end))
        if all(self.side.publish(keys, g, hashes) for g, (keys, hashes) in lost.items()):
            self.saved([k for keys, _ in lost.values() for k in keys])  # one write again is enough
            return True
        self.side.count("handoffs_unavailable")
        logger.warning(
            "umbp: hand-off of request %s not started: objects of its prefix are neither on the shared tier "
            "nor in this instance's DRAM (lost there, and held here on SSD only or not at all); the "
            "decode instance computes the prompt",
            request.request_id,
        )
        return False

    def poll(self) -> None:
        """One pipelined EXISTS for every pending delivery's unseen keys; finish the complete ones and the
        ones past their deadline."""
        if not self.pending:
            return
        asks = [(d, k) for d in self.pending.values() for k in d.missing]
        try:
            seen = self.side.remote.exists([k for _, k in asks]) if asks else []
        except Exception:  # noqa: BLE001 - an unreachable tier is a timeout later, never a crash
            logger.warning("umbp: shared tier unreachable while confirming hand-offs", exc_info=True)
            seen = [False] * len(asks)
        unseen: dict[str, list[str]] = {d.req_id: [] for d in self.pending.values()}
        for (delivery, key), ok in zip(asks, seen, strict=True):
            if not ok:
                unseen[delivery.req_id].append(key)
        now = time.monotonic()
        for req_id, delivery in list(self.pending.items()):
            delivery.missing = unseen[req_id]
            if not delivery.missing:
                self.side.count("handoffs_delivered")
                self.side.count("handoff_delivery_us", int((now - delivery.started) * 1e6))
            elif now >= delivery.deadline:
                self.side.count("handoff_timeouts")
                logger.warning(
                    "umbp: hand-off of request %s not visible on the shared tier after %.1f s (%d of "
                    "its objects missing); releasing it, the decode instance recomputes what it "
                    "lacks",
                    req_id,
                    self.timeout_s,
                    len(delivery.missing),
                )
            else:
                continue
            del self.pending[req_id]
            self.done.append(req_id)

    def take_done(self) -> list[str]:
        done, self.done = self.done, []
        return done

    def busy(self) -> bool:
        return bool(self.pending or self.done)


@dataclass
class Consumer:
    side: Any  # umbp.vllm.scheduler.SchedulerSide
    wait_s: float
    waits: dict[str, Wait] = field(default_factory=dict)

    def hold(self, request, tracked, hit_tokens: int, local_tokens: int = 0) -> bool:
        """True: the hand-off is not complete yet, ask again later (vLLM skips the request this step).
        ``local_tokens``: the local prefix hit vLLM passed; a boundary it already reaches needs no wait."""
        wanted = handoff_tokens(request)
        req_id = request.request_id
        if not wanted:
            return False
        now = time.monotonic()
        wait = self.waits.get(req_id)
        if wait is None:
            wait = self.waits[req_id] = Wait(now + self.wait_s, now)
        if wait.decided:
            return False
        if max(hit_tokens, local_tokens) >= wanted:
            self._end(req_id, wait, "handoffs_received", now)
            return False
        if now >= wait.deadline:
            logger.warning(
                "umbp: hand-off of request %s incomplete after %.1f s (hit %d of %d tokens); the rest "
                "is recomputed",
                req_id,
                self.wait_s,
                hit_tokens,
                wanted,
            )
            self._end(req_id, wait, "handoff_misses", now)
            return False
        if now - wait.last_poll >= POLL_INTERVAL_S:
            wait.last_poll = now
            tracked.remote.clear()  # ask the shared tier again instead of reusing the last answers
        return True

    def _end(self, req_id: str, wait: Wait, outcome: str, now: float) -> None:
        self.side.count(outcome)
        self.side.count("handoff_wait_us", int((now - wait.started) * 1e6))
        wait.decided = True

    def forget(self, req_id: str) -> None:
        self.waits.pop(req_id, None)
