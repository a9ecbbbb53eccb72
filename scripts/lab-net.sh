# Sourced by the lab scripts (scripts/lab.sh, scripts/lab-placement.sh): NODES network
# namespaces ("nodes") joined through a bridge in a hub namespace by veth pairs; node i has
# address $net.(i+1) on its eth0. `ns I` names node I's namespace, `shape RATE` puts a tbf of
# RATE Mbit/s (or none) on both ends of every node's veth, `job` runs node processes of one
# wiretrain job in chosen namespaces, `link` measures the link between namespaces 0 and 1
# with `wiretrain bench --op p2p`, `compute_tflops` the compute rate with `wiretrain bench
# --op compute`; everything is removed on exit.
# The caller sets NODES. Checks for root, iproute2 and the binary ($BIN, default the debug
# build) first: exit 77 (skip) without root or iproute2, 2 without the binary.
BIN=${BIN:-${CARGO_TARGET_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target}/debug/wiretrain}
[ -x "$BIN" ] || { echo "lab: no wiretrain binary at $BIN"; exit 2; }
[ "$(id -u)" = 0 ] || { echo "lab: SKIP: needs root for ip netns and tc"; exit 77; }
command -v ip >/dev/null && command -v tc >/dev/null || { echo "lab: SKIP: iproute2 not installed"; exit 77; }
id=$$; hub="wtlab${id}hub"; net=10.215.$((id % 250))
tmp=$(mktemp -d)
ns() { echo "wtlab${id}n$1"; }
cleanup() {
  for i in $(seq 0 $((NODES - 1))); do
    ip netns pids "$(ns "$i")" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$(ns "$i")" 2>/dev/null || true
  done
  ip netns del "$hub" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
ip netns add "$hub" 2>/dev/null || { echo "lab: SKIP: cannot create network namespaces here"; exit 77; }
ip -n "$hub" link add br0 type bridge
ip -n "$hub" link set br0 up
for i in $(seq 0 $((NODES - 1))); do
  n=$(ns "$i")
  ip netns add "$n"
  ip link add "wt${id}v$i" type veth peer name "wt${id}h$i"
  ip link set "wt${id}v$i" netns "$n"
  ip link set "wt${id}h$i" netns "$hub"
  ip -n "$n" link set "wt${id}v$i" name eth0
  ip -n "$n" addr add "$net.$((i + 1))/24" dev eth0
  ip -n "$n" link set lo up
  ip -n "$n" link set eth0 up
  ip -n "$hub" link set "wt${id}h$i" master br0
  ip -n "$hub" link set "wt${id}h$i" up
done

shape() { # $1 = Mbit/s or none: tbf on both ends of every node's veth
  local rate=$1 i where dev
  for i in $(seq 0 $((NODES - 1))); do
    for side in "$(ns "$i") eth0" "$hub wt${id}h$i"; do
      read -r where dev <<<"$side"
      tc -n "$where" qdisc del dev "$dev" root 2>/dev/null || true
      # A bucket of 2 ms of traffic (at least 32 KiB): steps cannot ride on a big burst.
      [ "$rate" = none ] && continue
      local burst=$(( rate * 1000000 / 8 / 500 )); [ "$burst" -ge 32768 ] || burst=32768
      tc -n "$where" qdisc add dev "$dev" root tbf rate "${rate}mbit" burst "$burst" latency 200ms
    done
  done
}

# `job PROCS RANKS_PER_NODE PLACEMENT ARGS...`: PROCS node processes of one job, process r in
# namespace PLACEMENT[r] (a string of digits), each with RANKS_PER_NODE ranks.
job() {
  local procs=$1 rpn=$2 place=$3; shift 3
  export WIRETRAIN_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d " \n")
  rm -f "$tmp/addr"
  local common=(--nnodes "$procs" --ranks-per-node "$rpn")
  local n0=${place:0:1}
  ip netns exec "$(ns "$n0")" timeout "$LIMIT" "$BIN" "$@" "${common[@]}" --node-rank 0 \
    --master "$net.$((n0 + 1)):0" --addr-file "$tmp/addr" >"$tmp/out0" 2>"$tmp/err0" &
  local pids=($!)
  for _ in $(seq 1 3000); do [ -s "$tmp/addr" ] && break; sleep 0.01; done
  [ -s "$tmp/addr" ] || { echo "lab: node 0 never listened" >&2; cat "$tmp/err0" >&2; return 1; }
  for r in $(seq 1 $((procs - 1))); do
    local n=${place:$r:1}
    ip netns exec "$(ns "$n")" timeout "$LIMIT" "$BIN" "$@" "${common[@]}" --node-rank "$r" \
      --master "$(cat "$tmp/addr")" --bind "$net.$((n + 1)):0" >"$tmp/out$r" 2>"$tmp/err$r" &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  [ "$rc" = 0 ] || { echo "lab: job failed" >&2; cat "$tmp"/err* >&2; return 1; }
}

link() { # measured by wiretrain: p2p between namespaces 0 and 1 -> "Gbit/s latency_us"
  # (the rate from 4 MiB messages, the per-message latency from 4 KiB ones)
  job 2 1 01 bench --op p2p --bytes 4K,4M --iters 9 --warmup 1 --json || return 1
  python3 - "$tmp/out0" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
big = max(rows, key=lambda r: r["bytes"])
small = min(rows, key=lambda r: r["bytes"])
print(big["busbw_gbps"] * 8, small["time_us"])
PY
}


# `compute_tflops PROCS RANKS_PER_NODE SAMPLES`: the training compute rate measured by
# `wiretrain bench --op compute` (the example's whole step, EXTRA's model flags, SAMPLES per
# rank) in PROCS processes of RANKS_PER_NODE ranks at once, sharing the cores as the runs do;
# prints the step's TFLOP/s by the planner's 6·Ψ·tokens model.
compute_tflops() {
  # shellcheck disable=SC2086
  timeout "$LIMIT" "$BIN" bench --op compute --local "$1" --ranks-per-node "$2" --batch "$3" \
    --example "$EXAMPLE" $EXTRA --device cpu --iters 5 --warmup 1 --json >"$tmp/compute" 2>"$tmp/compute.err" \
    || { echo "lab: bench --op compute failed" >&2; cat "$tmp/compute.err" >&2; return 1; }
  python3 - "$tmp/compute" <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")][-1]
print(r["step_tflops"], r["seq"])
PY
}
