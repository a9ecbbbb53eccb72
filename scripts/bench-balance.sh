#!/usr/bin/env bash
# Speed-proportional batches against an equal split: one node, two CPU-backend ranks, rank 1
# made FACTOR times slower (WIRETRAIN_DEBUG_SLOWDOWN), char-lm. Prints samples/s (global batch
# over the leader's wall time per loop iteration, median over the steps after the first 10) for
# --balance equal and --balance speed, and their ratio.
#
#   scripts/bench-balance.sh            # FACTOR=2 STEPS=60 BIN=target/debug/wiretrain
set -euo pipefail
FACTOR=${FACTOR:-2}; STEPS=${STEPS:-40}; BATCH=${BATCH:-256}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/debug/wiretrain}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# One compute thread per rank (two ranks, two cores): the ranks do not steal each other's cores,
# so the slowdown is the knob's factor and not contention.
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-1}
for b in equal speed; do
  WIRETRAIN_DEBUG_SLOWDOWN=1:$FACTOR "$BIN" launch --local 1 --ranks-per-node 2 -- train \
    --example char-lm --steps "$STEPS" --global-batch "$BATCH" --device cpu --no-progress --balance "$b" \
    --metrics "$tmp/$b.jsonl" >/dev/null 2>&1
done
python3 - "$tmp" "$FACTOR" "$BATCH" <<'PY'
import json, statistics, sys
d, factor = sys.argv[1], sys.argv[2]
res = {}
for b in ("equal", "speed"):
    rows = [json.loads(l) for l in open(f"{d}/{b}.jsonl")]
    steps = [r for r in rows if "summary" not in r]
    batch = sum(steps[-1]["shares"]) if steps[-1].get("shares") else None
    wall = statistics.median(r["wall_ms"] for r in steps[10:])
    res[b] = (batch or int(sys.argv[3])) / (wall / 1e3)
    last = steps[-1].get("shares")
    print(json.dumps({"balance": b, "slowdown": float(factor), "samples_per_s": round(res[b], 1),
                      "final_loss": steps[-1]["loss"], "last_shares": last}))
print(json.dumps({"speedup": round(res["speed"] / res["equal"], 3)}))
PY
