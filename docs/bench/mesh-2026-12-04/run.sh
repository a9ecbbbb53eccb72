#!/usr/bin/env bash
# Old (5631634, before issue 22) vs new binary (/tmp/bench/{old,new}), alternating, 5 rounds:
# 1x4 and 2x1 bench and the world-1 overhead, with the same script as the first re-measure.
# Raw output in /tmp/bench2/out-*.txt; `python3 summ.py /tmp/bench2` prints the medians.
OUT=/tmp/bench2 ROUNDS=5 exec bash "$(dirname "$0")/../refactor-2026-12-04/run.sh"
