"""Modelled submit-to-finish seconds of restored and other turns, from a replay's per-request records."""
import json
import statistics
import sys

for path in sys.argv[1:]:
    recs = [json.loads(line) for line in open(path)]
    for name, keep in (("restored", lambda r: r["restored"] > 0), ("other", lambda r: r["restored"] == 0)):
        t = [r["finished_s"] - r["submitted_s"] for r in recs if keep(r)]
        print(f"  {name:<9} turns {len(t):5d}  median {statistics.median(t):.4f} s  mean {statistics.fmean(t):.4f} s")
