"""kill -9 a process that is writing objects as fast as it can, restart, verify: everything it had flushed
is served byte-exact, anything else is either exact or a miss, and the directory lock died with it."""

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from umbp.pool.ssd.format import scan, scan_directory
from umbp.pool.ssd.tier import SsdLockedError, SsdTier

MiB = 1 << 20

# Object i is a slice of one pseudo-random pool (cheap to make, so the writer is always writing); every
# fourth object is 8 MiB, so a kill often lands inside a long write and leaves a torn record.
POOL_SETUP = """
import numpy as np
POOL = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)
def data(i):
    n = (i * 7919) % (1 << 20) + 1 + (8 << 20 if i % 4 == 3 else 0)
    off = (i * 12345) % (16 << 20)
    return POOL[off : off + n]
"""
_ns: dict = {}
exec(POOL_SETUP, _ns)
data = _ns["data"]

WRITER = (
    POOL_SETUP
    + r"""
import sys, time
from umbp.pool.ssd.tier import SsdTier
directory, direct, i = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
stop = i + 64  # at most ~170 MB a round: two rounds stay far below the 1 GiB capacity, so nothing is evicted
tier = SsdTier(directory, capacity_bytes=1 << 30, queue_bytes=32 << 20, direct_io=direct)
print("ready", flush=True)
while i < stop:
    while not tier.put([f"k{i}"], [data(i)])[0]:
        time.sleep(0.001)
    if i % 8 == 7:
        tier.flush()
        print(f"durable {i}", flush=True)
    i += 1
time.sleep(600)  # stopped: the kill may land here (nothing torn), or mid-stream as usual
"""
)


def _run_and_kill(directory: str, direct: bool, start: int, rng: random.Random) -> int:
    """Start a writer at key `start`, let it pass 16-40 flushed keys, SIGKILL it 0-20 ms later (usually mid-write);
    returns the last key it reported flushed before it died. The writer stops by itself after 64 keys:
    with no bound, a fast disk (or this process descheduled for a while) let it store ~600 MB before the
    kill, the second round outgrew the capacity and reclaimed the first round's objects, a legitimate
    eviction that the check below would call a loss."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, directory, "1" if direct else "0", str(start)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(SsdLockedError, match=f"pid {proc.pid}"):
            SsdTier(directory, capacity_bytes=64 * MiB)
        durable = start - 1
        goal = start + rng.randint(16, 40)
        deadline = time.monotonic() + 60
        while durable < goal and time.monotonic() < deadline:
            durable = int(proc.stdout.readline().split()[1])
        time.sleep(rng.uniform(0, 0.02))  # land the kill anywhere in the next writes
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    for line in proc.stdout:  # flushed before the kill, but not read yet: durable too
        durable = max(durable, int(line.split()[1]))
    proc.stdout.close()
    return durable


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_kill_9_mid_stream_then_restart(tmp_path, direct):
    rng = random.Random(1234)
    directory = str(tmp_path)
    start, durable_all, torn = 0, [], 0
    for _ in range(2):  # the second round reopens what the first crash left
        durable = _run_and_kill(directory, direct, start, rng)
        durable_all.append(durable)
        torn += bool(scan(directory).discarded)
        with SsdTier(directory, capacity_bytes=1 << 30, queue_bytes=64 * MiB, direct_io=direct) as tier:
            listed = scan_directory(directory)
            missing = [i for i in range(durable + 1) if f"k{i}" not in listed]
            assert not missing, (
                f"flushed keys lost: {missing[:8]} ({len(missing)}) of k0..k{durable}; segments "
                f"{[(s.number, s.sealed, len(s.records)) for s in scan(directory).segments]}"
            )
            for key in listed:
                i = int(key[1:])
                expected = data(i)
                out = np.empty(expected.size, np.uint8)
                ok = tier.get_into([key], [out])[0]
                assert ok or i > durable, key  # flushed objects are never lost
                if ok:
                    assert np.array_equal(out, expected), key
            assert tier.stats()["checksum_failures"] == 0
        start = durable + 1
    assert durable_all[-1] >= 32
    print(f"torn tails found after the kills: {torn}/2")  # informative: a kill between writes tears nothing
