#!/usr/bin/env bash
# The 2-node training run alone, ROUNDS (default 6) rounds, the order of old and new swapped
# every round; the summary lines to $OUT/out-train2.txt.
set -u
OUT=${OUT:-/tmp/bench/out}
mkdir -p "$OUT" && cd "$OUT"
export WIRETRAIN_LOG=warn
for round in $(seq 1 "${ROUNDS:-6}"); do
  order="old new"; [ $((round % 2)) -eq 0 ] && order="new old"
  for v in $order; do
    B=/tmp/bench/$v
    echo "== round $round $v train 2x1 char-lm zero2" >> out-train2.txt
    rm -f train-$v.jsonl
    timeout 600 $B/wiretrain launch --local 2 -- train --example char-lm --strategy zero2 \
      --steps 40 --metrics train-$v.jsonl > /dev/null 2>&1
    grep '"summary"' train-$v.jsonl | head -1 >> out-train2.txt
  done
done
