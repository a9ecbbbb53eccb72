#!/usr/bin/env bash
# Old (5631634, before issue 22) vs new binary, alternating in one run: 1x4 and 2x1 bench,
# world-1 overhead (char-lm cpu, mlp cpu). Raw output to /tmp/bench/out-*.txt.
set -u
# OUT (default /tmp/bench) holds the output; ROUNDS (default 3) alternations; binaries in
# /tmp/bench/{old,new}.
mkdir -p "${OUT:-/tmp/bench}" && cd "${OUT:-/tmp/bench}"
export WIRETRAIN_LOG=warn
for round in $(seq 1 "${ROUNDS:-3}"); do
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
