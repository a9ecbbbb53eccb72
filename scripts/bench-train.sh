#!/usr/bin/env bash
# Step-time figures for docs/BENCHMARKS.md, measured on this machine in one run:
#  1. world-size-1 overhead against plain Burn (examples/overhead.rs, interleaved steps);
#  2. the step-time split (compute, exposed comm, optimizer) of DDP and ZeRO-1/2/3 on
#     2 node processes over QUIC on loopback (medians over the steps after the first).
# Env: PROFILE (debug|release, default debug: deps at opt-level 2), DEVICE (cpu), STEPS (30),
# EXAMPLE (char-lm), BATCH (32), RANKS (ranks per node, 1).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${CARGO_TARGET_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target}
PROFILE=${PROFILE:-debug}
BIN=$T/$PROFILE/wiretrain
DEVICE=${DEVICE:-cpu}
STEPS=${STEPS:-30}
EXAMPLE=${EXAMPLE:-char-lm}
BATCH=${BATCH:-32}
RANKS=${RANKS:-1}
echo "# $(date -u +%FT%TZ) $(nproc) cores, $(uname -sr), profile $PROFILE, device $DEVICE"
echo "## world size 1: wiretrain (DDP) against plain Burn, $EXAMPLE, batch $BATCH"
"$T/$PROFILE/examples/overhead" "$EXAMPLE" "$DEVICE" "$STEPS" "$BATCH" | grep -v '^{'
echo "## 2 nodes x $RANKS rank(s), QUIC on loopback, $EXAMPLE, global batch $BATCH, medians of $STEPS steps (ms)"
printf "| %-8s | %8s | %8s | %8s | %8s | %8s | %10s |\n" strategy step compute comm optim "comm %" "sent KB"
printf "|----------|----------|----------|----------|----------|----------|------------|\n"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for s in ddp zero1 zero2 zero3 hybrid; do
  "$BIN" launch --local 2 --ranks-per-node "$RANKS" -- train --example "$EXAMPLE" --strategy "$s" \
    --steps "$STEPS" --global-batch "$BATCH" --device "$DEVICE" --no-progress \
    --metrics "$tmp/$s.jsonl" --plot "$tmp/$s.png" 2>/dev/null
  python3 - "$tmp/$s.jsonl" "$s" <<'PY'
import json, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
m = s["median"]
print(f"| {sys.argv[2]:<8} | {m['step_ms']:8.2f} | {m['compute_ms']:8.2f} | {m['comm_ms']:8.2f} | {m['optim_ms']:8.2f} | {100*m['comm_ms']/m['step_ms']:7.1f}% | {m['sent_bytes']/1e3:10.1f} |")
PY
done
