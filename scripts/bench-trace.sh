#!/usr/bin/env bash
# Tracing overhead: char-lm on 2 nodes x 2 ranks (ZeRO-2, Burn's CPU backend), the same run
# with and without --trace, interleaved ROUNDS times; prints the median step time of each run
# (first step left out) and the ratio traced/untraced per round, then the median ratio.
#   scripts/bench-trace.sh [ROUNDS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}; STEPS=${2:-40}
BIN=${BIN:-${CARGO_TARGET_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target}/debug/wiretrain}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
run() { # $1 = metrics file, rest = extra flags
  local m=$1; shift
  "$BIN" launch --local 2 --ranks-per-node 2 -- train --example char-lm --strategy zero2 \
    --steps "$STEPS" --device cpu --no-progress --metrics "$m" "$@" >/dev/null 2>&1
  python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])['median']['step_ms'])" "$m"
}
ratios=()
echo "round untraced_ms traced_ms ratio"
for r in $(seq 1 "$ROUNDS"); do
  a=$(run "$tmp/a$r.jsonl"); b=$(run "$tmp/b$r.jsonl" --trace "$tmp/t$r")
  ratio=$(python3 -c "print(f'{$b/$a:.4f}')")
  ratios+=("$ratio")
  echo "$r $a $b $ratio"
done
python3 -c "import statistics,sys; print('median ratio', statistics.median(map(float, sys.argv[1:])))" "${ratios[@]}"
