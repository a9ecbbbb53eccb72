#!/usr/bin/env bash
# ZeRO-3 prefetch on and off, 2 nodes in network namespaces joined by a tbf-shaped veth
# (scripts/lab-tbf.sh): the share of the step spent waiting for unit all-gathers, medians over
# the steps after the first. Needs root. Env: RATE (default 50mbit), STEPS (12), PROFILE (debug),
# EXAMPLE (char-lm), BATCH (32).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${CARGO_TARGET_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target}
export BIN=${BIN:-$T/${PROFILE:-debug}/wiretrain}
export RATE=${RATE:-50mbit}
STEPS=${STEPS:-12}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "# $(date -u +%FT%TZ) $(nproc) cores; ZeRO-3 ${EXAMPLE:-char-lm}, 2 nodes x 1 rank, tbf $RATE each way"
printf "| %-8s | %8s | %8s | %10s | %8s |\n" prefetch step_ms comm_ms gather_ms "gather %"
printf "|----------|----------|----------|------------|----------|\n"
for pf in 0 1 2; do
  SUB=train scripts/lab-tbf.sh --example "${EXAMPLE:-char-lm}" --strategy zero3 --prefetch "$pf" \
    --steps "$STEPS" --global-batch "${BATCH:-32}" --device cpu --no-progress \
    --metrics "$tmp/pf$pf.jsonl" --plot "$tmp/pf$pf.png" 2>/dev/null | grep -v '^#' || true
  python3 - "$tmp/pf$pf.jsonl" "$pf" <<'PY'
import json, sys
m = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])["median"]
print(f"| {sys.argv[2]:<8} | {m['step_ms']:8.1f} | {m['comm_ms']:8.1f} | {m['gather_ms']:10.1f} | {100*m['gather_ms']/m['step_ms']:7.1f}% |")
PY
done
