#!/usr/bin/env bash
# Old (cea0932: the executor names QUIC's lane types, strategies branch on stage and scope)
# against new (the Lane trait, GradSync answering what it holds, point-to-point messages)
# binary, alternating in one run: 1x4, 2x1 and 2x2 collectives, a 2-node training run and the
# world-1 overhead. Binaries in /tmp/bench/{old,new} (dev profile, stripped); raw output to
# $OUT (default /tmp/bench/out), ROUNDS (default 3) alternations.
set -u
OUT=${OUT:-/tmp/bench/out}
mkdir -p "$OUT" && cd "$OUT"
export WIRETRAIN_LOG=warn
for round in $(seq 1 "${ROUNDS:-3}"); do
  for v in old new; do
    B=/tmp/bench/$v
    echo "== round $round $v 1x4" >> out-1x4.txt
    timeout 300 $B/wiretrain bench --op all-reduce,reduce-scatter,all-gather --bytes 16M,64M \
      --local 1 --ranks-per-node 4 >> out-1x4.txt 2>&1
    echo "== round $round $v 2x1" >> out-2x1.txt
    timeout 300 $B/wiretrain bench --op p2p,all-reduce,reduce-scatter,all-gather,broadcast \
      --bytes 16M,64M --local 2 >> out-2x1.txt 2>&1
    echo "== round $round $v 2x2" >> out-2x2.txt
    timeout 300 $B/wiretrain bench --op all-reduce,all-gather --bytes 16M,64M \
      --local 2 --ranks-per-node 2 >> out-2x2.txt 2>&1
    echo "== round $round $v train 2x1 char-lm zero2" >> out-train.txt
    rm -f train-$v.jsonl
    timeout 600 $B/wiretrain launch --local 2 -- train --example char-lm --strategy zero2 \
      --steps 40 --metrics train-$v.jsonl > /dev/null 2>&1
    grep '"summary"' train-$v.jsonl | head -1 >> out-train.txt
    echo "== round $round $v overhead char-lm" >> out-overhead.txt
    timeout 300 $B/overhead char-lm cpu 30 32 2>&1 | grep -v '^{' >> out-overhead.txt
  done
done
echo ALLDONE >> out-overhead.txt
