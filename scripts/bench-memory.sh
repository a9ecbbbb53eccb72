#!/usr/bin/env bash
# Memory per rank against the ZeRO formulas, on a char-lm of ~50M parameters (d_model 1024,
# 4 blocks) across 4 node processes with one rank each (QUIC on loopback), CPU backend.
# For each strategy: the model-state bytes the rank accounts for (params + grads + optimizer
# state), the ZeRO paper's formula (f32 + Adam: 16 bytes per parameter in all), and the peak
# resident memory of each node process during the training steps (start-up excluded).
# Env: PROFILE (debug), STEPS (3), D_MODEL (1024), LAYERS (4), NODES (4).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${CARGO_TARGET_DIR:-$HOME/.cache/wiretrain-target}
BIN=${BIN:-$T/${PROFILE:-debug}/wiretrain}
NODES=${NODES:-4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "# $(date -u +%FT%TZ) $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB; char-lm d_model ${D_MODEL:-1024} x ${LAYERS:-4} blocks, $NODES nodes x 1 rank"
for s in ddp zero1 zero2 zero3 hybrid; do
  "$BIN" launch --local "$NODES" -- train --example char-lm --d-model "${D_MODEL:-1024}" \
    --layers "${LAYERS:-4}" --strategy "$s" --steps "${STEPS:-3}" --global-batch "$NODES" \
    --device cpu --no-progress --metrics "$tmp/$s.jsonl" --plot "$tmp/$s.png" 2>/dev/null
done
python3 - "$tmp" "$NODES" <<'PY'
import json, sys, os
tmp, n = sys.argv[1], int(sys.argv[2])
formula = {"ddp": lambda p: 16 * p, "zero1": lambda p: 8 * p + 8 * p / n,
           "zero2": lambda p: 4 * p + 12 * p / n, "zero3": lambda p: 16 * p / n,
           "hybrid": lambda p: 16 * p}  # one rank per node: hybrid replicates like DDP
# On top of the formula: ZeRO-2/hybrid hold one full gradient bucket; ZeRO-3 holds (1 + prefetch)
# units of full parameters and one unit of full gradient.
print("| strategy | Ψ (params) | formula MB | + buckets/units MB | accounted MB | accounted / (formula + units) | peak RSS MB per process (ranks 0..) |")
print("|---|---|---|---|---|---|---|")
for s in ["ddp", "zero1", "zero2", "zero3", "hybrid"]:
    summ = json.loads(open(os.path.join(tmp, s + ".jsonl")).read().strip().splitlines()[-1])
    p = summ["params_total"]
    ranks = summ["memory_per_rank"]
    acc = max(r["model_state_bytes"] for r in ranks)
    f = formula[s](p)
    unit = 4 * summ["largest_bucket_elems"]
    extra = {"zero2": unit, "hybrid": unit, "zero3": (2 + summ["prefetch"]) * unit}.get(s, 0)
    rss = " / ".join(f"{r['peak_rss_bytes'] / 1e6:.0f}" for r in ranks)
    print(f"| {s} | {p} | {f / 1e6:.1f} | {extra / 1e6:.1f} | {acc / 1e6:.1f} | {acc / (f + extra):.3f} | {rss} |")
PY
