"""What differs between vLLM 0.32, 0.33 and 0.34, tested on whichever of them is installed.

CI runs this module on all three (.ci/run). Checks of a feature a release lacks are skipped there, with
the reason; everything else runs on every release:

* draft groups (``is_draft``, 0.33+) and lookahead block hashes (0.33+ coordinator), differentially against
  vLLM's own KV-cache coordinator, with umbp's groups derived from vLLM's specs by umbp's layout code;
* EAGLE with lookahead hashes on and off on vLLM's real Scheduler: umbp restores exactly vLLM's local hit;
* a request whose block hashes vLLM cuts and recomputes (streaming sessions, truncate_block_hashes);
* ``may_load_async`` (0.34), sleep mode's unregister/restore hooks (0.33+; the hooks are plain methods);
* no class, metric or log line of umbp's that reads like vLLM's in-tree UMBPStoreConnector (0.33+).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
if os.environ.get("UMBP_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from _coordinator_oracle import vllm_longest_hit, vllm_spec  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sched_harness import GroupDef, build  # noqa: E402
from test_connector_scheduler import FA_MAMBA_400, PROMPT, compute_then_drop, restore  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from umbp.hybrid import FullAttention, RecurrentState, SlidingWindow, longest_hit  # noqa: E402
from umbp.vllm import compat  # noqa: E402
from umbp.vllm.kv_layout import umbp_group  # noqa: E402

HAS_DRAFT = "is_draft" in {f.name for f in dataclasses.fields(FullAttentionSpec)}
HAS_LOOKAHEAD = compat.has_lookahead_hashes()
OPTS_IN = compat.connector_lookahead_opt_in()


# ------------------------------------------------------------------ differential: draft groups, lookahead
@st.composite
def draft_cases(draw):
    unit = draw(st.sampled_from((1, 2, 4, 16)))
    n = draw(st.sampled_from((1, 2, 2, 3, 3, 4)))
    groups = []
    for _ in range(n):
        kind = draw(st.sampled_from(("fa", "fa", "swa", "mamba")))
        size = unit * (1 if n == 1 else draw(st.sampled_from((1, 2, 4))))
        tag = draw(st.sampled_from(("", "1")))
        if kind == "fa":
            groups.append(FullAttention(size, tag=tag))
        elif kind == "mamba":
            groups.append(RecurrentState(size, tag=tag))
        else:
            groups.append(SlidingWindow(size, draw(st.integers(1, 3 * size + 2)), tag=tag))
    draft = frozenset(draw(st.sets(st.integers(0, n - 1)))) if HAS_DRAFT else frozenset()
    max_tokens = draw(st.integers(0, 48 * unit))
    hashed = (max_tokens + 1) // unit * unit
    eagle = draw(st.booleans())
    flagged = frozenset(draw(st.sets(st.integers(0, n - 1)))) if eagle else frozenset()
    lookahead = draw(st.sampled_from((0, 1))) if HAS_LOOKAHEAD and eagle else 0
    rng = random.Random(draw(st.integers(0, 2**32)))
    present = []
    for _ in groups:
        p = rng.choice((0.0, 0.5, 0.9, 1.0))
        present.append(frozenset(t for t in range(unit, hashed + 1, unit) if rng.random() < p))
    return groups, unit, present, max_tokens, hashed, eagle, flagged, lookahead, draft


@settings(
    max_examples=1500,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(draft_cases())
def test_groups_from_vllm_specs_match_the_coordinator(case):
    """umbp's groups come from vLLM's specs through umbp's own layout code (``umbp_group``), draft specs
    included; umbp's EAGLE rule comes from ``compat.eagle_block_drop`` over the same settings vLLM's
    scheduler reads. Hit, loads and alignment must equal the coordinator's."""
    groups, unit, present, max_tokens, hashed, eagle, flagged, lookahead, draft = case
    want = vllm_longest_hit(
        groups,
        unit,
        present,
        max_tokens,
        hashed,
        use_eagle=eagle,
        flagged=flagged,
        lookahead=lookahead,
        draft=draft,
    )
    specs = [vllm_spec(g) for g in groups]
    specs = [dataclasses.replace(s, is_draft=True) if i in draft else s for i, s in enumerate(specs)]
    ours = [umbp_group(s) for s in specs]
    speculative = SimpleNamespace(use_eagle_block_drop=lambda: eagle)
    drop = compat.eagle_block_drop(
        SimpleNamespace(speculative_config=speculative, num_hash_lookahead_tokens=lookahead)
    )
    eagle_groups = (flagged or frozenset(range(len(groups)))) if drop else frozenset()
    hit = longest_hit(ours, unit, present, max_tokens, eagle_groups=eagle_groups, hashed_tokens=hashed)
    assert (hit.tokens, hit.loads, hit.alignment) == want, case


@pytest.mark.skipif(not HAS_DRAFT, reason="this vLLM's specs have no is_draft field (0.32)")
def test_draft_spec_gets_the_tag_of_its_target_twin():
    """vLLM looks a draft model's group up jointly with an equal target group (is_draft is excluded
    from equality), so umbp must give both the same tag; repr(spec) differs."""
    target = vllm_spec(FullAttention(16))
    draft = dataclasses.replace(target, is_draft=True)
    assert target == draft and repr(target) != repr(draft)
    assert umbp_group(target) == umbp_group(draft)
    assert compat.group_tag(target) != compat.group_tag(vllm_spec(FullAttention(16, tag="1")))


def test_group_tag_is_repr_without_excluded_fields():
    spec = vllm_spec(SlidingWindow(16, 40))
    if all(f.compare for f in dataclasses.fields(spec)):
        assert compat.group_tag(spec) == repr(spec)  # 0.32: the tags umbp always had
    else:
        assert "is_draft" in repr(spec) and "is_draft" not in compat.group_tag(spec)


# ------------------------------------------------------------------ EAGLE on the real Scheduler
# name -> (groups, unit, prompt length, whether vLLM's local cache keeps every state umbp stores). Where
# it does not (a sliding-window layout: vLLM's local cache keeps no state at 128 with retention 0),
# umbp restores further than the local hit, as an unbounded cache would; it must never restore less.
EAGLE_CASES = {
    "seed-eagle": (FA_MAMBA_400, 16, 840, True),
    "fa64-u16": ([GroupDef("fa", 64), GroupDef("mamba", 64)], 16, 150, True),
    "fa64-u16-170": ([GroupDef("fa", 64), GroupDef("mamba", 64)], 16, 170, True),
    "fa64-swa16-mamba": (
        [GroupDef("fa", 64), GroupDef("swa", 16, window=32), GroupDef("mamba", 64)],
        16,
        150,
        False,
    ),
}


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "plain"])
@pytest.mark.parametrize("name", list(EAGLE_CASES))
def test_eagle_restore_equals_vllms_local_hit(tmp_path, name, lookahead):
    groups, unit, n, exact = EAGLE_CASES[name]
    h = build(tmp_path, groups, unit=unit, eagle=True, lookahead=lookahead)
    # umbp opts into lookahead hashes where vLLM asks a connector (0.34); 0.33 keeps them off under any
    # connector, 0.32 has none
    assert compat.hash_lookahead_tokens(h.vllm_config) == (1 if lookahead and OPTS_IN else 0)
    prompt = (PROMPT * 2)[:n]
    local = compute_then_drop(h, "A", prompt)
    assert local > 0
    hit, mism = restore(h, "B", prompt)
    assert mism == [] and (hit == local if exact else hit >= local), (hit, local)
    assert h.leaks()["index_pinned"] == 0


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "plain"])
def test_eagle_under_dcp_restore_equals_vllms_local_hit(tmp_path, lookahead):
    from test_connector_dcp import CASES

    dcp, groups, unit, interleave = CASES["dcp2"]
    h = build(
        tmp_path, groups, unit=unit, tp=dcp, dcp=dcp, interleave=interleave, eagle=True, lookahead=lookahead
    )
    prompt = PROMPT[:300]
    local = compute_then_drop(h, "A", prompt)
    assert local > 0
    assert restore(h, "B", prompt) == (local, [])


@pytest.mark.skipif(not OPTS_IN, reason="this vLLM does not offer connectors lookahead hashes (0.32, 0.33)")
def test_lookahead_hits_a_block_past_the_eagle_drop(tmp_path):
    """840-token prompt, 400-token blocks, u=16: the drop stops at 816; lookahead hashes reach 832, the
    boundary without EAGLE, and umbp restores all of it."""
    hits = {}
    for lookahead in (False, True):
        h = build(tmp_path / str(lookahead), FA_MAMBA_400, unit=16, eagle=True, lookahead=lookahead)
        local = compute_then_drop(h, "A", PROMPT)
        hits[lookahead] = restore(h, "B", PROMPT)
        assert hits[lookahead] == (local, [])
    assert (hits[False][0], hits[True][0]) == (816, 832)


# ------------------------------------------------------------------ hashes that shrink
def test_recomputed_block_hashes_never_reuse_stale_keys(tmp_path):
    """vLLM cuts a request's block hashes and hashes new tokens in their place (a streaming session's
    next input, ``Request.truncate_block_hashes`` from a P/D connector, lookahead hashes recomputed on
    readmission). Here a request is looked up while it holds the stored prompt, then its tail is
    replaced the way vLLM's streaming update does it. umbp must not restore the old prompt's pages for
    the new tail: the restore stops at the newest stored boundary of the shared prefix (800), and its
    bytes are right. (Keys cached from the old hashes offered 832; the workers' key check refused that
    load, so the request lost its whole hit and the objects were quarantined.)"""
    h = build(tmp_path, FA_MAMBA_400, unit=16)
    assert compute_then_drop(h, "A", PROMPT) == 832
    req = h.add("B", PROMPT, max_tokens=4)
    h.umbp.boundary_keys(req)  # what a lookup caches while the request holds the old tokens
    cut = 816  # the prompts share [0, 816)
    new_tail = [(t + 1) % 500 + 3 for t in PROMPT[cut:]]
    del req._all_token_ids[cut:]
    req._all_token_ids.extend(new_tail)
    del req.prompt_token_ids[cut:]  # a list, or an array (0.34)
    req.prompt_token_ids.extend(new_tail)
    del req.block_hashes[cut // 16 :]
    req.update_block_hashes()
    h.admit("B")
    hit = h.umbp.restored.get("B", 0)
    assert (hit, h.held_values("B", hit)) == (800, [])
    assert h.umbp.totals["hash_rewrites"] >= 1
    h.run()


# ------------------------------------------------------------------ may_load_async
@pytest.mark.skipif(not hasattr(KVConnectorBase_V1, "may_load_async"), reason="no may_load_async before 0.34")
def test_may_load_async_routes_stored_prompts_to_the_async_queue(tmp_path):
    h = build(tmp_path, FA_MAMBA_400, unit=16)
    compute_then_drop(h, "A", PROMPT)
    h.sched.scheduler_config.max_num_inflight_kv_loads = 2
    stored = h.add("B", PROMPT, max_tokens=2)
    fresh = h.add("C", [(t + 7) % 500 + 3 for t in PROMPT], max_tokens=2)
    assert stored in list(h.sched.async_kv_waiting) and fresh not in list(h.sched.async_kv_waiting)
    h.admit("B")
    assert h.umbp.restored.get("B") == 832 and h.held_values("B", 832) == []
    h.run()


# ------------------------------------------------------------------ sleep mode
def test_transfers_pause_while_the_kv_cache_is_released(tmp_path):
    """vLLM 0.33+ calls unregister_kv_caches before sleep (or a weight update) releases the KV cache's
    memory, and restore_kv_caches after it is mapped again. Meanwhile no save may store what the
    released memory holds (each is a counted failure: a future miss) and no load may write into it (a
    load waits for the memory and then runs); afterwards umbp saves and restores as before."""
    h = build(tmp_path, FA_MAMBA_400, unit=16)
    for w in h.workers:
        w.unregister_kv_caches()
    assert compute_then_drop(h, "A", PROMPT) == 832
    assert h.umbp.index.stats()["objects"] == 0 and h.umbp.totals["save_failures"] > 0
    for w in h.workers:
        w.restore_kv_caches()
    compute_then_drop(h, "A2", PROMPT)
    assert h.umbp.index.stats()["objects"] > 0
    for w in h.workers:
        w.unregister_kv_caches()
    h.add("B", PROMPT, max_tokens=4)
    for _ in range(5):  # a load asked for while released waits for the memory, then runs
        h.step()
    assert "B" in h.umbp.loads and "B" not in h.umbp.restored
    for w in h.workers:
        w.restore_kv_caches()
    h.admit("B")
    assert (h.umbp.restored.get("B"), h.held_values("B", 832)) == (832, [])
    assert h.umbp.totals["load_failures"] == 0
    h.run()


# ------------------------------------------------------------------ names
def _in_tree_umbp_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm.distributed.kv_transfer.kv_connector.v1")
    path = Path(spec.submodule_search_locations[0]) / "umbp" if spec else None
    return path if path is not None and path.is_dir() else None


@pytest.mark.skipif(_in_tree_umbp_dir() is None, reason="this vLLM has no in-tree UMBP connector (0.32)")
def test_no_umbp_class_or_metric_reads_like_the_in_tree_connector():
    """Read from the in-tree package's source (importing it needs AMD's MORI): its class names and
    Prometheus metric names must not be umbp's."""
    theirs_classes, theirs_metrics = set(), set()
    for path in _in_tree_umbp_dir().rglob("*.py"):
        tree = ast.parse(path.read_text())
        theirs_classes |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        theirs_metrics |= {
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("vllm:")
        }
    assert "UMBPStoreConnector" in theirs_classes
    import umbp.vllm.connector as connector
    import umbp.vllm.metadata as metadata
    import umbp.vllm.stats as stats

    ours = {
        obj.__name__
        for mod in (connector, metadata, stats)
        for obj in vars(mod).values()
        if isinstance(obj, type) and obj.__module__.startswith("umbp.")
    }
    assert "UMBPConnector" in ours and not ours & theirs_classes, ours & theirs_classes
    families = [*stats.COUNTERS, *(f"tier_{n}" for n in stats.TIER_COUNTERS)]
    our_metrics = {f"vllm:umbp_{name}" for name in [*families, *(f"group_{n}" for n in stats.GROUP_COUNTERS)]}
    assert not {m.removesuffix("_total") for m in theirs_metrics} & our_metrics
