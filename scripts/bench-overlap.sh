#!/usr/bin/env bash
# Overlap of gradient reductions with backward (`train --overlap off|on`), same run, same seed:
# per strategy, the median step, compute and exposed communication (comm_ms: time waited),
# the communication thread's busy time, the hidden share, and what overlap changed (exposed
# communication cut, step ratio, the largest per-step loss difference). Medians over the
# steps after the first.
#
#   scripts/bench-overlap.sh [train args...]            # 2 local node processes on loopback
#   NET=tbf RATE=200mbit scripts/bench-overlap.sh ...   # 2 network namespaces, tbf-shaped (root)
#
# Env: NET (loopback | tbf), NODES and RANKS (loopback: node processes and ranks per node,
# default 2 x 1), RATE (tbf), STEPS (default 12), STRATEGIES (default "ddp zero2"), BIN (the
# wiretrain binary; default the debug build), CSV (append the rows to this file), LIMIT
# (seconds per run, default 300). Train args default to char-lm on the CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."
T=${CARGO_TARGET_DIR:-$(pwd)/target}
export BIN=${BIN:-$T/debug/wiretrain}
[ -x "$BIN" ] || { echo "bench-overlap: no wiretrain binary at $BIN (cargo build, or set BIN)"; exit 2; }
NET=${NET:-loopback}
STEPS=${STEPS:-12}
LIMIT=${LIMIT:-300}
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--example char-lm --device cpu)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

run() { # run STRATEGY OVERLAP: one training run's metrics into $tmp/S-O.jsonl
  local m="$tmp/$1-$2.jsonl"
  local train=(--strategy "$1" --overlap "$2" --steps "$STEPS" --seed 1 --no-progress
    --metrics "$m" --plot "$tmp/$1-$2.png" "${args[@]}")
  if [ "$NET" = tbf ]; then
    SUB=train LIMIT=$LIMIT scripts/lab-tbf.sh "${train[@]}" >"$tmp/log" 2>&1 || { cat "$tmp/log"; return 1; }
  else
    timeout "$LIMIT" "$BIN" launch --local "${NODES:-2}" --ranks-per-node "${RANKS:-1}" -- \
      train "${train[@]}" >"$tmp/log" 2>&1 || { cat "$tmp/log"; return 1; }
  fi
}

where="$NET"
[ "$NET" = tbf ] && where="tbf ${RATE:-1gbit}, 2 x 1" || where="loopback, ${NODES:-2} x ${RANKS:-1}"
echo "# $(date -u +%FT%TZ) $(nproc) cores; $where; $STEPS steps; train ${args[*]}"
for s in ${STRATEGIES:-ddp zero2}; do
  for o in off on; do run "$s" "$o"; done
done
python3 - "$tmp" "$where" "${CSV:-}" ${STRATEGIES:-ddp zero2} <<'PY'
import json, os, statistics, sys
tmp, where, csv, strategies = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def load(s, o):
    rows = [json.loads(l) for l in open(f"{tmp}/{s}-{o}.jsonl") if l.strip()]
    steps = [r for r in rows if not r.get("summary")]
    summary = rows[-1]
    assert summary.get("summary") and summary["overlap"] == (o == "on"), (s, o, summary.get("overlap"))
    med = lambda k: statistics.median(r[k] for r in steps[1:])
    return {k: med(k) for k in ["step_ms", "compute_ms", "comm_ms", "comm_busy_ms", "hidden_share"]}, [r["loss"] for r in steps]
cols = ["step_ms", "compute_ms", "comm_ms", "comm_busy_ms", "hidden_share"]
print("| strategy | overlap | step ms | compute ms | exposed comm ms | comm busy ms | hidden | exposed cut | step on/off | max loss diff |")
print("|---|---|---|---|---|---|---|---|---|---|")
out = []
for s in strategies:
    (off, loff), (on, lon) = load(s, "off"), load(s, "on")
    cut = 1 - on["comm_ms"] / off["comm_ms"] if off["comm_ms"] > 0 else float("nan")
    ratio = on["step_ms"] / off["step_ms"]
    diff = max(abs(a - b) / abs(a) for a, b in zip(loff, lon))
    for o, m in [("off", off), ("on", on)]:
        tail = f"{cut:.0%} | {ratio:.2f} | {diff:.1e}" if o == "on" else " | | "
        print(f"| {s} | {o} | " + " | ".join(f"{m[c]:.2f}" if c == "hidden_share" else f"{m[c]:.1f}" for c in cols) + f" | {tail} |")
        out.append([where, s, o] + [f"{m[c]:.3f}" for c in cols] + ([f"{cut:.3f}", f"{ratio:.3f}", f"{diff:.2e}"] if o == "on" else ["", "", ""]))
if csv:
    new = not os.path.exists(csv)
    with open(csv, "a") as f:
        if new:
            f.write("net,strategy,overlap," + ",".join(cols) + ",exposed_cut,step_ratio,max_loss_diff\n")
        for r in out:
            f.write(",".join(f'"{x}"' if "," in x else x for x in r) + "\n")
PY
