"""The C PageRuns (umbp.pool._native) answers exactly as its pure-Python twin PageAllocator: the same start
for every alloc (best fit, oldest run of a length), the same free runs after every free (coalesced)."""

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.pool import native
from umbp.pool.dram.allocator import PageAllocator


@pytest.fixture(autouse=True)
def _need_native():
    if native.lib is None:
        if os.environ.get("UMBP_REQUIRE_NATIVE") == "1":
            pytest.fail(f"UMBP_REQUIRE_NATIVE=1 but the extension is {native.why_not}")
        pytest.skip(f"the C extension is {native.why_not}")


def _same(c, py) -> None:
    assert c.free_runs() == py.free_runs()
    assert c.free_pages == py.free_pages
    assert c.largest_free() == py.largest_free()


def _drive(npages: int, ops, rng: random.Random) -> None:
    c, py, live = native.lib.PageRuns(npages), PageAllocator(npages), []
    _same(c, py)
    for is_alloc, n in ops:
        if is_alloc or not live:
            got = c.alloc(n)
            assert got == py.alloc(n)
            if got is not None and n > 0:
                live.append((got, n))
        else:
            start, n = live.pop(rng.randrange(len(live)))
            c.free(start, n)
            py.free(start, n)
        _same(c, py)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    npages=st.integers(0, 64),
    ops=st.lists(st.tuples(st.booleans(), st.integers(-1, 12)), max_size=80),
    seed=st.integers(0, 1000),
)
def test_same_answers_as_the_python_allocator(npages, ops, seed):
    _drive(npages, ops, random.Random(seed))


def test_many_fragments_grow_the_tables_and_still_agree():
    """Thousands of one-page holes: the run tables grow several times (rehash) while matching."""
    rng = random.Random(5)
    ops = [(True, 1)] * 4000 + [(rng.random() < 0.3, rng.choice([1, 2, 3, 8])) for _ in range(6000)]
    _drive(5000, ops, rng)
