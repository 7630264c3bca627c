"""Randomized round trips through the transfer engine for every layout, on every backend available here.

Each run draws fresh random data (the random seed is printed in every assertion message), poisons the arena
before each save and the KV tensors before each load, and checks every byte: the slot bytes and digests
after a save, and after a load the loaded pages *and* every other byte of the backing buffers (other
blocks, the pad of padded state pages, the other groups' views). Backends: the staged path on CPU, the
kernel path under Triton's interpreter on CPU, and both on CUDA when a GPU is present (run on the H200:
see docs/transfer.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from umbp.pool import Arena
from umbp.pool.checksum import checksum_u8
from umbp.transfer import Moves, api, make_engine, triton_available
from umbp.transfer import model_layouts as L

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
SLOT = 4096


def _layouts(device: str) -> dict[str, L.Groups]:
    hyb, _ = L.hybrid(3, 12, 16, 2, 32, [3000, 4088], device=device)
    odd, _ = L.hybrid(2, 8, 16, 2, 32, [1001], device=device)
    out = {
        "attn-kv-first-bf16": {0: L.attention(2, 24, 16, 2, 64, device=device)},
        "attn-blocks-first-fp32": {
            0: L.attention(3, 20, 8, 2, 32, torch.float32, device=device, kv_first=False)
        },
        "kernel-split-fp16": {0: L.kernel_split(2, 10, 32, 2, 2, 16, device=device)},
        "hybrid-padded-states": hyb,
        "hybrid-unaligned-state": odd,
    }
    if device == "cuda":
        out["granite-4.0-h-350m"] = L.granite_hybrid(24, device=device)[0]
        out["attn-kv-first-64k-pages"] = {0: L.attention(4, 40, 64, 4, 64, device=device)}
    return out


DMA = {"save_path": "dma", "load_path": "dma"}
ZERO = {"save_path": "zero-copy", "load_path": "zero-copy"}
_interp = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 subprocess")
_cuda = pytest.mark.skipif(not CUDA or INTERPRET, reason="no CUDA")
ENGINES = [
    pytest.param("staged", "cpu", {}, id="staged-cpu"),
    pytest.param("kernel", "cpu", ZERO, id="kernel-interpret", marks=_interp),
    pytest.param("kernel", "cpu", DMA, id="kernel-dma-interpret", marks=_interp),
    # the copy-engine calls' split (lead copies one by one, the rest in one batch call) with host memmoves
    # standing in for cudaMemcpyAsync and cudaMemcpyBatchAsync
    pytest.param(
        "kernel",
        "cpu",
        dict(DMA, slots="scattered", copies="host"),
        id="kernel-dma-split-interpret",
        marks=_interp,
    ),
    # and a restore's early copies (early.py) ahead of validation, into a pooled staging ring as on CUDA
    pytest.param(
        "kernel",
        "cpu",
        dict(DMA, slots="scattered", copies="host-early"),
        id="kernel-dma-early-interpret",
        marks=_interp,
    ),
    # the same split issued by the C extension's one call per round (umbp.transfer._copies), calling
    # host memmoves through the addresses where CUDA has its runtime's copy functions
    pytest.param(
        "kernel",
        "cpu",
        dict(DMA, slots="scattered", copies="host-native"),
        id="kernel-dma-native-split-interpret",
        marks=_interp,
    ),
    # and the early copies through the C extension's check-and-copy call
    pytest.param(
        "kernel",
        "cpu",
        dict(DMA, slots="scattered", copies="host-native-early"),
        id="kernel-dma-native-early-interpret",
        marks=_interp,
    ),
    # a cold save's head (head.py): its first objects copied from their KV pages by the copy calls
    pytest.param(
        "kernel",
        "cpu",
        dict(DMA, slots="scattered", copies="host", head=True),
        id="kernel-dma-head-interpret",
        marks=_interp,
    ),
    # and the head's addresses worked out and its copies issued by the C extension's one call
    pytest.param(
        "kernel",
        "cpu",
        dict(DMA, slots="scattered", copies="host-native", head=True),
        id="kernel-dma-native-head-interpret",
        marks=_interp,
    ),
    pytest.param("staged", "cuda", {}, id="staged-cuda", marks=_cuda),
    pytest.param("kernel", "cuda", ZERO, id="kernel-cuda", marks=_cuda),
    pytest.param("kernel", "cuda", DMA, id="kernel-dma-cuda", marks=_cuda),
    # every slot apart: each object its own run, all of a round's runs in one batch copy (batchcopy.py)
    pytest.param("kernel", "cuda", dict(DMA, slots="scattered"), id="kernel-dma-scattered-cuda", marks=_cuda),
    # a head for every layout (its runs' size bar off), not only those with long KV runs
    pytest.param("kernel", "cuda", dict(DMA, head=True), id="kernel-dma-head-cuda", marks=_cuda),
]
LAYOUTS = [
    "attn-kv-first-bf16",
    "attn-blocks-first-fp32",
    "kernel-split-fp16",
    "hybrid-padded-states",
    "hybrid-unaligned-state",
    "granite-4.0-h-350m",
    "attn-kv-first-64k-pages",
]


def _storages(groups: L.Groups) -> list[torch.Tensor]:
    """Every backing buffer once, as a flat uint8 tensor."""
    seen: dict[int, torch.Tensor] = {}
    for layers in groups.values():
        for t, _ in layers:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen[st.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
    return list(seen.values())


def _page(t: torch.Tensor, d: int, b: int) -> torch.Tensor:
    """One layer's page of block b as bytes: the independent reference (select, not index_select)."""
    return t.select(d, b).contiguous().view(-1).view(torch.uint8)


def _object(layers: list[tuple[torch.Tensor, int]], b: int) -> np.ndarray:
    return torch.cat([_page(t, d, b) for t, d in layers]).cpu().numpy()


def _same_view(t: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """t's view, laid over another flat uint8 copy of its storage."""
    return torch.as_strided(flat.view(t.dtype), t.shape, t.stride(), t.storage_offset())


def _plan(
    groups: L.Groups, rng: np.random.Generator, arena_bytes: int, scattered: bool = False
) -> list[Moves]:
    """Random blocks (distinct across groups too: hybrid groups share the backing pages, and vLLM never
    gives one block to two groups) and random, scattered, non-overlapping arena slots (half the time in
    one run instead, unless `scattered`)."""
    sizes = {g: sum(_page(t, d, 0).numel() for t, d in layers) for g, layers in groups.items()}
    nslots = arena_bytes // SLOT
    free = list(rng.permutation(nslots))
    slot_bytes = None
    if (
        not scattered and rng.random() < 0.5
    ):  # slots in one run, as DramIndex.reserve_many hands them out (one DMA per run)
        span = max(-(-n // SLOT) for n in sizes.values())
        free = list(range(0, nslots - span, span))[::-1]
        slot_bytes = span * SLOT  # each slot's pad is its own: runs are copied whole, pads included
    nblocks = min(t.shape[d] for layers in groups.values() for t, d in layers)
    pool = list(rng.permutation(nblocks))
    batch = []
    for g in groups:
        n = int(rng.integers(1, max(2, 2 * len(pool) // len(groups))))
        ids, pool = pool[:n], pool[n:]
        if not ids:
            continue
        span = -(-sizes[g] // SLOT)
        offs = []
        for _ in range(n):
            while True:
                s = int(free.pop())
                if s + span <= nslots:
                    break
            offs.append(s * SLOT)
        batch.append(Moves(g, [int(i) for i in ids], offs, slot_bytes=slot_bytes))
    return _drop_overlaps(batch, sizes)


def _drop_overlaps(batch: list[Moves], sizes: dict[int, int]) -> list[Moves]:
    """Keep a slot only if it does not overlap an earlier one (objects can span several SLOTs)."""
    taken: list[tuple[int, int]] = []
    out = []
    for m in batch:
        ids, offs = [], []
        for b, o in zip(m.block_ids, m.offsets):
            if all(o + sizes[m.group] <= a or o >= e for a, e in taken):
                taken.append((o, o + sizes[m.group]))
                ids.append(b)
                offs.append(o)
        if ids:
            out.append(Moves(m.group, ids, offs, slot_bytes=m.slot_bytes))
    return out


def _arena(device: str, nbytes: int) -> Arena:
    return Arena(nbytes, pinned=device == "cuda", prefault=False)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend,device,options", ENGINES)
def test_round_trip(backend: str, device: str, options: dict, layout: str) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    why = f"seed={seed} layout={layout} backend={backend}/{device} {options}"
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    layouts = _layouts(device)
    if layout not in layouts:
        pytest.skip(f"{layout} is a GPU-sized layout")
    groups = layouts[layout]
    arena = _arena(device, 64 << 20 if device == "cuda" else 4 << 20)
    options = dict(options)
    scattered = options.pop("slots", None) == "scattered"
    copies = options.pop("copies", None)
    head = options.pop("head", False)
    opts = dict(options, max_staging_bytes=int(rng.choice([1 << 14, 64 << 20]))) if options else {}
    if scattered:
        opts["max_staging_bytes"] = 64 << 20  # whole batches per round: many runs per batch copy
    if backend == "kernel":  # launches between KV pages and staging run pieces in parts (some empty)
        opts["hbm_split"] = int(rng.choice([1, 3, 4, 8]))
    engine = make_engine(
        arena, groups, backend=backend, piece_bytes=int(rng.choice([1024, 4096, 64 << 10])), **opts
    )
    calls = (
        _host_copies(
            engine,
            early=copies in ("host-early", "host-native-early"),
            native=copies in ("host-native", "host-native-early"),
        )
        if copies
        else None
    )
    heads = _with_head(engine, rng) if head else None
    batch = _plan(groups, rng, arena.capacity_bytes, scattered)
    refs = {(m.group, b): _object(groups[m.group], b) for m in batch for b in m.block_ids}

    # save: poisoned arena, then every object byte, every digest, and nothing outside the slots (a slot's
    # pad, up to slot_bytes, may change)
    arena.view(0, arena.capacity_bytes)[:] = rng.integers(0, 256, arena.capacity_bytes, dtype=np.uint8)
    before = arena.view(0, arena.capacity_bytes).copy()
    digests = engine.save(batch).result()
    after = arena.view(0, arena.capacity_bytes)
    for m, ds in zip(batch, digests):
        for b, o, d in zip(m.block_ids, m.offsets, ds):
            ref = refs[(m.group, b)]
            assert np.array_equal(after[o : o + ref.size], ref), (
                f"slot bytes differ: {why} group={m.group} block={b}"
            )
            assert d == checksum_u8(ref), f"digest differs: {why} group={m.group} block={b}"
            before[o : o + ref.size] = ref
            reach = max(ref.size, m.slot_bytes or 0)
            before[o + ref.size : o + reach] = after[o + ref.size : o + reach]
    assert np.array_equal(after, before), f"bytes outside the slots changed: {why}"

    # loads: unverified, then verified with one corrupted slot
    for verified in (False, True):
        _load_and_check(engine, groups, batch, digests, refs, verified, rng, arena, why)
    # with more objects than lead copies, and where the layout takes the kernel path (not the staged one)
    if (
        calls is not None
        and sum(len(m.block_ids) for m in batch) > 4
        and all(engine.align[m.group] >= 8 for m in batch)
    ):
        assert calls["one"] and calls["batch"], f"both kinds of copy call were made: {calls} {why}"
    if (
        copies in ("host-early", "host-native-early")
        and len(batch[0].block_ids) > 1
        and engine.align[batch[0].group] >= 8
    ):
        assert calls["early"] == 2, f"both loads led with early copies: {calls} {why}"
    nobj = sum(len(m.block_ids) for m in batch)
    if heads is not None and nobj > 1 and all(engine.align[m.group] >= 8 for m in batch):
        assert heads and 0 < heads[0] < nobj, f"the save led with a head: {heads} {why}"


def _with_head(engine, rng, head_bytes: int | None = None) -> list[int]:
    """Give every group's objects a save head (head.py) of `head_bytes` (default: one to a few of the
    largest objects), whatever their KV runs' length; returns the head sizes of the saves that led with one."""
    engine.save_head_min_run = 0
    if head_bytes is None:
        head_bytes = int(rng.integers(1, 4)) * max(g.object_bytes for g in engine.groups.values())
    engine.save_head_bytes = head_bytes
    heads: list[int] = []
    real = engine._head

    def counted(batch, count, save, queued):
        heads.append(count)
        return real(batch, count, save, queued)

    engine._head = counted
    return heads


def _host_copies(engine, early: bool = False, native: bool = False) -> dict[str, int]:
    """Give a CPU kernel engine the CUDA runtime's two copy calls as host memmoves (same signatures),
    with a batch bar of two runs, so that its dma rounds take the lead-then-batch split; counts calls.
    `early`: every object size qualifies for a restore's early copies, and the staging ring is pooled
    as on CUDA (the first round shares the early copies' buffer); counts the loads that led with them.
    `native`: a round's copies go through the C extension's one call (batchcopy.native_runs), which
    calls the memmoves through their C addresses, as it calls the runtime's functions on CUDA."""
    import ctypes

    from umbp.transfer.ring import StagingRing

    calls = {"one": 0, "batch": 0, "early": 0}
    if early:
        engine.dma_min_run_bytes = 0
        engine.ring = StagingRing(engine.device, engine.ring.nbytes, pooled=True, extra=engine.ring.extra)
        real = engine._early

        def counted(batch):
            got = real(batch)
            calls["early"] += got is not None
            return got

        engine._early = counted

    def one(dst: int, src: int, nbytes: int, stream: int) -> None:
        calls["one"] += 1
        ctypes.memmove(dst, src, nbytes)

    def batch(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        calls["batch"] += 1
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)

    from umbp.transfer import batchcopy

    engine.batch_copy_min_runs = 2
    engine._runs_copy = _native_host_copies(calls) if native else batchcopy.python_runs(one, batch)
    # the early copies and a save's head: the C calls through the stand-ins' addresses, or the Python
    # twins through `one` and `batch`
    stand_in = getattr(engine._runs_copy, "stand_ins", None)
    if native:
        one_at = batchcopy._address(stand_in[0])
        engine._early_copy = batchcopy.native_early(one_at)
        engine._head_copy = batchcopy.native_head(one_at, (stand_in[1], False))
        engine._early_copy.stand_ins = engine._head_copy.stand_ins = stand_in  # type: ignore[attr-defined]
    else:
        engine._early_copy = batchcopy.python_early(one)
        engine._head_copy = batchcopy.python_head(one, batch)
    return calls


def _native_host_copies(calls: dict[str, int]):
    """batchcopy.native_runs over host-memmove stand-ins for cudaMemcpyAsync and cudaMemcpyBatchAsync
    (CUDA 13's signature), counting into `calls`; the stand-ins live as long as the returned copy."""
    import ctypes

    from umbp.transfer import batchcopy

    if batchcopy._copies is None:
        pytest.skip("umbp.transfer._copies not built")
    u64 = ctypes.POINTER(ctypes.c_uint64)
    vp, size_t = ctypes.c_void_p, ctypes.c_size_t

    def one(dst, src, nbytes, kind, stream):
        calls["one"] += 1
        ctypes.memmove(dst, src, nbytes)
        return 0

    def batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, stream):
        calls["batch"] += 1
        for d, s, n in zip(*(ctypes.cast(p, u64)[:count] for p in (dsts, srcs, sizes)), strict=True):
            ctypes.memmove(d, s, n)
        return 0

    one_c = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, size_t, ctypes.c_int, vp)(one)
    batch_c = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, size_t, vp, vp, size_t, vp)(batch)
    copy = batchcopy.native_runs(batchcopy._address(one_c), (batch_c, False))
    copy.stand_ins = (one_c, batch_c)  # type: ignore[attr-defined]
    return copy


@_interp
def test_early_copies_survive_rounds_bigger_than_the_ring_interpret() -> None:
    """Rounds over the ring's room (objects bigger than max_staging_bytes) get one-off buffers: a pooled
    buffer handed to such a round reached into the early area, and the second round, taking the early
    copies' buffer in turn, overwrote them before the first round's scatter read them (H200: loaded
    bytes differ on 256 KiB objects with 16 KiB of staging)."""
    groups = _layouts("cpu")["attn-kv-first-bf16"]
    arena = _arena("cpu", 4 << 20)
    engine = make_engine(arena, groups, backend="kernel", max_staging_bytes=1 << 12, **DMA)
    calls = _host_copies(engine, early=True)
    span = -(-engine.object_bytes(0) // SLOT) * SLOT
    ids, offs = list(range(8)), [k * span for k in range(8)]
    refs = {b: _object(groups[0], b) for b in ids}
    digests = engine.save([Moves(0, ids, offs)]).result()[0]
    for st in _storages(groups):
        st.random_(0, 256)
    assert engine.load([Moves(0, ids, offs, digests)]).result() == [[True] * 8]
    assert calls["early"] == 1
    for b in ids:
        assert np.array_equal(_object(groups[0], b), refs[b]), b


@_interp
@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_early_copies_never_skip_validation_interpret(native: bool) -> None:
    """A restore's early copies (early.py) go out before the batch is validated, so a bad batch must
    still raise exactly what it raises without them, write no KV byte, and lead with no copy at all when
    one of the early objects' own offsets is bad (the copy would read outside the arena). Both the C
    check-and-copy call and its Python twin."""
    groups = _layouts("cpu")["attn-kv-first-bf16"]
    arena = _arena("cpu", 4 << 20)
    engine = make_engine(arena, groups, backend="kernel", **DMA)
    plain = make_engine(arena, groups, backend="kernel", **DMA)
    plain.early_bytes = 0
    calls = _host_copies(engine, early=True, native=native)
    _host_copies(plain)
    span = -(-engine.object_bytes(0) // SLOT) * SLOT
    offs = [k * span for k in range(4)]
    digests = engine.save([Moves(0, [0, 1, 2, 3], offs)]).result()[0]
    assert engine.load([Moves(0, [0, 1, 2, 3], offs, digests)]).result() == [[True] * 4]
    assert calls["early"] == 1
    storages = _storages(groups)
    snap = [st.clone() for st in storages]
    bad = {  # the early objects' own offsets: no early copy
        "outside the arena": ([0, 1, 2], [arena.capacity_bytes - 8, span, 2 * span], False),
        "misaligned": ([0, 1, 2], [4, span, 2 * span], False),
        "not an integer": ([0, 1, 2], [0.5, span, 2 * span], False),
        "negative": ([0, 1, 2], [-span, span, 2 * span], False),
        "past 2**63": ([0, 1, 2], [1 << 64, span, 2 * span], False),
        "a numpy float": ([0, 1, 2], np.array([0.0, span, 2 * span]), False),
        # the rest of the batch: early copies, then the same error
        "a block id out of range": ([0, 1, 10**6], offs[:3], True),
        "a block loaded twice": ([0, 1, 0], offs[:3], True),
        "a later offset outside": ([0, 1, 2], [0, span, arena.capacity_bytes], True),
    }
    for why, (ids, where, led) in bad.items():
        before = dict(calls)
        errors = []
        for e in (plain, engine):
            with pytest.raises(Exception) as info:
                e.load([Moves(0, ids, where, [0] * len(ids))])
            errors.append((info.type, str(info.value)))
        assert errors[0] == errors[1], why
        assert calls["early"] - before["early"] == led, why
        if not led:
            assert calls["one"] == before["one"], why
        assert all(torch.equal(a, b) for a, b in zip(storages, snap, strict=True)), why


@_interp
def test_a_cold_save_head_copies_its_objects_from_the_kv_pages_interpret() -> None:
    """A cold dma save's first objects go from their KV pages to their slots by the copy calls (head.py),
    the rest in rounds; slots and digests are those of a save without a head, the head's rows in the
    plan write nothing, and a save queued behind another (its copy engine busy) has no head."""
    groups = _layouts("cpu")["hybrid-padded-states"]
    arena = _arena("cpu", 4 << 20)
    engine = make_engine(arena, groups, backend="kernel", max_staging_bytes=16 << 10, **DMA)
    plain = make_engine(arena, groups, backend="kernel", save_head_bytes=0, **DMA)
    calls = _host_copies(engine)
    _host_copies(plain)
    heads = _with_head(engine, None, head_bytes=2 * engine.object_bytes(0))
    span = -(-max(engine.object_bytes(g) for g in groups) // SLOT) * SLOT
    moves = [Moves(g, [3 * g + k for k in range(3)], [(3 * g + k) * span for k in range(3)]) for g in groups]
    digests = plain.save(moves).result()
    want = arena.view(0, arena.capacity_bytes).copy()
    arena.view(0, arena.capacity_bytes)[:] = 0xA5
    before = dict(calls)
    assert engine.save(moves).result() == digests
    assert heads == [2]
    assert calls["one"] > before["one"]
    _same_slots(engine, moves, arena, want)
    engine._idle = lambda direction: False  # a save queued behind another: no head
    arena.view(0, arena.capacity_bytes)[:] = 0xA5
    assert engine.save(moves).result() == digests
    assert heads == [2]
    _same_slots(engine, moves, arena, want)


def _same_slots(engine, moves: list[Moves], arena: Arena, want: np.ndarray) -> None:
    for m in moves:
        n = engine.object_bytes(m.group)
        for b, off in zip(m.block_ids, m.offsets):
            assert np.array_equal(arena.view(off, n), want[off : off + n]), (m.group, b)


def _engine_for(backend: str, device: str, options: dict, groups: L.Groups, arena: Arena, **extra):
    """An engine of one ENGINES entry (its slot placement option dropped: the caller places slots)."""
    options = dict(options)
    options.pop("slots", None)
    copies = options.pop("copies", None)
    head = options.pop("head", False)
    engine = make_engine(arena, groups, backend=backend, **(dict(options, **extra) if options else {}))
    if copies:
        _host_copies(engine, early=copies == "host-early")
    if head:
        _with_head(engine, np.random.default_rng(0))
    return engine


@pytest.mark.parametrize("backend,device,options", ENGINES)
def test_a_bad_batch_raises_before_writing_anything(
    backend: str, device: str, options: dict, monkeypatch
) -> None:
    """Batches that passed validation and then failed (or did worse) half-way, each now one ValueError
    with every byte of the KV cache and the arena as it was: an arena offset near 2**63 (offset + reach
    wrapped in the Python twin's int64 sum: the staged path wrote the first objects and then raised, the
    zero-copy kernel read past the arena: a segfault under the interpreter), a bad digest value in a
    later round (written rounds, then a TypeError; or read as a quiet miss), block b named in two groups
    that share memory (both objects verified and reported loaded; the page held neither)."""
    groups, _raws = L.hybrid(2, 8, 16, 2, 32, [3000], device=device)  # groups 0 and 1 share pages
    groups[5] = L.attention(1, 8, 16, 2, 32, device=device)
    arena = _arena(device, 1 << 20)
    engine = _engine_for(backend, device, options, groups, arena, max_staging_bytes=1)  # a round per object
    S, huge = 16384, (1 << 63) - 8
    saved = [Moves(0, [1, 2], [0, S]), Moves(1, [3], [2 * S]), Moves(5, [3], [3 * S])]
    d = engine.save(saved).result()
    bad = {
        "offset 2**63-8, numpy (the twin)": [Moves(0, np.array([1, 2]), np.array([0, huge]), d[0])],
        "offset 2**63-8 after a valid Moves": [
            Moves(5, [3], [3 * S], d[2]),
            Moves(0, np.array([2]), np.array([huge])),
        ],
        "offset 2**63-8, lists, no extension": [Moves(0, [1], [0], d[0][:1]), Moves(1, [3], [huge], d[1])],
        "a str digest last": [Moves(0, [1, 2], [0, S], d[0]), Moves(1, [3], [2 * S], ["x"])],
        "a digest of -1 last": [Moves(0, [1, 2], [0, S], d[0]), Moves(5, [3], [3 * S], [-1])],
        "a digest of 2**64 + d last": [
            Moves(0, [1, 2], [0, S], d[0]),
            Moves(5, [3], [3 * S], [d[2][0] + (1 << 64)]),
        ],
        "block 3 of two groups sharing memory": [
            Moves(5, [3], [3 * S], d[2]),
            Moves(0, [3], [0], d[0][:1]),
            Moves(1, [3], [2 * S], d[1]),
        ],
    }
    storages = _storages(groups)
    for st in storages:
        st.random_(0, 256)
    snap = [st.clone() for st in storages]
    whole = arena.view(0, arena.capacity_bytes)
    before = whole.copy()
    for why, batch in bad.items():
        with monkeypatch.context() as mp:
            if "no extension" in why:
                mp.setattr(api, "_checks", None)
            with pytest.raises(ValueError):
                engine.load(batch).result()
            if "offset" in why:  # the same slots saved: nothing of the arena may change
                with pytest.raises(ValueError):
                    engine.save(
                        [Moves(m.group, m.block_ids, m.offsets, None, m.slot_bytes) for m in batch]
                    ).result()
        engine.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(storages, snap, strict=True)), f"KV written: {why}"
        assert np.array_equal(whole, before), f"arena written: {why}"
    # and the engine still loads the good batch
    ok = engine.load([Moves(m.group, m.block_ids, m.offsets, ds) for m, ds in zip(saved, d)]).result()
    assert ok == [[True, True], [True], [True]]


@pytest.mark.parametrize("backend,device,options", ENGINES)
def test_empty_moves_beside_others(backend: str, device: str, options: dict) -> None:
    """A Moves of no objects before or after others (the staged save reshaped 0 pages as [0, -1] and
    raised, in one order after writing a slot): skipped, its result an empty list."""
    groups = {0: L.attention(1, 8, 4, 2, 8, device=device), 1: L.attention(1, 8, 4, 2, 16, device=device)}
    arena = _arena(device, 1 << 16)
    engine = _engine_for(backend, device, options, groups, arena)
    ref = _object(groups[0], 1)
    for batch in ([Moves(1, [], []), Moves(0, [1], [0])], [Moves(0, [1], [0]), Moves(1, [], [])]):
        arena.view(0, 8192)[:] = 0xEE
        got = engine.save(batch).result()
        assert [len(x) for x in got] == [len(m.block_ids) for m in batch]
        assert got[[len(m.block_ids) for m in batch].index(1)] == [checksum_u8(ref)]
        assert np.array_equal(arena.view(0, ref.size), ref)
        verified = [Moves(m.group, m.block_ids, m.offsets, ds) for m, ds in zip(batch, got)]
        assert engine.load(verified).result() == [[True] * len(m.block_ids) for m in batch]


def _load_and_check(engine, groups, batch, digests, refs, verified, rng, arena, why) -> None:
    storages = _storages(groups)
    for st in storages:
        st.random_(0, 256)  # poison every byte of the KV cache
    snap = [st.clone() for st in storages]
    bad = None
    moves = [
        Moves(m.group, m.block_ids, m.offsets, ds if verified else None, m.slot_bytes)
        for m, ds in zip(batch, digests)
    ]
    if verified:
        k = int(rng.integers(len(moves)))
        j = int(rng.integers(len(moves[k].block_ids)))
        bad = (k, j)
        o = moves[k].offsets[j] + int(rng.integers(refs[(moves[k].group, moves[k].block_ids[j])].size))
        whole = arena.view(0, arena.capacity_bytes)
        whole[o] ^= 1 << int(rng.integers(8))
    ok = engine.load(moves).result()
    for k, m in enumerate(moves):
        for j, b in enumerate(m.block_ids):
            expect_ok = bad != (k, j)
            assert ok[k][j] == expect_ok, (
                f"load status {ok[k][j]} for object {k}/{j}: {why} verified={verified}"
            )
            got = _object(groups[m.group], b)
            if expect_ok:
                assert np.array_equal(got, refs[(m.group, b)]), (
                    f"loaded bytes differ: {why} group={m.group} block={b}"
                )
            # put the poison back through the same views, so the whole buffer must equal the snapshot
            for t, d in groups[m.group]:
                flat = next(
                    s for s, live in zip(snap, storages) if live.data_ptr() == t.untyped_storage().data_ptr()
                )
                t.select(d, b).copy_(_same_view(t, flat).select(d, b))
    for live, s in zip(storages, snap):
        assert torch.equal(live, s), f"a load wrote bytes outside its pages (or a rejected object): {why}"


def _corrupt(slot: np.ndarray, kind: str) -> None:
    """One class of damage to an object's bytes in the arena (docs/pool.md says which psum64 detects
    with certainty): a flipped bit, two words swapped inside a row or across rows (each pair differing
    in its top bit only, a delta no additive checksum sees), two 4 KiB rows swapped, a row zeroed."""
    w = slot[: slot.size // 8 * 8].view("<u8")
    if kind == "bit":
        slot[slot.size // 3] ^= 0x10
    elif kind in ("swap-in-row", "swap-across-rows"):
        a, b = 5, (300 if kind == "swap-in-row" else 512 + 7)
        w[b] = w[a] ^ np.uint64(1 << 63)  # set the pair up first: a real save of these bytes follows
    elif kind == "rows":
        rows = slot[: 2 * 4096].reshape(2, 4096).copy()
        slot[:4096], slot[4096 : 2 * 4096] = rows[1], rows[0]
    elif kind == "zero-row":
        slot[4096 : 2 * 4096] = 0


CLASSES = ["bit", "swap-in-row", "swap-across-rows", "rows", "zero-row"]


@pytest.mark.parametrize("backend,device,options", ENGINES)
def test_verified_load_rejects_each_class_of_damage(backend: str, device: str, options: dict) -> None:
    """Save objects, damage one per class in the arena, load verified: exactly the damaged ones are
    refused and left unwritten. For the word swaps the object's words are first made a pair that differs
    only in bit 63, and saved again, so the swap itself is the only change after the digest is taken."""
    if options.get("slots"):
        pytest.skip("slot placement does not matter here")
    groups = {0: L.attention(2, 12, 16, 2, 64, device=device)}  # 16 KiB objects: four 4 KiB rows
    arena = _arena(device, 1 << 20)
    engine = _engine_for(backend, device, options, groups, arena)
    n = len(CLASSES) + 1
    offs = [i * 16384 for i in range(n)]
    for st in _storages(groups):
        st.random_(0, 256)
    whole = arena.view(0, arena.capacity_bytes)
    for i, kind in enumerate(CLASSES):  # word-swap set-up, done in the KV pages so the save sees it
        if kind.startswith("swap"):
            engine.save([Moves(0, [i], [offs[i]])]).result()
            _corrupt(whole[offs[i] : offs[i] + 16384], kind)
            engine.load([Moves(0, [i], [offs[i]])]).result()
    digests = engine.save([Moves(0, list(range(n)), offs)]).result()[0]
    refs = [_object(groups[0], b) for b in range(n)]
    for i, kind in enumerate(CLASSES):
        slot = whole[offs[i] : offs[i] + 16384]
        if kind.startswith("swap"):
            w = slot.view("<u8")
            a, b = 5, (300 if kind == "swap-in-row" else 512 + 7)
            w[[a, b]] = w[[b, a]]
        else:
            _corrupt(slot, kind)
        assert not np.array_equal(slot, refs[i]), kind
    for st in _storages(groups):
        st.zero_()
    ok = engine.load([Moves(0, list(range(n)), offs, digests)]).result()[0]
    assert ok == [False] * len(CLASSES) + [True], dict(zip([*CLASSES, "intact"], ok))
    for b in range(len(CLASSES)):
        assert not _object(groups[0], b).any(), f"a refused object was written: {CLASSES[b]}"
    assert np.array_equal(_object(groups[0], n - 1), refs[n - 1])


@pytest.mark.skipif(not CUDA or INTERPRET, reason="no CUDA")
@pytest.mark.parametrize("options", [ZERO, DMA], ids=["zero-copy", "dma"])
def test_many_transfers_in_flight(options: dict) -> None:
    """A caller far ahead of the device: the device is held back while 96 saves are queued, more plans
    in flight than the engine keeps spare buffers for. Every slot must still hold its block's bytes (a
    plan buffer dropped while still being read was handed out again: 'misaligned address' on the H200)."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    groups = {0: L.attention(2, 24, 16, 2, 64, device="cuda")}
    for t, _ in groups[0]:
        t.view(torch.uint8).random_(0, 256)
    stride = -(-_object(groups[0], 0).size // SLOT) * SLOT
    arena = _arena("cuda", 96 * stride)
    engine = make_engine(arena, groups, backend="kernel", **options)
    arena.view(0, arena.capacity_bytes)[:] = 0xEE
    torch.cuda._sleep(200_000_000)  # the engine's streams wait for the caller's stream (~0.1 s)
    calls = [(i % 24, i * stride) for i in range(96)]
    handles = [engine.save([Moves(0, [b], [o])]) for b, o in calls]
    digests = [h.result()[0][0] for h in handles]
    for (b, o), d in zip(calls, digests):
        want = _object(groups[0], b)
        assert np.array_equal(arena.view(o, want.size), want), f"seed {seed}: slot {o} of block {b}"
        assert d == checksum_u8(want), f"seed {seed}: digest of block {b}"


@pytest.mark.skipif(not CUDA or INTERPRET, reason="no CUDA")
@pytest.mark.parametrize("options", [ZERO, DMA], ids=["zero-copy", "dma"])
@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_a_load_writes_kv_pages_after_the_callers_queued_work(options: dict, verify: bool) -> None:
    """A load's copies into staging need not wait for the caller's stream (they read only the arena), but
    its writes into the KV pages must: work queued there before the call (here a sleep, then a fill of
    the very pages the load restores) runs first, and the pages end with the slots' bytes. Granite's
    400 KiB pages: on the dma path the restore finds its direction idle and leads with early copies."""
    groups = L.granite_hybrid(24, device="cuda")[0]
    for s in _storages(groups):
        s.random_(0, 256)
    g = min(groups)
    obj = _object(groups[g], 0).size
    arena = _arena("cuda", 12 * obj)
    engine = make_engine(arena, groups, backend="kernel", **options)
    blocks, offs = [1, 2, 3, 4, 5, 6], [i * obj for i in range(6)]
    want = [_object(groups[g], b) for b in blocks]
    digests = engine.save([Moves(g, blocks, offs)]).result()[0]
    engine.load([Moves(g, blocks, offs, digests if verify else None)]).result()  # warm: kernels loaded
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s on the caller's stream, then the pages overwritten
    for s in _storages(groups):
        s.fill_(0xA5)
    ok = engine.load([Moves(g, blocks, offs, digests if verify else None)]).result()[0]
    assert list(ok) == [True] * len(blocks)
    for b, w in zip(blocks, want):
        assert np.array_equal(_object(groups[g], b), w), f"block {b} holds the caller's later fill"


@pytest.mark.skipif(not CUDA or INTERPRET, reason="no CUDA")
@pytest.mark.parametrize("options", [ZERO, DMA], ids=["zero-copy", "dma"])
def test_each_save_follows_its_own_callers_stream(options: dict) -> None:
    """Saves called from two streams in turn: each reads the pages as work queued on its own caller's
    stream leaves them (a sleep, then a fill), so the engine finds the caller's stream on every call
    (it keeps the stream objects it has seen, by handle)."""
    groups = {0: L.attention(2, 24, 16, 2, 64, device="cuda")}
    obj = _object(groups[0], 0).size
    arena = _arena("cuda", 8 * obj)
    engine = make_engine(arena, groups, backend="kernel", **options)
    engine.save([Moves(0, [1], [0])]).result()  # warm: kernels loaded
    sides = (torch.cuda.Stream(), torch.cuda.Stream())
    for k in range(4):
        with torch.cuda.stream(sides[k % 2]):
            torch.cuda._sleep(50_000_000)
            for s in _storages(groups):
                s.fill_(k + 1)
            handle = engine.save([Moves(0, [1], [0])])
        handle.result()
        assert (arena.view(0, obj) == k + 1).all(), f"save {k} read the pages before its caller's fill"


@pytest.mark.skipif(not CUDA or INTERPRET, reason="no CUDA")
@pytest.mark.parametrize("direction", ["save", "load"])
def test_a_batch_failing_half_way_leaves_nothing_running(direction: str, monkeypatch) -> None:
    """A batch that raises after its first round was queued (out of memory for a buffer, say): the
    caller reports a failed load and vLLM frees the blocks, which the next forward writes, so the rounds
    already queued must be over when the exception arrives. The device is held back so that, without
    the drain, round 0 would still be pending at the raise."""
    from umbp.transfer.kernel_engine import KernelEngine

    groups = {0: L.attention(2, 256, 64, 2, 64, device="cuda")}  # 32 KiB pages, 64 KiB objects
    obj = _object(groups[0], 0).size
    arena = _arena("cuda", 256 * obj + (1 << 20))
    engine = make_engine(arena, groups, backend="kernel", max_staging_bytes=1 << 20, **DMA)
    batch = [Moves(0, list(range(256)), [i * obj for i in range(256)], None, obj)]
    engine.save(batch).wait()  # warm: kernels loaded (a module load synchronizes the device), rings made
    engine.load(batch).wait()
    real_staging, calls = KernelEngine._staging, []

    def failing_staging(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("simulated: no memory for round 1")
        return real_staging(self, *args, **kwargs)

    monkeypatch.setattr(KernelEngine, "_staging", failing_staging)
    torch.cuda._sleep(200_000_000)  # ~0.1 s on the caller's stream, which the engine's streams wait for
    with pytest.raises(torch.cuda.OutOfMemoryError):
        getattr(engine, direction)(batch)
    assert len(calls) == 2
    assert all(s.query() for s in (*engine.streams, *engine.aux)), "a failed batch left work on the device"


@pytest.mark.skipif(
    INTERPRET or not triton_available(), reason="Triton not installed (or already interpreting)"
)
def test_kernel_path_under_triton_interpreter() -> None:
    """The kernel path's tables, checksums and guards, on CPU: Triton's interpreter must be chosen before
    Triton is first imported, and pytest (or vLLM) may have imported it already, so run in a subprocess.
    (Triton 3.6's interpreter cannot run it: it rejects the int-to-pointer casts; 3.9's can.)"""
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run the kernel (needs >= 3.9)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "interpret"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
