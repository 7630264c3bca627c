"""How RedisTier reads: `exists` and `get_into` pipelined per server through a bounded window,
values verified (header, checksum, tag) as they arrive, reads under previous secrets, repair of
what failed to load. Every round of a call (redirects followed, previous secrets, the repair) goes
through the same bounded codec and ends by the call's one deadline."""

from __future__ import annotations

import logging
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from umbp.pool.buffers import prepare_buffers
from umbp.pool.checksum import (
    CHUNK_BYTES,
    ROW_BYTES,
    as_rows,
    checksum_u8,
    combine,
    combine_rows,
    row_sums_into,
)
from umbp.pool.keycheck import check_keys
from umbp.pool.remote.auth import PlainCodec, SealedCodec
from umbp.pool.remote.backend import Group
from umbp.pool.remote.calls import (
    _ABSENT,
    _ASKING,
    _HIT,
    _REDIS_PY_FAULTS,
    _UNANSWERED,
    _asked,
    _Job,
)
from umbp.pool.remote.resp import (
    ProtocolError,
    ReplyError,
    Wire,
    bulk,
    command,
    parse_length,
)

log = logging.getLogger("umbp.remote")

GET_WINDOW_BYTES = 4 << 20
_REMOVABLE = ("checksum_failures", "auth_failures", "unauthenticated_values")  # deleted after a failed load
_VALUE_SLACK = 4096  # a stored value may be this much longer than expected (a later format's header)
_HEAL = "if redis.call('EXISTS', KEYS[1]) == 0 then return redis.call('DEL', KEYS[2]) end return 0"
_DROP = "return redis.call('UNLINK', KEYS[1], KEYS[2])"  # a script: cluster pipelines refuse multi-key UNLINK


class _GetWindow:
    """Keeps about GET_WINDOW_BYTES of values in flight per connection. A deeper pipeline makes the
    server buffer every pending reply (tens of MiB for a batch of 4 MiB pages) and is measurably slower
    (0.5 vs 0.9 GB/s at 4 MiB); one GET at a time would pay a round trip per value. It refills only once
    less than half of the window is left (`due`), so a long batch of small values costs one send per
    half window rather than one per value, and the reader checks a single int per value."""

    def __init__(self, commands: list[bytes], sizes: list[int]) -> None:
        self.commands = commands
        self.ends = list(accumulate(sizes))  # ends[k]: bytes of replies 0..k
        self.sent = 0
        self.due = 0  # the next reply before which top_up must run (len(commands): never)

    def top_up(self, wire: Wire, done: int) -> None:
        """Called before reading reply `done`: send until the window is full (at least one command in
        flight), then set `due` to the reply at which less than half of it will be left."""
        ends, n, start = self.ends, len(self.commands), self.sent
        read = ends[done - 1] if done else 0
        sent = start
        while sent < n and (sent == done or ends[sent - 1] - read < GET_WINDOW_BYTES):
            sent += 1
        if sent > start:
            wire.send(self.commands[start:sent])
        self.sent = sent
        self.due = n if sent == n else bisect_right(ends, ends[sent - 1] - GET_WINDOW_BYTES // 2) + 1


class ReaderMixin:
    """Part of RedisTier (umbp.pool.remote.tier), split out by concern: it works on the tier's own
    state (`self`), so the methods read exactly as they would in one class."""

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Values stream straight into the caller's buffers; header, key and checksum are verified. Every
        miss is quarantined (see the module docstring)."""
        keys = list(keys)
        check_keys("get_into", keys)
        dsts = prepare_buffers("get_into", keys, buffers, writable=True)
        deadline = time.monotonic() + self.config.deadline_s(sum(d.size for d in dsts))
        res: list[Any] = [None] * len(keys)
        held = set(self._quarantine.held(keys)) if len(self._quarantine) else set()
        live = [i for i in range(len(keys)) if i not in held]
        for i in held:
            res[i] = "quarantine_skips"
        live = self._from_queue(keys, dsts, live, res)
        groups = self._groups([keys[i] for i in live]) if live else {}
        jobs = [self._get_job(node, gs, keys, dsts, live, res) for node, gs in (groups or {}).items()]
        self._run(jobs)
        if res.count(True) != len(res) and any(isinstance(r, ReplyError) for r in res):
            self._get_slow(keys, dsts, res, deadline)
        if self._old and "misses_absent" in res:
            self._get_old(keys, dsts, res, deadline)
        return self._finish_get(keys, dsts, res, deadline)

    def _from_queue(
        self, keys: list[str], dsts: list[np.ndarray], live: list[int], res: list[Any]
    ) -> list[int]:
        """Serve keys whose put_async copy is still queued (or being sent) from that copy, verified like a
        value read from the server; the rest of `live` is returned. Without this, an object demoted from
        DRAM is in neither place until the writer has sent it, and a lookup in between misses it."""
        held = set(self._writer.holding([keys[i] for i in live]))
        if not held:
            return live
        rest: list[int] = []
        for j, i in enumerate(live):
            header = self._writer.copy_out(keys[i], dsts[i]) if j in held else None
            # the server decides when there is no copy of this size (sent and given back since holding():
            # the server has it), or the copy does not verify (never a reason to delete the server's value)
            if (
                header is not None
                and _verified(self._codec, header, keys[i], dsts[i], checksum_u8(dsts[i])) is True
            ):
                res[i] = True
                self._count(write_queue_hits=1)
            else:
                rest.append(i)
        return rest

    def _get_job(
        self,
        node: str,
        groups: list[Group],
        keys: list[str],
        dsts: list[np.ndarray],
        live: Sequence[int],
        res: list[Any],
        codec: PlainCodec | SealedCodec | None = None,
        ask: bool = False,
    ) -> _Job:
        """GET of the groups' values on `node` into their buffers (`live` maps a group's indices to the
        batch's), verified with `codec` (a previous secret's during a rotation; default the tier's own);
        after ASKING each, when following an ASK."""
        codec = codec or self._codec
        order = [live[j] for g in groups for j in g.indices]
        get = (_ASKING if ask else b"") + b"*2\r\n$3\r\nGET\r\n"
        window = _GetWindow(
            [get + bulk(g.prefix + "d:" + keys[live[j]]) for g in groups for j in g.indices],
            [dsts[i].size for i in order],
        )

        sizes = {dsts[i].size for i in order}
        size = sizes.pop() if len(sizes) == 1 else 0

        def read(wire: Wire) -> None:
            if 0 < size <= CHUNK_BYTES and size % ROW_BYTES == 0 and not ask:
                self._read_same_size(
                    wire, window, [keys[i] for i in order], [dsts[i] for i in order], order, res, codec
                )
                return
            for r, i in enumerate(order):
                if r >= window.due:
                    window.top_up(wire, r)
                if ask:
                    _asked(wire)
                res[i] = self._read_value(wire, keys[i], dsts[i], codec)

        return _Job(
            node, lambda wire: window.top_up(wire, 0), read, len(order), sum(dsts[i].size for i in order)
        )

    def _read_same_size(
        self,
        wire: Wire,
        window: _GetWindow,
        keys: list[str],
        dsts: list[np.ndarray],
        order: list[int],
        res: list[Any],
        codec: PlainCodec | SealedCodec,
    ) -> None:
        """The common batch: values of one size in whole 4 KiB rows, each small enough to stay in cache
        (one model's pages). Up to each window refill, one Wire.framed_payloads call reads the replies
        (reply head and the header's fixed fields matched in the buffer, payload, row sums while it is in
        cache; in C when built); checksums are combined and compared for the whole batch at the end. What can be prepared per value is prepared first,
        while the server is still working on the first reply. Anything unexpected takes the
        reply-by-reply path (_read_other), which names the problem."""
        size, n = dsts[0].size, len(keys)
        lead = b"$%d\r\n" % (codec.header_size + size) + codec.lead(size)
        tails = [codec.tail(k) for k in keys]
        rows = np.zeros((n, size // ROW_BYTES), np.uint64)
        field = codec.field_size
        fields = bytearray(n * field)
        framed = np.zeros(n, bool)
        r = 0
        while r < n:
            if r >= window.due:
                window.top_up(wire, r)
            end = min(n, window.due)
            # a reply already seen not to be the framed value (a miss) skips the batched read, which
            # prepares the rest of the window's buffers each time it is called
            stop = (
                r
                if wire.differs_from(lead)
                else wire.framed_payloads(lead, field, tails, dsts, rows, fields, r, end)
            )
            framed[r:stop] = True
            if stop < end:  # not the expected frame: read it reply by reply
                res[order[stop]] = self._read_other(wire, keys[stop], dsts[stop], codec)
                stop += 1
            r = stop
        stored = np.frombuffer(fields, np.uint8).reshape(n, field)[:, :8].copy().view("<u8").ravel()
        good = combine_rows(rows, size) == stored
        fixed = lead[lead.index(b"\r\n") + 2 :]
        for r in np.flatnonzero(framed).tolist():
            if not good[r]:
                res[order[r]] = "checksum_failures"
            elif codec.sealed:  # the tag: a psum64 anyone can compute, a tag only the tenant's key can
                header = fixed + bytes(fields[r * field : (r + 1) * field]) + tails[r]
                res[order[r]] = codec.open(header, keys[r], dsts[r]) or True
            else:
                res[order[r]] = True

    def _read_value(self, wire: Wire, key: str, dst: np.ndarray, codec: PlainCodec | SealedCodec) -> Any:
        """One GET reply into dst: True, or the counter that explains the miss. The reply of a stored
        object of the expected size is matched whole; anything else goes through _read_other."""
        hsize = codec.header_size
        header = wire.value_head(b"$%d\r\n" % (hsize + dst.size), hsize)
        if header is None:
            return self._read_other(wire, key, dst, codec)
        return _take_payload(codec, wire, header, key, dst)

    def _read_other(self, wire: Wire, key: str, dst: np.ndarray, codec: PlainCodec | SealedCodec) -> Any:
        """A reply that is not the expected value: an error (a MOVED/ASK is returned, to be followed),
        nil, another length, or a header that differs from what value_head matched (then it is read
        again here, to name the problem)."""
        head = wire.line()
        if head[:1] == b"-":
            return self._reply_error(ReplyError(head[1:].decode(errors="replace"))) or "load_errors"
        if head[:1] != b"$":
            raise ProtocolError(f"umbp: GET replied {head[:40]!r}")
        # never more than the object plus a header can legitimately be: a larger claim is a broken or
        # hostile server, and the connection is dropped rather than read (or allocated) on trust
        hsize = codec.header_size
        n = parse_length(head[1:], hsize + dst.size + _VALUE_SLACK)
        if n < 0:
            return "misses_absent"
        if n != hsize + dst.size:
            wire.discard(n)
            wire.expect_crlf()
            return "size_mismatches"
        return _take_payload(codec, wire, wire.take(hsize), key, dst)

    def _get_slow(self, keys: list[str], dsts: list[np.ndarray], res: list[Any], deadline: float) -> None:
        """Keys that met MOVED/ASK: read again from the node the redirect names (`_follow`)."""
        idx = [i for i, r in enumerate(res) if isinstance(r, ReplyError)]
        prefixes = self._prefixes([keys[i] for i in idx])
        redirected = [(Group(p, [i]), res[i]) for i, p in zip(idx, prefixes, strict=True) if p is not None]
        everyone = range(len(keys))
        self._follow(
            redirected, lambda n, gs, ask: self._get_job(n, gs, keys, dsts, everyone, res, ask=ask), deadline
        )

    # ---- key rotation: reads under previous secrets -------------------------------------------------

    def _old_groups(self, keys: list[str], namespace: str) -> dict[str, list[Group]]:
        """The keys' groups with the current namespace in their prefix swapped for a previous one (a
        cluster's hash tags, hence slots and nodes, stay the same)."""
        cur, old = self.config.redis_prefix, f"{self.config.key_prefix}{namespace}:"
        groups = self._groups(keys) or {}
        return {n: [Group(old + g.prefix[len(cur) :], g.indices) for g in gs] for n, gs in groups.items()}

    def _exists_old(self, keys: list[str], res: np.ndarray, deadline: float) -> None:
        """Keys absent in the current namespace but stored under a previous secret (during a rotation)
        are present: their loads verify with that secret. One pipelined round per previous secret, like
        the lookup itself."""
        for namespace, _ in self._old:
            idx = np.flatnonzero(res == _ABSENT)
            if not idx.size:
                return
            sub = [keys[i] for i in idx.tolist()]
            found = np.full(len(sub), _UNANSWERED, np.int8)
            groups = self._old_groups(sub, namespace)
            self._run([self._exists_job(n, gs, sub, found, []) for n, gs in groups.items()], deadline)
            res[idx[found == _HIT]] = _HIT

    def _get_old(self, keys: list[str], dsts: list[np.ndarray], res: list[Any], deadline: float) -> None:
        """Loads that found nothing under the current secret, tried under each previous one (verified
        with that secret's keys): one pipelined round per secret, read like the load itself."""
        for namespace, codec in self._old:
            idx = [i for i, r in enumerate(res) if r == "misses_absent"]
            if not idx:
                return
            groups = self._old_groups([keys[i] for i in idx], namespace)
            self._run(
                [self._get_job(n, gs, keys, dsts, idx, res, codec) for n, gs in groups.items()], deadline
            )
            self._count(old_key_hits=sum(res[i] is True for i in idx))

    def _finish_get(
        self, keys: list[str], dsts: list[np.ndarray], res: list[Any], deadline: float
    ) -> list[bool]:
        if res.count(True) == len(res):  # every key a hit (the usual batch): one counter update
            self._count(hits=len(res), bytes_read=sum(d.size for d in dsts))
            return [True] * len(res)
        tally: dict[str, int] = {}
        out: list[bool] = []
        failed: list[str] = []
        for key, dst, r in zip(keys, dsts, res, strict=True):
            if r is True:
                out.append(True)
                tally["bytes_read"] = tally.get("bytes_read", 0) + dst.size
                continue
            out.append(False)
            reason = "load_errors" if r is None or isinstance(r, ReplyError) else r
            tally[reason] = tally.get(reason, 0) + 1
            if reason != "quarantine_skips":
                failed.append(key)
        hits = sum(out)
        tally["quarantined"] = self._quarantine.add(failed)
        self._count(hits=hits, misses=len(out) - hits, **tally)
        self._repair(keys, res, deadline)
        return out

    def _repair(self, keys: list[str], res: list[Any], deadline: float) -> None:
        """Best effort: delete values that failed their checksum, and markers whose value is gone (evicted
        or expired apart), so no other instance keeps trying them. One pipelined round trip for the batch
        (a command per key, each awaited, made a get of 1,024 absent 16 KiB keys take 132-146 ms on
        loopback against 8-15 ms for 1,024 hits; 16-20 ms with the pipeline), within what is left of the
        call's deadline (none left: no repair). A script answers a count; any other reply counts as
        nothing removed (a bulk or an array drops the connection unread, like any reply longer than its
        request can receive)."""
        # a value failing its tag is deleted like a damaged one: saves are SET NX, so a planted value left
        # in place would turn every later save of the key into a no-op and every load into a miss
        corrupt = [k for k, r in zip(keys, res, strict=True) if r in _REMOVABLE]
        absent = [k for k, r in zip(keys, res, strict=True) if r == "misses_absent"]
        if not (corrupt or absent) or time.monotonic() >= deadline:
            return
        affected = corrupt + absent
        try:
            groups = self._backend.groups(affected)
        except _REDIS_PY_FAULTS as exc:  # best effort: never fails a get
            self._last_error = f"repair: {type(exc).__name__}: {exc}"[:200]
            return
        done = [False] * len(affected)

        def job(node: str, gs: list[Group]) -> _Job:
            idx = [j for g in gs for j in g.indices]
            names = [
                (g.prefix + "d:" + affected[j], g.prefix + "m:" + affected[j]) for g in gs for j in g.indices
            ]
            evals = [command("EVAL", _DROP if j < len(corrupt) else _HEAL, 2, *n) for j, n in zip(idx, names)]

            def read(wire: Wire) -> None:
                for j in idx:
                    r = wire.reply(max_bulk=0, max_items=0, depth=1)
                    done[j] = type(r) is int and r > 0

            return _Job(node, lambda wire: wire.send(evals), read, 0)

        self._run([job(node, gs) for node, gs in groups.items()], deadline)
        self._count(
            corrupt_removed=sum(done[: len(corrupt)]), stale_markers_removed=sum(done[len(corrupt) :])
        )


def _take_payload(
    codec: PlainCodec | SealedCodec, wire: Wire, header: bytes, key: str, dst: np.ndarray
) -> Any:
    """The rest of a value whose length matched: payload into dst (checksummed on the way), the closing
    CRLF; True, or the counter naming what the header, checksum or tag says is wrong."""
    problem, stored = codec.inspect(header, key, dst.size)
    tag = codec.stream(header, key) if problem is None else None
    digest = _recv_with_checksum(wire, dst, None if tag is None else tag.update)
    wire.expect_crlf()
    if problem is None and digest != stored:
        problem = "checksum_failures"
    if problem is None:
        problem = codec.open(header, key, dst) if tag is None else tag.verdict()
    return problem or True


def _verified(codec: PlainCodec | SealedCodec, header: bytes, key: str, dst: np.ndarray, digest: int) -> Any:
    """True when header, psum64 and (sealed) tag fit; else the counter that names the miss."""
    problem, stored = codec.inspect(header, key, dst.size)
    if problem is None and digest != stored:
        problem = "checksum_failures"
    if problem is None:
        problem = codec.open(header, key, dst)
    return problem or True


def _recv_with_checksum(
    wire: Wire, dst: np.ndarray, on_chunk: Callable[[memoryview], Any] | None = None
) -> int:
    """Receive into dst chunk by chunk and take each chunk's psum64 row values while it is still in cache (the
    same fused pass as umbp.pool.checksum.copy_with_checksum, with the socket as the source); equals checksum_u8(dst).
    `on_chunk` (a sealed value's tag) gets each chunk too, while it is in cache."""
    nbytes = dst.size
    if nbytes <= CHUNK_BYTES:
        wire.read_into(memoryview(dst))
        if on_chunk is not None:
            on_chunk(memoryview(dst))
        return checksum_u8(dst)
    full = nbytes // ROW_BYTES * ROW_BYTES
    rows = np.empty(full // ROW_BYTES, np.uint64)
    words = as_rows(dst[:full])
    for c0 in range(0, nbytes, CHUNK_BYTES):
        c1 = min(c0 + CHUNK_BYTES, nbytes)
        wire.read_into(memoryview(dst[c0:c1]))
        if on_chunk is not None:
            on_chunk(memoryview(dst[c0:c1]))
        r0, r1 = c0 // ROW_BYTES, min(c1, full) // ROW_BYTES
        if r1 > r0:
            row_sums_into(words[r0:r1], rows[r0:r1])
    return combine(rows, dst, full)
