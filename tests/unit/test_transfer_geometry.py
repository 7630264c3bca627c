"""Page geometry (segments, piece templates, alignment) and the engine's batch validation, on CPU."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from umbp.pool import Arena
from umbp.transfer import Moves, layer_geometry, make_engine, triton_available
from umbp.transfer import model_layouts as L
from umbp.transfer.geometry import GroupGeometry


def _reference(layers: list[tuple[torch.Tensor, int]], b: int) -> bytes:
    return b"".join(
        t.select(d, b).contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t, d in layers
    )


def _from_template(geom: GroupGeometry, b: int) -> bytes:
    """Read one object straight from memory at the template's addresses (what the kernel does)."""
    t = geom.template
    out = bytearray(geom.object_bytes)
    for src, stride, obj, n in zip(t.src, t.stride, t.obj, t.nbytes):
        out[obj : obj + n] = ctypes.string_at(int(src + b * stride), int(n))
    return bytes(out)


CASES = {
    "kv-first": (lambda: L.attention(2, 6, 16, 2, 8), 2, 16),
    "blocks-first": (lambda: L.attention(2, 6, 16, 2, 8, kv_first=False), 1, 16),
    "kernel-split": (lambda: L.kernel_split(1, 5, 8, 2, 2, 4), 2, 16),
    "padded-state": (lambda: L.hybrid(2, 5, 4, 2, 8, [200])[0][1], 1, 8),
    "odd-state": (lambda: L.hybrid(1, 5, 4, 2, 8, [201])[0][1], 1, 1),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("piece", [16, 40, 4096])
def test_template_addresses_read_the_reference_object(name: str, piece: int) -> None:
    make, nseg, align = CASES[name]
    layers = make()
    geom = GroupGeometry(layers, piece_bytes=piece)
    assert [layer.seg_offsets.size for layer in geom.layers] == [nseg] * len(layers)
    assert geom.alignment() == (min(align, 8) if piece == 40 else align)
    assert int(geom.template.nbytes.max()) <= piece
    for b in range(geom.num_blocks):
        assert _from_template(geom, b) == _reference(layers, b)


def test_padded_state_page_excludes_the_pad() -> None:
    groups, raws = L.hybrid(1, 4, 4, 2, 8, [200])
    geom = layer_geometry(*groups[1][0])
    assert geom.page_bytes == 200 and geom.block_stride == raws[0].shape[1] == 2 * 4 * 2 * 8 * 2


def test_granite_sizes_match_vllm_rule() -> None:
    s = L.granite_sizes()
    assert s["state_bytes"] == (1792 * 3 + 48 * 32 * 128) * 2 == 403968
    assert s["block_size"] == 400 and s["page_bytes"] == 409600
    assert (s["attention_layers"], s["mamba_layers"]) == (4, 28)


def test_rejects_overlapping_views() -> None:
    t = torch.zeros(4, 1, 8).expand(4, 3, 8)
    with pytest.raises(ValueError, match="stride"):
        layer_geometry(t, 0)


ALIASED = {  # views of 64 int64 words in which two blocks' pages share memory
    "block stride 0": lambda w: w[:16].view(1, 16).expand(4, 16),
    "pages overlapping by half": lambda w: torch.as_strided(w, (6, 16), (8, 1)),
    "a page's second row in the next block": lambda w: torch.as_strided(w, (4, 2, 8), (8, 8, 1)),
}


@pytest.mark.parametrize("name", list(ALIASED))
def test_rejects_blocks_whose_pages_share_memory(name: str) -> None:
    """A load would write one page from two objects and report both verified: refused at registration."""
    t = ALIASED[name](torch.zeros(64, dtype=torch.int64))
    with pytest.raises(ValueError, match="share memory"):
        layer_geometry(t, 0)
    with pytest.raises(ValueError, match="share memory"):
        make_engine(Arena(1 << 16, pinned=False), {0: [(t, 0)]})


def test_accepts_pages_split_far_apart() -> None:
    """FlashAttention's [2, blocks, ...]: a block's K and V halves lie further apart than the block
    stride, yet no two blocks share a byte (a stride-versus-extent test would refuse it)."""
    t, d = L.attention(1, 6, 16, 2, 8)[0]
    layer = layer_geometry(t, d)
    assert layer.block_stride < int(layer.seg_offsets.max()) + layer.seg_bytes
    assert layer.span() == (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


def test_rejects_zero_byte_pages() -> None:
    with pytest.raises(ValueError, match="zero bytes"):
        layer_geometry(torch.empty(4, 0), 0)


@pytest.fixture
def engine():
    groups = {0: L.attention(2, 8, 4, 2, 8), 1: L.hybrid(1, 8, 4, 2, 8, [200])[0][1]}
    return make_engine(Arena(1 << 16, pinned=False), groups)


def test_auto_picks_staged_on_cpu(engine) -> None:
    assert engine.backend == "staged" and engine.object_bytes(0) == 2 * 2 * 4 * 2 * 8 * 2


@pytest.mark.parametrize(
    "moves,match",
    [
        (Moves(5, [0], [0]), "not registered"),
        (Moves(0, [8], [0]), "block id"),
        (Moves(0, [-1], [0]), "block id"),
        (Moves(0, [0], [1 << 16]), "arena offset"),
        (Moves(0, [0], [4]), "arena offset"),
        (Moves(0, [0, 1], [0]), "one entry per object"),
        (Moves(0, [0], [0], [1, 2]), "one entry per object"),
    ],
)
def test_bad_batches_are_rejected_before_any_copy(engine, moves, match) -> None:
    with pytest.raises((ValueError, KeyError), match=match):
        engine.save([moves])


def test_overlapping_save_slots_and_double_loads_are_rejected(engine) -> None:
    with pytest.raises(ValueError, match="overlapping"):
        engine.save([Moves(0, [0, 1], [0, 256])])
    with pytest.raises(ValueError, match="twice"):
        engine.load([Moves(0, [3, 3], [0, 4096])])
    assert engine.save([Moves(0, [], [])]).result() == [[]]


def test_digests_are_unsigned_psum64(engine) -> None:
    from umbp.pool.checksum import checksum_u8

    geom = engine.groups[1]
    d = engine.save([Moves(1, [2], [4096])]).result()[0][0]
    ref = np.frombuffer(_reference(list(zip(geom.tensors, geom.block_dims)), 2), np.uint8)
    assert 0 <= d < 1 << 64 and d == checksum_u8(ref)


def test_auto_path_takes_the_copy_engines_only_for_long_runs_of_adjacent_slots():
    from types import SimpleNamespace

    import numpy as np

    from umbp.transfer import Moves
    from umbp.transfer.kernel_engine import KernelEngine
    from umbp.transfer.plans import plan_runs as _plan_runs
    from umbp.transfer.plans import sorted_runs as _sorted_runs

    geom = SimpleNamespace(object_bytes=60 << 10)

    def batch(offsets, slot_bytes=None):
        offs = np.asarray(offsets, np.int64)
        return [(geom, Moves(0, [], [], None, slot_bytes), np.arange(offs.size), offs)]

    def runs(b):
        return _plan_runs(_sorted_runs(b))[1][0].size

    exact = batch(np.arange(64) * (60 << 10))  # 64 objects end to start: one run
    padded = batch(np.arange(64) * (64 << 10), slot_bytes=64 << 10)  # 64 KiB slots, 60 KiB objects
    gaps = batch(np.arange(64) * (64 << 10))  # the same, but the pads are not the slots' to write
    assert runs(exact) == 1 and runs(padded) == 1 and runs(gaps) == 64
    assert runs(batch(list(reversed(range(0, 64 * (60 << 10), 60 << 10))))) == 1  # order does not matter
    pos, spans, total = _plan_runs(_sorted_runs(padded))
    assert list(pos) == list(np.arange(64) * (64 << 10))
    assert [list(a) for a in spans] == [[0], [0], [63 * (64 << 10) + (60 << 10)]]
    assert total % 16 == 0 and total >= spans[2][0]

    def flat(b):  # what TransferEngine.flat gives for these batches (the stand-in geometry has no template)
        (_g, m, _i, offs), n = b[0], b[0][3].size
        reach = m.slot_bytes or geom.object_bytes
        size, reach = np.full(n, geom.object_bytes), np.full(n, reach)
        shape = SimpleNamespace(
            nobj=n, size=size, reach=reach, uniform_reach=None, total_size=int(size.sum())
        )
        return shape, None, offs

    engine = SimpleNamespace(
        _last_order=None, _last_layouts=None, _ring_bytes=1 << 30, dma_min_batch_bytes=1 << 20, flat=flat
    )
    engine._run_count = lambda b: KernelEngine._run_count(engine, b)
    engine._lay_out = lambda b, budgets: KernelEngine._lay_out(engine, b, budgets)

    def path(b, choice, bar):
        return KernelEngine._path(engine, b, choice, bar)

    assert path(padded, "auto", 1 << 20) == "dma"
    assert path(gaps, "auto", 1 << 20) == "zero-copy"
    assert path(padded, "auto", 8 << 20) == "zero-copy"  # a run shorter than the bar
    assert path(gaps, "dma", 1 << 20) == "dma"  # an explicit choice stands
    engine.dma_min_batch_bytes = 4 << 20  # padded: 3.75 MiB in one run, but under the batch floor
    assert path(padded, "auto", 1 << 20) == "zero-copy"
    assert path(padded, "dma", 1 << 20) == "dma"
    # every object alone reaches the bar: the copy engines whatever the runs, decided without counting them
    engine.dma_min_batch_bytes = 1 << 20
    engine._run_count = lambda b: (_ for _ in ()).throw(AssertionError("runs counted"))
    assert path(gaps, "auto", 60 << 10) == "dma"


def test_rounds_are_even_fit_the_ring_and_keep_every_object_in_order():
    """A batch of exactly two staging buffers' worth is two rounds (a sliver of a third made the next
    batch's first round wait at every batch boundary on the H200); uneven batches are cut evenly."""
    from types import SimpleNamespace

    import numpy as np

    from umbp.transfer import Moves
    from umbp.transfer.kernel_engine import LOAD, SAVE, KernelEngine
    from umbp.transfer.plans import round_bounds, slice_batch

    obj, cap = 64 << 10, 128 << 20

    def rounds(counts, ring_bytes, digests=False, cold=False, direction=LOAD, min_round=8 << 20, tail=0):
        batch, first = [], 0
        for g, n in enumerate(counts):
            ids = np.arange(first, first + n)
            d = [int(i) for i in ids] if digests else None
            batch.append((SimpleNamespace(object_bytes=obj), Moves(g, ids, ids * obj, d), ids, ids * obj))
            first += n
        shape = SimpleNamespace(nobj=first, total_reach=first * obj, max_reach=obj)
        engine = SimpleNamespace(
            _ring_bytes=ring_bytes,
            min_round_bytes=min_round,
            tail_round_bytes=tail,
            flat=lambda b: (shape, None, None),
        )
        budgets = KernelEngine._budgets(engine, batch, direction, cold)
        bounds = round_bounds(np.full(first, obj + 16), list(budgets), ring_bytes) if budgets else [0, first]
        return [slice_batch(batch, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def check(cut, counts, ring):
        assert all(sum(p[2].size for p in r) * (obj + 16) <= ring for r in cut)
        flat = np.concatenate([p[2] for r in cut for p in r])
        assert list(flat) == list(range(sum(counts)))  # every object once, in order
        assert all(p[1].digests is None or list(p[1].digests) == list(p[2]) for r in cut for p in r)

    ring = cap + cap // 128
    two = rounds([2 * cap // obj], ring)
    assert [sum(p[2].size for p in r) for r in two] == [2049, 2047]
    for counts in ([2 * cap // obj], [700, 1, 3000, 2], [5], [4096 * 3 + 1]):
        cut = rounds(counts, ring, digests=True)
        sizes = [sum(p[2].size for p in r) for r in cut]
        assert len(cut) == -(-sum(counts) * (obj + 16) // ring)  # as few rounds as fit
        assert max(sizes) - min(sizes) <= 2 * (ring // (obj + 16)) // len(cut) + 2 or len(cut) == 1
        check(cut, counts, ring)
    huge = rounds([3], ring_bytes=obj // 2)  # objects over the budget: one round each
    assert [sum(p[2].size for p in r) for r in huge] == [1, 1, 1]
    # an idle direction: a load tapers (halving rounds, the last ones >= min_round: a short tail), a save
    # ramps (doubling from min_round: an early first copy); a batch under min_round stays whole
    per = lambda mib: (mib << 20) // (obj + 16)  # noqa: E731 - objects in so many MiB of staging
    for counts in ([2 * cap // obj], [700, 1, 3000, 2], [4096 * 3 + 1], [720]):
        total = sum(counts) * (obj + 16)
        load = rounds(counts, ring, digests=True, cold=True)
        sizes = [sum(p[2].size for p in r) for r in load]
        check(load, counts, ring)
        assert per(8) - 1 <= sizes[-1] <= per(16) + len(sizes), sizes
        # never growing, but for the objects whole-object cuts leave over (at most one per round)
        assert all(a >= b - len(sizes) for a, b in zip(sizes, sizes[1:])), sizes
        assert len(load) <= 2 + max(0, total - 8 * cap) // ring + (total // (8 << 20)).bit_length()
        save = rounds(counts, ring, digests=True, cold=True, direction=SAVE)
        sizes = [sum(p[2].size for p in r) for r in save]
        check(save, counts, ring)
        assert sizes[0] <= per(8) and (len(sizes) == 1 or sizes[1] <= per(16)), sizes
    # a tail round: the restore ends on a round of ~tail bytes, the rounds before it unchanged but the
    # one it is cut from; not for saves, nor for batches whose last round is under twice the tail
    for counts in ([2 * cap // obj], [700, 1, 3000, 2], [720]):
        plain = [sum(p[2].size for p in r) for r in rounds(counts, ring, cold=True)]
        cut = rounds(counts, ring, digests=True, cold=True, tail=2 << 20)
        check(cut, counts, ring)
        sizes = [sum(p[2].size for p in r) for r in cut]
        assert sizes[:-2] == plain[:-1] and sizes[-2] + sizes[-1] == plain[-1], (plain, sizes)
        assert per(2) - 2 <= sizes[-1] <= per(2) + len(sizes), sizes  # + objects cuts left over
        save = rounds(counts, ring, cold=True, direction=SAVE, tail=2 << 20)
        assert [sum(p[2].size for p in r) for r in save] == [
            sum(p[2].size for p in r) for r in rounds(counts, ring, cold=True, direction=SAVE)
        ]
    assert [sum(p[2].size for p in r) for r in rounds([5], ring, cold=True, tail=2 << 20)] == [5]
    assert [sum(p[2].size for p in r) for r in rounds([5], ring, cold=True)] == [5]
    assert [sum(p[2].size for p in r) for r in rounds([5], ring, cold=True, direction=SAVE)] == [5]


def test_round_budgets_cover_the_batch_and_fit_the_ring():
    from umbp.transfer.plans import round_budgets

    ring, mib = 128 << 20, 1 << 20
    for total in (1, 5 * mib, 8 * mib, 9 * mib, 45 * mib + 7, 146 * mib, 548 * mib, 3 * ring):
        for shape in ("even", "taper", "ramp"):
            for tail in (0, 4 * mib):
                b = round_budgets(total, ring, shape, 8 * mib, tail)
                assert total <= sum(b) < total + len(b) and all(0 < x <= ring for x in b), (total, shape, b)
    assert round_budgets(45 * mib, ring, "taper", 8 * mib) == [22.5 * mib, 11.25 * mib, 11.25 * mib]
    assert round_budgets(45 * mib, ring, "taper", 8 * mib, 4 * mib) == [
        22.5 * mib,
        11.25 * mib,
        7.25 * mib,
        4 * mib,
    ]
    assert round_budgets(45 * mib, ring, "taper", 8 * mib, 6 * mib) == [22.5 * mib, 11.25 * mib, 11.25 * mib]
    assert round_budgets(45 * mib, ring, "ramp", 8 * mib, 4 * mib) == [8 * mib, 16 * mib, 21 * mib]
    assert round_budgets(45 * mib, ring, "ramp", 8 * mib) == [8 * mib, 16 * mib, 21 * mib]
    assert round_budgets(300 * mib, ring, "even", 8 * mib) == [100 * mib] * 3


def test_table_pool_hands_a_buffer_out_once():
    """A buffer given back twice must not be idle twice: two plans in flight would share its memory
    (a scratch script that did this faulted on the H200 with a misaligned address)."""
    import torch

    from umbp.transfer.plans import TablePool as _TablePool

    pool = _TablePool()
    buf = torch.empty(1 << 17, dtype=torch.int64)
    pool.give(buf[:100], None)
    pool.give(buf[:100], None)
    first = pool.take(100)
    assert first.data_ptr() == buf.data_ptr()
    assert not pool._idle  # the second take would allocate a new buffer, not hand this one out again


def test_table_pool_never_drops_a_buffer_the_device_still_reads():
    """More plans in flight than the pool keeps (a caller far ahead of the device: the bench's sustained
    both-ways row) must not drop a buffer whose fetch has not run: its memory would go back to the pinned
    allocator and be handed out under the running kernel (H200: 'misaligned address' from the copy
    kernel). Buffers the device is done with are pruned to KEEP."""
    import torch

    from umbp.transfer.plans import TablePool as _TablePool

    class Event:
        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

    pool = _TablePool()
    bufs = [torch.empty(8, dtype=torch.int64) for _ in range(pool.KEEP + 8)]
    events = [Event() for _ in bufs]
    for b, e in zip(bufs, events):
        pool.give(b, e)
    assert [id(b) for b, _e in pool._idle] == [id(b) for b in bufs]  # all still referenced
    for e in events:
        e.done = True
    pool.give(torch.empty(8, dtype=torch.int64), None)
    assert len(pool._idle) == pool.KEEP


@pytest.mark.parametrize("mixed", [False, True], ids=["one-reach", "mixed-reaches"])
def test_disjoint_check_agrees_with_a_pairwise_reference(mixed: bool) -> None:
    """check_disjoint (a sort when every slot spans the same bytes, an argsort otherwise) against every
    pair of slots, on random batches that overlap about half the time (touching slots do not overlap)."""
    import numpy as np

    from umbp.transfer.api import check_disjoint

    rng = np.random.default_rng(7)
    raised = 0
    for _ in range(400):
        parts = int(rng.integers(1, 4))
        reaches = [int(rng.choice([8, 24])) if mixed else 16 for _ in range(parts)]
        starts = [rng.integers(0, 40, int(rng.integers(0, 5))).astype(np.int64) * 8 for _ in range(parts)]
        spans = [(int(a), int(a) + r) for st, r in zip(starts, reaches) for a in st]
        overlap = any(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(spans) for b0, b1 in spans[i + 1 :])
        try:
            check_disjoint(starts, reaches)
            assert not overlap, (starts, reaches)
        except ValueError:
            assert overlap, (starts, reaches)
            raised += 1
    assert 100 < raised < 300  # both outcomes were exercised


def test_a_plan_carries_the_expected_digests_less_their_length_term():
    """Verified loads compare checksums inside the launch that writes the pages, against the digests the
    plan carries: (digest xor its object's length term, skip flag) per object; a Moves without digests
    is not checked (skip 1). Mixed batches included."""
    from types import SimpleNamespace

    from umbp.transfer.api import digest_mix
    from umbp.transfer.plans import build_plan
    from umbp.transfer.shapes import make_shape

    def geom(nbytes, pieces):
        return SimpleNamespace(
            object_bytes=nbytes, num_blocks=64, template=SimpleNamespace(obj=np.zeros(pieces))
        )

    a, b = geom(4096, 2), geom(1000, 1)
    batch = [
        (a, Moves(0, [1, 2], [0, 4096], [5, (1 << 64) - 1]), np.array([1, 2]), np.array([0, 4096])),
        (b, Moves(1, [7], [8192]), np.array([7]), np.array([8192])),
        (b, Moves(2, [3], [16384], [9]), np.array([3]), np.array([16384])),
    ]
    rows = [np.array([10, 11, 12, 13])]
    groups, toff = {0: a, 1: b, 2: b}, {0: 0, 1: 2, 2: 2}
    shape = make_shape(((0, 2, 4096), (1, 1, 1000), (2, 1, 1000)), groups, toff)
    ids = np.array([1, 2, 7, 3])
    plan = build_plan(shape, batch, ids, rows, True, lambda n: torch.zeros(n, dtype=torch.int64))
    w = plan.host.numpy().view(np.uint64)
    mix = {n: digest_mix(n) & ((1 << 64) - 1) for n in (4096, 1000)}
    pairs = w[plan.want_at() : plan.want_at() + 8].reshape(4, 2).tolist()
    assert pairs == [[5 ^ mix[4096], 0], [((1 << 64) - 1) ^ mix[4096], 0], [0, 1], [9 ^ mix[1000], 0]]
    assert list(w[plan.at(0) : plan.at(0) + 4]) == [10, 11, 12, 13]
    assert list(w[plan.ids_at : plan.ids_at + 4]) == [1, 2, 7, 3]
    assert plan.n == 2 * 2 + 1 + 1 and not w[plan.sums_at() : plan.sums_at() + 4].any()
    assert plan.words == plan.sums_at() + 4 == plan.host.numel()
    seg = plan.host.numpy()[: 4 * 3].reshape(4, 3).tolist()
    assert seg == [[0, 4, 5], [0, 2, 3], [2, 1, 1], [0, 2, 2]]  # first piece, first object, pieces, column
    one = make_shape(((1, 1, 1000),), groups, {1: 0})
    unverified = build_plan(
        one, batch[1:2], ids[2:3], [rows[0][2:3]], False, lambda n: torch.zeros(n, dtype=torch.int64)
    )
    assert not unverified.has_want and unverified.words == unverified.at(1)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed")
def test_launcher_calls_the_compiled_kernel_directly_and_falls_back_for_good(monkeypatch):
    """The engine's Launcher skips Triton's per-launch binding once a variant is compiled: the first
    launch of each constexpr set goes through `kernel[grid](...)`, later ones straight to the compiled
    kernel's launcher with every argument in signature order (constexprs last, as Triton passes them).
    A compiled kernel that takes other arguments (another Triton) sends every later launch back through
    Triton's own path."""
    from umbp.transfer import triton_kernels as K

    through_triton, direct = [], []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def run(self, *args):
            if self.fails:
                raise TypeError("this launcher takes other arguments")
            direct.append(args)

    class Kernel:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                through_triton.append((grid, args, kwargs))
                return Compiled(self.fails)

            return launch

    monkeypatch.setattr(K, "_raw_stream", lambda index: 77)
    monkeypatch.setattr(K, "interpreting", lambda: False)
    launch = K.Launcher(Kernel(fails=False), 0)
    for grid in (3, 5):
        launch(grid, ("plan", 1), (True, 16), ("GUARD", "CROWS"), 4)
    launch(2, ("plan", 1), (False, 16), ("GUARD", "CROWS"), 4)  # another variant: through Triton first
    assert through_triton == [
        ((3,), ("plan", 1), {"GUARD": True, "CROWS": 16, "num_warps": 4}),
        ((2,), ("plan", 1), {"GUARD": False, "CROWS": 16, "num_warps": 4}),
    ]
    assert direct == [(5, 1, 1, 77, "fn", "meta", None, None, None, "plan", 1, True, 16)]
    through_triton.clear()
    broken = K.Launcher(Kernel(fails=True), 0)
    for _ in range(3):
        broken(1, ("plan",), (True,), ("GUARD",), 4)
    assert len(through_triton) == 3 and not broken.direct


def test_a_round_is_the_span_of_its_objects_pieces_in_the_calls_plan():
    """Each launch of a call runs one round: the pieces of objects a:b of the call's one plan. Groups cut
    their objects into different numbers of pieces and a Moves may be empty, so the span comes from
    the segment table: here 2 objects of 3 pieces, none of 1, 3 of 2 (pieces 0-5, 6-11)."""
    from types import SimpleNamespace

    from umbp.transfer.plans import build_plan
    from umbp.transfer.shapes import make_shape

    def geom(pieces):
        return SimpleNamespace(
            object_bytes=4096, num_blocks=64, template=SimpleNamespace(obj=np.zeros(pieces))
        )

    groups = {0: geom(3), 1: geom(1), 2: geom(2)}
    shape = make_shape(((0, 2, 4096), (1, 0, 4096), (2, 3, 4096)), groups, {0: 0, 1: 3, 2: 4})
    assert [shape.piece(i) for i in range(6)] == [0, 3, 6, 8, 10, 12]
    batch = [
        (groups[g], Moves(g, list(range(n)), [0] * n), np.arange(n), np.zeros(n, np.int64))
        for g, n in ((0, 2), (1, 0), (2, 3))
    ]
    plan = build_plan(
        shape,
        batch,
        np.arange(5),
        [np.zeros(5, np.int64)],
        False,
        lambda n: torch.zeros(n, dtype=torch.int64),
    )
    assert plan.span(0, 5) == (0, 12) and plan.span(0, 2) == (0, 6)
    assert plan.span(1, 3) == (3, 8) and plan.span(2, 5) == (6, 12) and plan.span(4, 5) == (10, 12)
