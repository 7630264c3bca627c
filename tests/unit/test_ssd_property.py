"""Property tests: across random put / get / remove / flush / restart sequences under eviction pressure,
an object read back is exactly one of the values put under its key since it was last removed, or a miss;
a removed key stays absent across restarts; capacity is never exceeded. For SsdTier alone and for
TieredPool (DRAM over SSD: demotion, promotion)."""

import os
import shutil
import tempfile

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from umbp.pool import DramPool
from umbp.pool.ssd.tier import SsdTier
from umbp.pool.tiered import TieredPool

KiB = 1024
KEYS = st.integers(0, 11).map(lambda k: f"key/{k}")
SIZES = st.sampled_from([0, 1, 4095, 4096, 4097, 9000, 20 * KiB, 30 * KiB])
CAPACITY = 128 * KiB  # a dozen keys of up to 30 KiB: LRU eviction, reclamation and copy-forward happen


def _blob(n: int, version: int) -> bytes:
    return np.random.default_rng(version).integers(0, 256, n, dtype=np.uint8).tobytes()


def _disk_bytes(directory: str) -> int:
    total = 0
    for name in os.listdir(directory):
        try:
            total += os.path.getsize(os.path.join(directory, name)) if name.startswith("seg-") else 0
        except FileNotFoundError:  # reclaimed by the writer thread meanwhile
            pass
    return total


class _Model(RuleBasedStateMachine):
    """allowed[key]: every value put under key (put returned True) since its last remove."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="umbp-ssd-prop-")
        self.allowed: dict[str, set[bytes]] = {}
        self.version = 0
        self.pool = self.open()

    def open(self):
        raise NotImplementedError

    def ssd(self) -> SsdTier:
        return SsdTier(
            self.dir,
            capacity_bytes=CAPACITY,
            queue_bytes=96 * KiB,
            segment_bytes=16 * KiB,
            max_io_bytes=64 * KiB,
        )

    @rule(key=KEYS, n=SIZES)
    def put(self, key, n):
        self.version += 1
        data = _blob(n, self.version)
        if self.pool.put([key], [data])[0]:
            self.allowed.setdefault(key, set()).add(data)

    @rule(keys=st.lists(KEYS, min_size=2, max_size=6), n=SIZES)
    def put_many(self, keys, n):
        for key in keys:  # one call each: DRAM evicts (and demotes) between them
            self.put(key, n)

    @rule(keys=st.lists(KEYS, min_size=2, max_size=6, unique=True), n=SIZES)
    def put_batch(self, keys, n):
        """One call: DRAM reserves the whole batch first, and its victims are demoted together."""
        blobs = []
        for _ in keys:
            self.version += 1
            blobs.append(_blob(n, self.version))
        for key, data, ok in zip(keys, blobs, self.pool.put(keys, blobs)):
            if ok:
                self.allowed.setdefault(key, set()).add(data)

    @rule()
    def get_all(self):
        """Read back every key (one batch per candidate size)."""
        wanted = {(k, len(v)) for k, vals in self.allowed.items() for v in vals} | {("key/absent", 7)}
        for n in {n for _, n in wanted}:
            keys = [k for k, m in wanted if m == n]
            outs = [bytearray(n) for _ in keys]
            try:
                got = self.pool.get_into(keys, outs)
            except ValueError:  # a key stored under another size: the buffer size check, before any copy
                got = [False] * len(keys)
                for i, k in enumerate(keys):
                    try:
                        got[i] = self.pool.get_into([k], [outs[i]])[0]
                    except ValueError:
                        pass
            for k, out, ok in zip(keys, outs, got):
                if ok:
                    assert bytes(out) in self.allowed.get(k, set()), k

    @rule(key=KEYS)
    def remove(self, key):
        self.pool.remove([key])
        self.allowed.pop(key, None)
        assert self.pool.exists([key]) == [False]

    @rule()
    def flush(self):
        self.pool.flush(timeout=30)

    @rule()
    def restart(self):
        self.pool.close()
        self.pool = self.open()

    @invariant()
    def capacity_respected(self):
        for stats in self.ssd_stats():
            assert stats["used_bytes"] <= stats["capacity_bytes"]
            assert stats["checksum_failures"] == 0 and stats["read_errors"] == 0
        assert _disk_bytes(self.dir) <= CAPACITY

    def ssd_stats(self) -> list[dict]:
        return [self.pool.stats()]

    def teardown(self):
        self.pool.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class SsdMachine(_Model):
    def open(self):
        return self.ssd()


class TieredMachine(_Model):
    def open(self):
        dram = DramPool(
            capacity_bytes=48 * KiB, pinned=False, alignment=512, high_watermark=1.0, low_watermark=0.7
        )
        return TieredPool([dram, self.ssd()])

    def ssd_stats(self) -> list[dict]:
        return [self.pool.stats()["tiers"][1]]


_settings = settings(max_examples=20, stateful_step_count=40, deadline=None, derandomize=True)
TestSsdProperties = SsdMachine.TestCase
TestSsdProperties.settings = _settings
TestTieredProperties = TieredMachine.TestCase
TestTieredProperties.settings = _settings
