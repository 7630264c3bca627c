"""Host-only: TransferEngine._checked for a 4,096-object save batch (lists of ints, as the connector and
the bench pass them), this commit's overlap check vs the argsort one it replaced, and their parts."""
import statistics, time, numpy as np, sys, platform
from umbp.pool import Arena
from umbp.transfer import Moves, make_engine, api
from umbp.transfer import layouts as L
KiB = 1024
n = 4096
groups = {0: L.attention(4, 2 * n + 8, 16, 4, 64, device="cpu")}
arena = Arena(2 * n * 64 * KiB + (64 << 20), pinned=False, prefault=False)
eng = make_engine(arena, groups, backend="staged")
rng = np.random.default_rng(1)
blocks = [int(x) for x in rng.permutation(2 * n)[:n]]
slots = [int(x) * 64 * KiB for x in rng.permutation(2 * n)[:n]]
batch = [Moves(0, blocks, slots)]
def t(f, k=200):
    for _ in range(5): f()
    ts = []
    for _ in range(k):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
def old_disjoint(starts, reaches):
    s = np.concatenate(starts) if len(starts) > 1 else starts[0]
    e = np.concatenate([o + r for o, r in zip(starts, reaches)])
    order = np.argsort(s, kind="stable")
    return bool(np.any(s[order][1:] < e[order][:-1]))
offs = np.asarray(slots, np.int64)
print(platform.python_version(), np.__version__, platform.processor() or platform.machine())
print(f"_checked (this commit) {t(lambda: eng._checked(batch, load=False)):.3f} ms")
print(f"fromiter x1 {t(lambda: np.fromiter(slots, np.int64, n)):.3f} ms")
print(f"overlap check: sort {t(lambda: api.check_disjoint([offs], [65536])):.3f} ms, argsort (old) {t(lambda: old_disjoint([offs], [65536])):.3f} ms")
