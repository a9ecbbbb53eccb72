#!/usr/bin/env bash
# Speed-proportional batches against an equal split: two node processes on loopback, one rank
# each, each pinned to its own core (taskset) with one compute thread, so neither can borrow
# the other's core and the slowdown is exactly the knob's: rank 1 computes FACTOR times slower
# (WIRETRAIN_DEBUG_SLOWDOWN), as a slower card would. char-lm on Burn's CPU backend.
# Prints samples/s (global batch over the leader's wall time per loop iteration, median over
# the steps after the first 10) for --balance equal and --balance speed, and their ratio.
#
#   scripts/bench-balance.sh      # FACTOR=2 STEPS=40 BATCH=128 BIN=target/debug/wiretrain
set -euo pipefail
FACTOR=${FACTOR:-2}; STEPS=${STEPS:-40}; BATCH=${BATCH:-128}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/debug/wiretrain}
command -v taskset >/dev/null || { echo "bench-balance: needs taskset (util-linux)"; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
export RAYON_NUM_THREADS=1 WIRETRAIN_DEBUG_SLOWDOWN=1:$FACTOR
export WIRETRAIN_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d " \n")
for b in equal speed; do
  args=(train --example char-lm --steps "$STEPS" --global-batch "$BATCH" --device cpu
        --no-progress --balance "$b" --nnodes 2)
  rm -f "$tmp/addr"
  timeout 600 taskset -c 0 "$BIN" "${args[@]}" --node-rank 0 --master 127.0.0.1:0 \
    --addr-file "$tmp/addr" --metrics "$tmp/$b.jsonl" >/dev/null 2>&1 &
  p0=$!
  for _ in $(seq 1 3000); do [ -s "$tmp/addr" ] && break; sleep 0.01; done
  timeout 600 taskset -c 1 "$BIN" "${args[@]}" --node-rank 1 --master "$(cat "$tmp/addr")" \
    >/dev/null 2>&1
  wait "$p0"
done
python3 - "$tmp" "$FACTOR" "$BATCH" <<'PY'
import json, statistics, sys
d, factor, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
res = {}
for b in ("equal", "speed"):
    rows = [json.loads(l) for l in open(f"{d}/{b}.jsonl")]
    steps = [r for r in rows if "summary" not in r]
    wall = statistics.median(r["wall_ms"] for r in steps[10:])
    res[b] = batch / (wall / 1e3)
    print(json.dumps({"balance": b, "slowdown": float(factor), "samples_per_s": round(res[b], 1),
                      "final_loss": steps[-1]["loss"], "last_shares": steps[-1].get("shares")}))
print(json.dumps({"speedup": round(res["speed"] / res["equal"], 3)}))
PY
