#!/usr/bin/env bash
# DiLoCo against DDP on slow wiring: two network namespaces joined by a veth shaped with
# `tc tbf` (20 Mbit/s each way by default), one node (one rank) in each, char-lm on Burn's CPU
# backend, the same steps and global batch (equal tokens). Prints, per strategy, the final
# loss (mean of the last 10 steps), the bytes node 0 sent to the other node, and tokens/s;
# then the ratios. Needs root (see lab-tbf.sh).
#
#   scripts/bench-diloco.sh [out.jsonl]    # RATE=20mbit STEPS=300 H=25 BIN=...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-/dev/stdout}
export RATE=${RATE:-20mbit} LIMIT=${LIMIT:-900} SUB=train
STEPS=${STEPS:-300}; H=${H:-25}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
common=(--example char-lm --steps "$STEPS" --device cpu --no-progress)
"$here/lab-tbf.sh" "${common[@]}" --strategy ddp --metrics "$tmp/ddp.jsonl" >/dev/null
"$here/lab-tbf.sh" "${common[@]}" --strategy diloco --inner-steps "$H" --outer-lr 1.0 \
  --outer-momentum 0.5 --wire-dtype int8 --metrics "$tmp/diloco.jsonl" >/dev/null
python3 - "$tmp" "$RATE" <<'PY' > "$out"
import json, sys
d, rate = sys.argv[1], sys.argv[2]
res = {}
for s in ("ddp", "diloco"):
    rows = [json.loads(l) for l in open(f"{d}/{s}.jsonl")]
    steps = [r for r in rows if "summary" not in r]
    summ = rows[-1]
    tokens = summ["global_batch"] * 64  # char-lm: 64 tokens per sample
    res[s] = {
        "strategy": s, "rate": rate, "steps": len(steps),
        "final_loss": sum(r["loss"] for r in steps[-10:]) / 10,
        "inter_node_bytes": sum(r["sent_bytes"] for r in steps),
        "tokens_per_s": summ["samples_per_s"] * 64,
        "diloco": summ.get("diloco"), "wire_dtype": summ.get("wire_dtype"),
    }
    print(json.dumps(res[s]))
a, b = res["ddp"], res["diloco"]
print(json.dumps({
    "loss_vs_ddp": round(b["final_loss"] / a["final_loss"] - 1, 4),
    "bytes_ratio": round(a["inter_node_bytes"] / b["inter_node_bytes"], 1),
    "tokens_per_s_ratio": round(b["tokens_per_s"] / a["tokens_per_s"], 2),
}))
PY
