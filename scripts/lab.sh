#!/usr/bin/env bash
# The wiring lab: NODES network namespaces ("nodes") joined through a bridge (in a hub
# namespace) by veth pairs, each node's link shaped with `tc tbf` in both directions; real
# training runs of every strategy at every link rate; one CSV row per run with the measured
# step and, beside it, what `wiretrain plan` predicts for that run, calibrated on this machine
# by `wiretrain bench` alone: the compute rate by `--op compute`, the link rate and latency at
# each rate (unshaped too) by `--op p2p` between two of the namespaces.
# Needs root (ip netns, tc). Cleans up after itself; every run is bounded (LIMIT seconds).
#
#   scripts/lab.sh            # defaults below; writes $OUT and prints it
#
# Env: NODES (2), RATES ("none 1000 200 50", Mbit/s, none = unshaped), STRATEGIES
#      ("ddp zero1 zero2 zero3 hybrid hsdp"), EXAMPLE (char-lm), EXTRA (model flags, given to both
#      train and bench --op compute; default "--d-model 256": 1.6M parameters, so
#      communication matters), STEPS (10), BATCH (32),
#      LIMIT (300),
#      BIN (the wiretrain binary), OUT (CSV path). STRATEGIES may name diloco (inner ddp, H =
#      INNER inner steps, default 4): its row's step is the mean after the first (its outer
#      steps are periodic), the others' the median.
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=${NODES:-2}; RATES=${RATES:-"none 1000 200 50"}; STEPS=${STEPS:-10}; BATCH=${BATCH:-32}
STRATEGIES=${STRATEGIES:-"ddp zero1 zero2 zero3 hybrid hsdp"}; EXAMPLE=${EXAMPLE:-char-lm}
EXTRA=${EXTRA:---d-model 256}; LIMIT=${LIMIT:-300}
OUT=${OUT:-lab-$(date +%Y%m%d-%H%M%S).csv}

# shellcheck source=scripts/lab-net.sh
source "$(dirname "$0")/lab-net.sh"

INNER=${INNER:-4}
run() { # $1 strategy, $2 metrics file
  export WIRETRAIN_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d " \n")
  rm -f "$tmp/addr"
  local args=(train --example "$EXAMPLE" --strategy "$1" --steps "$STEPS" --global-batch "$BATCH"
              --device cpu --no-progress --nnodes "$NODES")
  [ "$1" = diloco ] && args+=(--inner-steps "$INNER")
  # shellcheck disable=SC2206
  args+=($EXTRA)
  ip netns exec "$(ns 0)" timeout "$LIMIT" "$BIN" "${args[@]}" --node-rank 0 \
    --master "$net.1:0" --addr-file "$tmp/addr" --metrics "$2" >/dev/null 2>"$tmp/err0" &
  local pids=($!)
  for _ in $(seq 1 3000); do [ -s "$tmp/addr" ] && break; sleep 0.01; done
  [ -s "$tmp/addr" ] || { echo "lab: node 0 never listened"; cat "$tmp/err0"; return 1; }
  for i in $(seq 1 $((NODES - 1))); do
    ip netns exec "$(ns "$i")" timeout "$LIMIT" "$BIN" "${args[@]}" --node-rank "$i" \
      --master "$(cat "$tmp/addr")" --bind "$net.$((i + 1)):0" >/dev/null 2>"$tmp/err$i" &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  [ "$rc" = 0 ] || { echo "lab: $1 failed"; cat "$tmp"/err*; return 1; }
}

# Calibration by wiretrain itself, before any run: `wiretrain bench --op compute` gives the
# compute rate (the example's step in NODES processes at once), `wiretrain bench --op p2p`
# between two namespaces gives the link rate and per-message latency at each rate (unshaped
# too). Every row, unshaped included, is then a prediction from these figures alone.
cal=$(compute_tflops "$NODES" 1 $((BATCH / NODES)))
read -r tflops seq <<<"$cal"
echo "calibration: wiretrain bench --op compute: $tflops TFLOP/s per process ($NODES at once)"
echo "rate_mbit,strategy,nodes,params,step_ms,compute_ms,comm_ms,optim_ms,sent_bytes,samples_per_s,predicted_step_ms,predicted_over_measured,link_gbps_measured,latency_us_measured,tflops_measured" > "$OUT"
for rate in $RATES; do
  shape "$rate"
  if [ "$NODES" -ge 2 ]; then
    measured=$(link)
    read -r gbps lat <<<"$measured"
    echo "rate ${rate} Mbit/s: wiretrain bench --op p2p measures $gbps Gbit/s, $lat us per message"
  else
    gbps=1000; lat=0 # one node: no link; the planner sees no inter-node traffic
  fi
  for st in $STRATEGIES; do
    run "$st" "$tmp/m.jsonl"
    row=$(python3 - "$tmp/m.jsonl" "$rate" "$st" "$NODES" "$BATCH" <<'PY'
import json, sys
m, rate, st, nodes, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
lines = [json.loads(l) for l in open(m).read().splitlines()]
s = lines[-1]
md = dict(s["median"])
if st == "diloco":  # periodic outer steps: the mean over the steps after the first
    steps = [r for r in lines if not r.get("summary")][1:]
    for k in ["step_ms", "compute_ms", "comm_ms", "optim_ms", "sent_bytes"]:
        md[k] = sum(r[k] for r in steps) / len(steps)
print(",".join(str(x) for x in [rate, st, nodes, s["params_total"], md["step_ms"], md["compute_ms"],
      md["comm_ms"], md["optim_ms"], md["sent_bytes"], batch / (md["step_ms"] / 1e3)]))
PY
)
    IFS=, read -r _ _ _ params step _ <<<"$row"
    units=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1]).get("units_effective") or 1)' "$tmp/m.jsonl")
    pred=$(python3 - "$BIN" "$params" "$NODES" "$BATCH" "$seq" "$st" "$tflops" "$gbps" "$lat" "$units" "$INNER" <<'PY'
import json, subprocess, sys
b, params, nodes, batch, seq, st = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
tflops, gbps, lat, units = sys.argv[7:11]
# (The planner charges ZeRO-3 and HSDP their recomputed unit forwards itself: 8 psi per token;
# the model's effective unit count, a fact of its structure, tells it how reductions overlap.)
extra = ["--units", units] + (["--diloco", sys.argv[11]] if st == "diloco" else [])
out = subprocess.run([b, "plan", "--params", str(params), "--nodes", str(nodes), "--gpus-per-node", "1",
    "--seq", seq, "--micro-batch", str(batch // nodes), "--global-batch", str(batch), "--precision", "f32",
    "--wire", "f32", "--tflops", tflops, "--inter-gbps", gbps, "--inter-latency-us", lat,
    "--device-mem", "1000", "--json"] + extra, capture_output=True, text=True, check=True).stdout
p = {json.loads(l)["name"]: json.loads(l) for l in out.splitlines()}[st]
print(p["step_s"] * 1e3)
PY
)
    ratio=$(python3 -c "print(f'{$pred/$step:.3f}')")
    echo "$row,$pred,$ratio,$gbps,$lat,$tflops" >> "$OUT"
    echo "rate ${rate} ${st}: step ${step} ms, predicted ${pred} ms (x${ratio})"
  done
done
echo "lab: wrote $OUT"
