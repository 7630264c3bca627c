"""`umbp replay` runs each setting in a process whose string hashing is seeded (--hash-seed): vLLM walks
sets of request ids, so without a fixed seed the same command could give a peer row different numbers
under eviction."""

from __future__ import annotations

import os
import subprocess
import sys

from umbp.tools.replay import seeded_pool

KEY = "req-0042-turn-3"


def _hash_in_fresh_python(seed: int) -> int:
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    out = subprocess.run([sys.executable, "-c", f"print(hash({KEY!r}))"], env=env, capture_output=True)
    return int(out.stdout)


def test_workers_hash_strings_as_a_process_started_with_the_seed():
    before = os.environ.get("PYTHONHASHSEED")
    with seeded_pool(2, 7) as pool:
        seen = {pool.submit(hash, KEY).result() for _ in range(4)}
    assert seen == {_hash_in_fresh_python(7)}
    assert os.environ.get("PYTHONHASHSEED") == before  # this process's environment is left as it was


def test_another_seed_hashes_differently():
    with seeded_pool(1, 1) as pool:
        one = pool.submit(hash, KEY).result()
    assert one == _hash_in_fresh_python(1) != _hash_in_fresh_python(2)
