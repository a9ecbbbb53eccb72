#!/usr/bin/env bash
# Old (5631634, before issue 22; new: the sub-group mesh and lane frames) vs new binary, alternating in one run: 1x4 and 2x1 bench,
# world-1 overhead (char-lm cpu, mlp cpu). Binaries in /tmp/bench/{old,new}; raw output to /tmp/bench2/out-*.txt; summ.py prints the medians.
set -u
cd /tmp/bench2
export WIRETRAIN_LOG=warn
for round in 1 2 3; do
  for v in old new; do
    B=/tmp/bench/$v
    echo "== round $round $v 1x4" >> out-1x4.txt
    timeout 300 $B/wiretrain bench --op all-reduce,reduce-scatter,all-gather --bytes 16M,64M \
      --local 1 --ranks-per-node 4 >> out-1x4.txt 2>&1
    echo "== round $round $v 2x1" >> out-2x1.txt
    timeout 300 $B/wiretrain bench --op p2p,all-reduce,reduce-scatter,all-gather --bytes 16M,64M \
      --local 2 >> out-2x1.txt 2>&1
    echo "== round $round $v overhead char-lm" >> out-overhead.txt
    timeout 300 $B/overhead char-lm cpu 30 32 2>&1 | grep -v '^{' >> out-overhead.txt
    echo "== round $round $v overhead mlp" >> out-overhead.txt
    timeout 300 $B/overhead mlp cpu 200 64 2>&1 | grep -v '^{' >> out-overhead.txt
  done
done
echo ALLDONE >> out-overhead.txt
