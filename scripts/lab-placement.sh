#!/usr/bin/env bash
# Topology-aware placement, shown: 2 namespaced nodes x 2 ranks with a tbf-shaped link, the
# same DDP training in two rank orders, measured, and what `wiretrain plan` predicts for each:
#   node-major  2 node processes (one per namespace) x 2 ranks: ring neighbours inside the node
#               (shared memory), one cross-node ring per local rank (wiretrain's order);
#   scrambled   4 single-rank node processes, ranks 0 and 2 in namespace 0 and ranks 1 and 3 in
#               namespace 1: a flat ring in which every neighbour is across the link.
# Calibration by wiretrain itself: `wiretrain bench --op p2p` between the two namespaces at
# each rate gives the link rate and latency the planner is fed (not the nominal tbf rate), and
# `wiretrain bench --op compute` with 4 ranks at once the compute rate (as scripts/lab.sh does).
# Needs root (ip netns, tc); cleans up after itself; every run is bounded (LIMIT seconds).
#
#   scripts/lab-placement.sh        # writes $OUT (CSV) and prints the table
#
# Env: RATES ("200 50", Mbit/s), EXAMPLE (char-lm), EXTRA ("--d-model 256"), STEPS (8),
#      BATCH (32), LIMIT (300), BIN, OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=2; RATES=${RATES:-"200 50"}; STEPS=${STEPS:-8}; BATCH=${BATCH:-32}
EXAMPLE=${EXAMPLE:-char-lm}; EXTRA=${EXTRA:---d-model 256}; LIMIT=${LIMIT:-300}
OUT=${OUT:-placement-$(date +%Y%m%d-%H%M%S).csv}
# shellcheck source=scripts/lab-net.sh
source "$(dirname "$0")/lab-net.sh"

train() { # $1 order, $2 metrics file
  # shellcheck disable=SC2206
  local args=(train --example "$EXAMPLE" --strategy ddp --steps "$STEPS" --global-batch "$BATCH"
              --device cpu --no-progress --metrics "$2" $EXTRA)
  case $1 in
    node-major) job 2 2 01 "${args[@]}" ;;
    scrambled) job 4 1 0101 "${args[@]}" ;;
  esac
}

summary() { # metrics file -> "params step compute comm optim sent"
  python3 - "$1" <<'PY'
import json, sys
s = json.loads(open(sys.argv[1]).read().splitlines()[-1])
md = s["median"]
print(s["params_total"], md["step_ms"], md["compute_ms"], md["comm_ms"], md["optim_ms"], md["sent_bytes"])
PY
}

predict() { # params rate_gbps latency_us order -> predicted step ms
  python3 - "$BIN" "$BATCH" "$tflops" "$seq" "$@" <<'PY'
import json, subprocess, sys
b, batch, tflops, seq = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
params, gbps, lat, order = sys.argv[5], sys.argv[6], sys.argv[7], sys.argv[8]
out = subprocess.run([b, "plan", "--params", params, "--nodes", "2", "--gpus-per-node", "2",
    "--seq", seq, "--micro-batch", str(batch // 4), "--global-batch", str(batch),
    "--precision", "f32", "--wire", "f32", "--tflops", tflops, "--inter-gbps", gbps,
    "--inter-latency-us", lat, "--intra", "pcie4", "--device-mem", "1000",
    "--rank-order", order, "--json"], capture_output=True, text=True, check=True).stdout
p = {json.loads(l)["strategy"]: json.loads(l) for l in out.splitlines()}["ddp"]
print(p["step_s"] * 1e3)
PY
}

# Both orders run 4 ranks on the machine's cores: the compute rate is measured that way.
cal=$(compute_tflops 2 2 $((BATCH / 4)))
read -r tflops seq <<<"$cal"
echo "calibration: wiretrain bench --op compute: $tflops TFLOP/s per rank (4 ranks at once)"
echo "rate_mbit,link_gbps_measured,order,step_ms,compute_ms,comm_ms,sent_bytes,predicted_step_ms,predicted_over_measured" > "$OUT"
for rate in $RATES; do
  shape "$rate"
  measured=$(link)
  read -r gbps lat <<<"$measured"
  declare -A meas pred
  for order in node-major scrambled; do
    train "$order" "$tmp/m.jsonl"
    read -r params step compute comm _ sent <<<"$(summary "$tmp/m.jsonl")"
    p=$(predict "$params" "$gbps" "$lat" "$order")
    meas[$order]=$step; pred[$order]=$p
    ratio=$(python3 -c "print(f'{$p/$step:.3f}')")
    echo "$rate,$gbps,$order,$step,$compute,$comm,$sent,$p,$ratio" >> "$OUT"
    echo "rate $rate Mbit/s (measured $(printf %.3f "$gbps") Gbit/s) $order: step $step ms, predicted $p ms (x$ratio)"
  done
  python3 -c "print(f'rate $rate: scrambled / node-major step time: measured {${meas[scrambled]}/${meas[node-major]}:.2f}x, predicted {${pred[scrambled]}/${pred[node-major]}:.2f}x')"
done
echo "lab: wrote $OUT"
