"""The connector's worker side on a GPU: saves run on the transfer engine's own stream and finish after
`save()` returns, the next forward is fenced behind them, loads are reported when their copies are done,
and every byte that comes back is the byte that was saved (Granite-4.0-H-350M's vLLM layout).

Runs only with CUDA (on the H200 device: see docs/transfer.md). The device has no vLLM and cannot install
it, so when vLLM is missing the few vLLM base classes the worker's modules import are given stand-ins;
nothing here exercises vLLM itself (the CPU tests in tests/vllm do, on the real Scheduler and LLM).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
import types
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")

NS = "0123456789abcdef" * 2
SLOT = 2 << 20  # Granite-4.0-H-350M objects are ~1.6 MB
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of GPU time at the H200's clock


def _stand_in_vllm() -> None:
    try:
        importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        return
    except ImportError:
        pass

    class _Base:
        def __init__(self, *args, **kwargs):
            pass

    @dataclasses.dataclass
    class _Stats:
        data: dict = dataclasses.field(default_factory=dict)

    names = {
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorMetadata": type("KVConnectorMetadata", (), {}),
            "KVConnectorWorkerMetadata": type("KVConnectorWorkerMetadata", (), {}),
            "KVConnectorHandshakeMetadata": type("KVConnectorHandshakeMetadata", (), {}),
        },
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics": {
            "KVConnectorStats": _Stats,
            "KVConnectorPromMetrics": _Base,
        },
        "vllm.v1.kv_cache_interface": {
            n: type(n, (), {})
            for n in ("FullAttentionSpec", "KVCacheConfig", "MambaSpec", "SlidingWindowSpec")
        },
    }
    for full, attrs in names.items():
        parts = full.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        for k, v in attrs.items():
            setattr(sys.modules[full], k, v)


@pytest.fixture
def worker():
    w, groups = make_worker()
    yield w, groups
    w.close()


def make_worker(before_register=None, raw_states: bool = False):
    """A WorkerSide registered over Granite-4.0-H-350M's vLLM layout on the GPU, with its arena;
    before_register(groups) runs before register() does. With raw_states the state layers are handed to
    register() as their whole raw padded page (the worker must narrow them to the states)."""
    _stand_in_vllm()
    from umbp.identity import RankCoord
    from umbp.transfer import model_layouts as L
    from umbp.vllm.config import UMBPConfig
    from umbp.vllm.kv_layout import Layout
    from umbp.vllm.worker import WorkerSide

    num_blocks = 1 + 16 * 8  # the null block, then 8 sources and 8 destinations for each group (_blocks)
    groups, _ = L.granite_hybrid(num_blocks, device="cuda")
    kv_caches, names = {}, []
    for g, layers in sorted(groups.items()):
        names.append([f"g{g}.l{i}" for i in range(len(layers))])
        kv_caches.update({n: t._base if raw_states and g else t for n, (t, _) in zip(names[-1], layers)})
    config = SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[
            # vLLM's spec says how many bytes of a layer's page are content: the state views here
            # are already narrowed to it (the rest of each raw page is padding)
            SimpleNamespace(
                layer_names=n, kv_cache_spec=SimpleNamespace(real_page_size_bytes=_page(groups[g]))
            )
            for g, n in zip(sorted(groups), names)
        ],
    )
    layout = Layout(
        groups=(),
        unit=16,
        eagle_groups=frozenset(),
        identity=None,
        namespace=NS,
        ranks=(RankCoord(),),
        object_bytes=tuple(SLOT for _ in names),
    )
    w = WorkerSide(UMBPConfig(dram_bytes=80 * SLOT), layout, config, rank=RankCoord())
    if before_register is not None:
        before_register(groups)
    w.register(kv_caches)
    assert type(w.engine).__name__ == "KernelEngine"
    return w, groups


def _page(layers) -> int:
    t, d = layers[0]
    return t.numel() // t.shape[d] * t.element_size()


def _blocks(g: int, n: int = 8) -> tuple[list[int], list[int]]:
    """Group g's source and destination blocks: distinct across groups, as vLLM's one block pool hands
    them out (the groups' layers share their KV memory, so block b is one page in each group)."""
    first = 1 + 16 * g
    return list(range(first, first + n)), list(range(first + 8, first + 8 + n))


def _objects(groups, blocks) -> dict[tuple[int, int], torch.Tensor]:
    """(group, block) -> the object's bytes on the host, read with plain torch (the reference). blocks:
    one list for every group, or a list per group."""
    out = {}
    for g, layers in groups.items():
        for b in blocks[g] if isinstance(blocks, dict) else blocks:
            out[g, b] = torch.cat(
                [t.select(d, b).contiguous().view(-1).view(torch.uint8) for t, d in layers]
            ).cpu()
    return out


def _storages(groups) -> list[torch.Tensor]:
    seen = {}
    for layers in groups.values():
        for t, _ in layers:
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), torch.empty(0, dtype=torch.uint8, device=t.device).set_(st))
    return list(seen.values())


def test_saves_overlap_are_fenced_and_loads_complete_async(worker):
    w, groups = worker
    _cycle(w, groups, job_base=0, check_async=False)  # warm-up: Triton compiles each kernel variant once
    _cycle(w, groups, job_base=100, check_async=True)


def _cycle(w, groups, job_base: int, check_async: bool) -> None:
    from umbp.vllm.metadata import LoadJob, PageMove, SaveJob, UMBPConnectorMetadata

    gen = torch.Generator(device="cuda").manual_seed(int(time.time()) + job_base)
    for s in _storages(groups):
        s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8, device="cuda", generator=gen))
    src, dst = ({g: _blocks(g)[k] for g in groups} for k in (0, 1))
    want = _objects(groups, src)
    jobs, loads, slot = [], {}, 0
    for g in sorted(groups):
        nbytes = w.groups[g].object_bytes
        moves = []
        for b, d in zip(src[g], dst[g]):
            h = bytes([g, b, job_base]) * 8
            moves.append(PageMove(b, slot * SLOT, nbytes, h))
            loads.setdefault(g, []).append(PageMove(d, slot * SLOT, nbytes, h))
            slot += 1
        jobs.append(SaveJob(job_base + len(jobs) + 1, g, moves))

    torch.cuda._sleep(SLEEP_CYCLES)  # GPU time queued first: the save's copies must wait for it
    t0 = time.perf_counter()
    w.save(UMBPConnectorMetadata(saves=jobs))
    issued = time.perf_counter() - t0
    if check_async:
        assert len(w.pending_saves) == len(jobs), f"save() waited for its copies ({issued * 1e3:.0f} ms)"
    w.before_forward()
    for s in _storages(groups):  # "the next forward" rewrites every block, saved ones included
        s.fill_(0)
    first = w.take_worker_meta()  # copies started in this poll: not waited for
    second = w.take_worker_meta()  # one step later: waited for
    saved = {**(first.saved if first else {}), **(second.saved if second else {})}
    assert sorted(saved) == [j.job_id for j in jobs] and not w.pending_saves
    for g, job in enumerate(jobs):
        for m in job.moves:
            got = torch.from_numpy(w.arena.view(m.offset, w.groups[g].object_bytes).copy())
            assert torch.equal(got, want[g, m.block_id]), f"slot of group {g} block {m.block_id} (the fence?)"

    for s in _storages(groups):
        s.fill_(0xA5)  # poison the destinations
    torch.cuda._sleep(SLEEP_CYCLES)
    req = f"r{job_base}"
    w.load(UMBPConnectorMetadata(loads=[LoadJob(req, loads)]))
    finished, failed = w.take_transfer_results()
    if check_async:
        assert req not in finished, "the load was reported before its copies could have run"
    deadline = time.monotonic() + 30
    while req not in finished:
        assert time.monotonic() < deadline
        time.sleep(0.001)
        more, failed = w.take_transfer_results()
        finished |= more
    assert not failed
    back = _objects(groups, dst)
    for g in groups:
        for b, d in zip(src[g], dst[g]):
            assert torch.equal(back[g, d], want[g, b]), f"group {g} block {d}"
    print(f"save() of {len(jobs)} jobs returned in {issued * 1e3:.2f} ms (check_async={check_async})")


@pytest.mark.parametrize("fence", [True, False])
def test_only_fenced_saves_hold_up_the_next_forward(worker, fence):
    """A save of mutable pages (SaveJob.fence) makes the next forward wait on the GPU; a save of full
    blocks does not: the forward's first kernel finishes while that save's copies are still queued."""
    from umbp.vllm.metadata import PageMove, SaveJob, UMBPConnectorMetadata

    w, groups = worker
    _cycle(w, groups, job_base=0, check_async=False)  # warm-up: compile the kernels
    g = sorted(groups)[0]
    nbytes = w.groups[g].object_bytes
    # and the timed save's own shape, one job of 4 objects: were its kernel variant compiled only in the
    # timed part, the module load would wait for the GPU's queued work (docs/transfer.md, variants)
    warm = [PageMove(b, b * SLOT, nbytes, bytes([b, 0]) * 16) for b in range(1, 5)]
    w.save(UMBPConnectorMetadata(saves=[SaveJob(499, g, warm, fence=fence)]))
    w.take_worker_meta()
    w.take_worker_meta()
    job = SaveJob(500, g, [PageMove(b, b * SLOT, nbytes, bytes([b]) * 32) for b in range(1, 5)], fence=fence)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the save is ordered after ~0.5 s of work on the stream it is issued from
        torch.cuda._sleep(SLEEP_CYCLES)
        w.save(UMBPConnectorMetadata(saves=[job]))
    assert w.pending_saves
    w.before_forward()  # on the default stream: "the next forward" starts here
    t0 = time.perf_counter()
    forward = torch.ones(1, device="cuda").add_(1)  # noqa: F841 - the forward's first kernel
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    waited = time.perf_counter() - t0
    assert (waited > 0.2) == fence, f"the forward waited {waited:.3f} s (fence={fence})"
    w.take_worker_meta()
    w.take_worker_meta()
    assert not w.pending_saves


def test_no_kernel_compiles_after_the_warm_up():
    """register() compiles every copy-kernel variant the worker's transfers use: saves and verified loads
    of every group, in batches of other shapes, meet no new one (which would compile and then wait for the
    GPU in the middle of serving), and the null block used to warm up keeps its bytes."""
    _stand_in_vllm()
    from umbp.transfer import triton_kernels as kernels
    from umbp.vllm.metadata import PageMove, SaveJob, UMBPConnectorMetadata

    caches = getattr(kernels.copy_objects, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton does not expose its compiled-kernel cache")
    caches.clear()  # what other tests compiled in this process must not count
    block0 = {}

    def fill(groups):
        gen = torch.Generator(device="cuda").manual_seed(int(time.time()))
        for s in _storages(groups):
            s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8, device="cuda", generator=gen))
        block0.update(_objects(groups, [0]))

    w, groups = make_worker(before_register=fill)
    warmed = sum(len(v[0]) for v in caches.values())
    assert warmed > 0
    after = _objects(groups, [0])
    assert all(torch.equal(after[k], block0[k]) for k in block0), "the warm-up changed the null block"
    _cycle(w, groups, job_base=0, check_async=False)  # every group, 8 objects each, save then verified load
    for base, count in ((10, 1), (20, 3), (30, 5)):  # batches of other shapes
        jobs = [
            SaveJob(
                base + g,
                g,
                [
                    PageMove(b, (base + b) * SLOT, w.groups[g].object_bytes, bytes([g, b, base]) * 8)
                    for b in range(1, 1 + count)
                ],
            )
            for g in sorted(groups)[:count]
        ]
        w.save(UMBPConnectorMetadata(saves=jobs))
        w.take_worker_meta()
        w.take_worker_meta()
    assert sum(len(v[0]) for v in caches.values()) == warmed
    w.close()


def test_loads_started_together_share_one_engine_call_and_restore_exactly(worker):
    """Two restores started in one step: one engine call for both (each load's results sliced out of
    it), every byte of each back in its own blocks."""
    from umbp.vllm.metadata import LoadJob, PageMove, SaveJob, UMBPConnectorMetadata

    w, groups = worker
    gen = torch.Generator(device="cuda").manual_seed(int(time.time()) + 7)
    for s in _storages(groups):
        s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8, device="cuda", generator=gen))
    src, dst = ({g: _blocks(g)[k] for g in groups} for k in (0, 1))
    want = _objects(groups, src)
    jobs, loads, slot = [], ({}, {}), 0
    for g in sorted(groups):
        nbytes = w.groups[g].object_bytes
        moves = []
        for k, b in enumerate(src[g]):
            h = bytes([g, b, 77]) * 8
            moves.append(PageMove(b, slot * SLOT, nbytes, h))
            loads[k % 2].setdefault(g, []).append(PageMove(dst[g][k], slot * SLOT, nbytes, h))
            slot += 1
        jobs.append(SaveJob(700 + len(jobs), g, moves))
    w.save(UMBPConnectorMetadata(saves=jobs))
    w.take_worker_meta()
    w.take_worker_meta()
    for s in _storages(groups):
        s.fill_(0xA5)  # poison the destinations
    calls, real = [], w.engine.load
    w.engine.load = lambda batch: (calls.append(len(batch)), real(batch))[1]
    w.load(UMBPConnectorMetadata(loads=[LoadJob("x0", loads[0]), LoadJob("x1", loads[1])]))
    finished, deadline = set(), time.monotonic() + 30
    while finished != {"x0", "x1"}:
        assert time.monotonic() < deadline
        more, failed = w.take_transfer_results()
        assert not failed
        finished |= more
    assert calls == [2 * len(groups)]
    back = _objects(groups, dst)
    for g in groups:
        for k, b in enumerate(src[g]):
            assert torch.equal(back[g, dst[g][k]], want[g, b]), f"group {g} block {b}"


def test_raw_padded_state_pages_restore_only_their_states():
    """State layers registered as their raw padded pages: objects hold the states only, and a restore
    writes the states of its blocks and nothing else: not their padding, not any other block."""
    from umbp.vllm.metadata import LoadJob, PageMove, SaveJob, UMBPConnectorMetadata

    w, groups = make_worker(raw_states=True)
    try:
        states = [g for g in sorted(groups) if g]
        for g in states:
            # each of the group's layers contributes its states only, less than its raw padded page
            assert _page(groups[g]) < groups[g][0][0]._base[0].numel()
            assert w.groups[g].object_bytes == _page(groups[g]) * len(groups[g])
        _cycle(w, groups, job_base=0, check_async=False)
        # every state group views the same raw pages, so groups must use disjoint blocks: 24 of the blocks
        # hold the sources and destinations of four groups
        states = states[:4]
        gen = torch.Generator(device="cuda").manual_seed(int(time.time()))
        for s in _storages(groups):
            s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8, device="cuda", generator=gen))
        src = {g: [2 * g, 2 * g + 1] for g in states}
        dst = {g: [12 + 2 * g, 13 + 2 * g] for g in states}
        want = {(g, b): obj for g in states for (gg, b), obj in _objects(groups, src[g]).items() if gg == g}
        jobs, loads, slot = [], {}, 0
        for g in states:
            moves = []
            for b, d in zip(src[g], dst[g]):
                h = bytes([g, b, 77]) * 8
                moves.append(PageMove(b, slot * SLOT, w.groups[g].object_bytes, h))
                loads.setdefault(g, []).append(PageMove(d, slot * SLOT, w.groups[g].object_bytes, h))
                slot += 1
            jobs.append(SaveJob(900 + g, g, moves))
        w.save(UMBPConnectorMetadata(saves=jobs))
        w.take_worker_meta()
        w.take_worker_meta()
        for s in _storages(groups):
            s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8, device="cuda", generator=gen))
        before = [s.clone() for s in _storages(groups)]
        w.load(UMBPConnectorMetadata(loads=[LoadJob("raw", loads)]))
        finished, failed = set(), set()
        deadline = time.monotonic() + 30
        while "raw" not in finished:
            assert time.monotonic() < deadline
            more, failed = w.take_transfer_results()
            finished |= more
        assert not failed
        for g in states:  # the states came back
            got = _objects(groups, dst[g])
            for b, d in zip(src[g], dst[g]):
                assert torch.equal(got[g, d], want[g, b]), f"group {g} block {d}"
        # and nothing else changed: put the restored states into the snapshot, compare every byte
        for g in states:
            for t, _ in groups[g]:
                raw = t._base
                snap = next(b for s, b in zip(_storages(groups), before) if s.data_ptr() == raw.data_ptr())
                snap_raw = snap.view(raw.shape)
                n = t.shape[1]
                for d in dst[g]:
                    snap_raw[d, :n] = raw.view(torch.uint8)[d, :n]
        for s, b in zip(_storages(groups), before):
            assert torch.equal(s, b), "a restore wrote bytes outside its blocks' states"
    finally:
        w.close()
