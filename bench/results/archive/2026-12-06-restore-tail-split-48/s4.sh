#!/bin/bash
# the host clock of an idle 8K restore and save, step by step (stamps.py); run as one command line
python3 setup.py -q build_ext --inplace >/dev/null 2>&1; PYTHONPATH=$PWD/src timeout 120 python3 bench/results/archive/2026-12-06-restore-tail-split-48/stamps.py 2>&1 | grep -v Warn | tee $OUT/4-stamps.txt
