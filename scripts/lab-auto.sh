#!/usr/bin/env bash
# `train --strategy auto` in the lab: at each link rate, two network namespaces joined by a
# tbf-shaped veth pair (scripts/lab-tbf.sh), one node of RANKS ranks in each. First the auto
# run (it measures the wiring, plans, picks and trains), then a run of every strategy it could
# have picked; one CSV row per run: the measured mean step (steps after the first, so DiLoCo's
# outer steps count), the step auto's plan predicted for it, and whether auto picked it.
# Needs root (ip netns, tc). Every run is bounded (LIMIT seconds).
#
#   scripts/lab-auto.sh            # RATES "1000 20": writes $OUT and prints the table
#
# Env: RATES (Mbit/s, default "1000 20"), RANKS (2), STEPS (8), INNER (DiLoCo's inner steps, 4),
#      ALLOW ("" or diloco: what auto may pick; diloco adds DiLoCo's two runs), STRATEGIES ("ddp zero1
#      zero2 zero3 hybrid hsdp"), EXTRA (train flags, default char-lm on the CPU backend),
#      BIN (the wiretrain binary), OUT (CSV path), LIMIT (300).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${CARGO_TARGET_DIR:-$(pwd)/target}
export BIN=${BIN:-$T/debug/wiretrain}
RATES=${RATES:-"1000 20"}; RANKS=${RANKS:-2}; STEPS=${STEPS:-8}; INNER=${INNER:-4}
STRATEGIES=${STRATEGIES:-"ddp zero1 zero2 zero3 hybrid hsdp"}; ALLOW=${ALLOW:-}
EXTRA=${EXTRA:-"--example char-lm --device cpu --global-batch 32"}
OUT=${OUT:-lab-auto-$(date +%Y%m%d-%H%M%S).csv}
export LIMIT=${LIMIT:-300}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

train() { # train NAME ARGS...: one run between the namespaces; its metrics in $tmp/NAME.jsonl
  local name=$1; shift
  # shellcheck disable=SC2086
  if ! SUB=train scripts/lab-tbf.sh "$@" --ranks-per-node "$RANKS" --steps "$STEPS" --seed 1 \
      --no-progress $EXTRA --metrics "$tmp/$name.jsonl" --plot "$tmp/$name.png" >"$tmp/$name.log" 2>&1; then
    cat "$tmp/$name.log"; return 1
  fi
}

echo "rate_mbit,strategy,picked,mean_step_ms,predicted_step_ms,measure_s" >"$OUT"
for rate in $RATES; do
  export RATE="${rate}mbit"
  allow=(); [ -n "$ALLOW" ] && allow=(--allow "$ALLOW" --inner-steps "$INNER")
  train auto --strategy auto "${allow[@]}"
  grep -h "strategy auto" "$tmp/auto.log" | sed "s/^/# $rate Mbit\/s: /" || true
  runs=$STRATEGIES
  [ "$ALLOW" = diloco ] && runs="$runs diloco diloco-hybrid"
  for st in $runs; do
    case $st in
      diloco) train "$st" --strategy diloco --inner-steps "$INNER" ;;
      diloco-hybrid) train "$st" --strategy diloco --inner-strategy hybrid --inner-steps "$INNER" ;;
      *) train "$st" --strategy "$st" ;;
    esac
  done
  python3 - "$tmp" "$rate" "$runs" >>"$OUT" <<'PY'
import json, statistics, sys
tmp, rate, runs = sys.argv[1], sys.argv[2], sys.argv[3].split()
def load(name):
    rows = [json.loads(l) for l in open(f"{tmp}/{name}.jsonl") if l.strip()]
    return [r for r in rows if not r.get("summary")], rows[-1]
steps, auto = load("auto")
pick = auto["auto"]
plans = {p["name"]: p for p in pick["plans"]}
for st in runs:
    s, _ = load(st)
    mean = statistics.mean(r["step_ms"] for r in s[1:])
    print(f"{rate},{st},{int(pick['name'] == st)},{mean:.3f},{plans[st]['step_s'] * 1e3:.3f},{pick['measured']['seconds']:.3f}")
PY
done
python3 - "$OUT" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print("| link | strategy | measured mean step ms | predicted ms | picked |")
print("|---|---|---|---|---|")
for r in rows:
    print(f"| {r['rate_mbit']} Mbit/s | {r['strategy']} | {float(r['mean_step_ms']):.1f} | {float(r['predicted_step_ms']):.1f} | {'**auto**' if r['picked'] == '1' else ''} |")
for rate in dict.fromkeys(r["rate_mbit"] for r in rows):
    rs = [r for r in rows if r["rate_mbit"] == rate]
    best = min(rs, key=lambda r: float(r["mean_step_ms"]))
    pick = [r for r in rs if r["picked"] == "1"]
    if pick:
        ratio = float(pick[0]["mean_step_ms"]) / float(best["mean_step_ms"])
        print(f"# {rate} Mbit/s: auto picked {pick[0]['strategy']}, the fastest measured is {best['strategy']}: pick/fastest {ratio:.3f}; measuring took {float(pick[0]['measure_s']):.1f} s")
PY
echo "lab-auto: wrote $OUT"
