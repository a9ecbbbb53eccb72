#!/usr/bin/env bash
# Wire dtypes against a shaped link: all-reduce of 64 MiB of f32 gradients between two network
# namespaces whose veth is shaped with `tc tbf` (1 Gbit/s each way by default), with f32, bf16
# and int8 on the wire, measured in one run (same link, same binary). Prints one JSON row per
# dtype and a summary with the speed-ups against f32. Needs root (see lab-tbf.sh).
#
#   scripts/bench-wire.sh [out.jsonl]
#
# Env: RATE (default 1gbit), BYTES (default 64M), ITERS (default 5), BIN (wiretrain binary).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-/dev/stdout}
RATE=${RATE:-1gbit}; BYTES=${BYTES:-64M}; ITERS=${ITERS:-5}
export RATE
tmp=$(mktemp); trap 'rm -f "$tmp"' EXIT
for w in f32 bf16 int8; do
  "$here/lab-tbf.sh" --op all-reduce --bytes "$BYTES" --iters "$ITERS" --warmup 1 \
    --check --json --wire-dtype "$w" | grep '^{' >> "$tmp"
done
python3 - "$tmp" "$RATE" <<'PY' > "$out"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = next(r for r in rows if r["wire"] == "f32")
for r in rows:
    r["rate"] = sys.argv[2]
    r["speedup_vs_f32"] = round(base["time_us"] / r["time_us"], 3)
    r["wire_bytes_vs_f32"] = round(r["wire_bytes"] / base["wire_bytes"], 4)
    print(json.dumps(r))
PY
