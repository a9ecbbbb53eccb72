#!/usr/bin/env bash
# The wiring lab, smallest form: two network namespaces joined by a veth pair whose both
# directions are shaped with `tc qdisc ... tbf`, and `wiretrain bench` (or `train`, SUB=train)
# with one node in each.
# Needs root (ip netns, tc). Cleans up after itself, also on failure. Every run is bounded.
#
#   RATE=1gbit scripts/lab-tbf.sh --op p2p,all-reduce,all-gather,reduce-scatter --bytes 16M,64M
#
# Env: RATE (tbf rate, default 1gbit), MTU (the veth MTU, default 1500; 9000 = jumbo), BIN (wiretrain binary, default the release build),
#      LIMIT (seconds per node process, default 300), SUB (bench or train, default bench; tcp:
#      the kernel TCP reference instead of wiretrain, N MiB each way at once, default 256),
#      QLAT (tbf queue as latency at the rate, default 50ms),
#      PIN (default 1: node 0 runs on the first half of the cores, node 1 on the second, as on
#      two machines; 0 lets both share every core).
#      CUT_AFTER (seconds: then `ip link set down` node 0's veth, the link-cut fault test, and
#      report how long after the cut each node exited and with what code).
#      Arguments go to `wiretrain $SUB`.
set -euo pipefail
RATE=${RATE:-1gbit}
MTU=${MTU:-1500}
QLAT=${QLAT:-50ms}
PIN0=; PIN1=
ncpu=$(nproc)
if [ "${PIN:-1}" = 1 ] && [ "$ncpu" -ge 2 ] && command -v taskset >/dev/null; then
  PIN0="taskset -c 0-$(( ncpu / 2 - 1 ))"; PIN1="taskset -c $(( ncpu / 2 ))-$(( ncpu - 1 ))"
fi
SUB=${SUB:-bench}
LIMIT=${LIMIT:-300}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release/wiretrain}
if [ "$SUB" = tcp ]; then
  command -v python3 >/dev/null || { echo "lab-tbf: SKIP: no python3 for SUB=tcp"; exit 77; }
else
  [ -x "$BIN" ] || { echo "lab-tbf: no wiretrain binary at $BIN (cargo build --release, or set BIN)"; exit 2; }
fi
[ "$(id -u)" = 0 ] || { echo "lab-tbf: SKIP: needs root for ip netns and tc"; exit 77; }
command -v ip >/dev/null && command -v tc >/dev/null || { echo "lab-tbf: SKIP: ip/tc (iproute2) not installed"; exit 77; }

id=$$
ns0="wtlab${id}a"; ns1="wtlab${id}b"; va="wt${id}a"; vb="wt${id}b"
a_ip=10.213.$((id % 250)).1; b_ip=10.213.$((id % 250)).2
tmp=$(mktemp -d)
cleanup() {
  ip netns pids "$ns0" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  ip netns pids "$ns1" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  ip netns del "$ns0" 2>/dev/null || true
  ip netns del "$ns1" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
if ! ip netns add "$ns0" 2>/dev/null; then echo "lab-tbf: SKIP: cannot create network namespaces here"; exit 77; fi
ip netns add "$ns1"
ip link add "$va" type veth peer name "$vb"
ip link set "$va" netns "$ns0"
ip link set "$vb" netns "$ns1"
ip -n "$ns0" addr add "$a_ip/24" dev "$va"
ip -n "$ns1" addr add "$b_ip/24" dev "$vb"
for ns in "$ns0" "$ns1"; do ip -n "$ns" link set lo up; done
ip -n "$ns0" link set "$va" mtu "$MTU" up
ip -n "$ns1" link set "$vb" mtu "$MTU" up
tc -n "$ns0" qdisc add dev "$va" root tbf rate "$RATE" burst 128kb latency "$QLAT"
tc -n "$ns1" qdisc add dev "$vb" root tbf rate "$RATE" burst 128kb latency "$QLAT"
echo "# lab-tbf: veth $a_ip <-> $b_ip, MTU $MTU, tbf rate $RATE each way, queue $QLAT${PIN0:+, nodes pinned to ${PIN0#taskset -c } and ${PIN1#taskset -c }}"

if [ "$SUB" = tcp ]; then
  pump="$(cd "$(dirname "$0")" && pwd)/tcp-pump.py"
  echo "# kernel TCP, both directions at once"
  ip netns exec "$ns0" $PIN0 timeout "$LIMIT" python3 "$pump" server "$a_ip" "${N:-256}" &
  p0=$!
  ip netns exec "$ns1" $PIN1 timeout "$LIMIT" python3 "$pump" client "$a_ip" "${N:-256}"
  wait "$p0"
  exit 0
fi

export WIRETRAIN_TOKEN=${WIRETRAIN_TOKEN:-$(od -An -N32 -tx1 /dev/urandom | tr -d " \n")}
ip netns exec "$ns0" $PIN0 timeout "$LIMIT" "$BIN" "$SUB" "$@" --nnodes 2 --node-rank 0 \
  --master "$a_ip:0" --addr-file "$tmp/addr" &
p0=$!
for _ in $(seq 1 3000); do [ -s "$tmp/addr" ] && break; sleep 0.01; done
[ -s "$tmp/addr" ] || { echo "lab-tbf: node 0 never listened"; exit 1; }
ip netns exec "$ns1" $PIN1 timeout "$LIMIT" "$BIN" "$SUB" "$@" --nnodes 2 --node-rank 1 \
  --master "$(cat "$tmp/addr")" --bind "$b_ip:0" >/dev/null &
p1=$!
if [ -n "${CUT_AFTER:-}" ]; then
  sleep "$CUT_AFTER"
  kill -0 "$p0" 2>/dev/null && kill -0 "$p1" 2>/dev/null || { echo "lab-tbf: a node ended before the cut"; exit 1; }
  ip -n "$ns0" link set "$va" down
  t_cut=$(date +%s%N)
  echo "# cut: link down"
  for i in 0 1; do
    if [ "$i" = 0 ]; then p=$p0; else p=$p1; fi
    r=0; wait "$p" || r=$?
    echo "# cut: node $i exited with $r, $(( ($(date +%s%N) - t_cut) / 1000000 )) ms after the link went down"
  done
  exit 0
fi
rc=0
wait "$p0" || rc=$?
wait "$p1" || rc=$?
# What the shaped queues did (drops = packets tbf refused because its queue was full).
for d in "$ns0 $va" "$ns1 $vb"; do
  set -- $d
  echo "# tbf $2: $(tc -n "$1" -s qdisc show dev "$2" | grep -o 'Sent.*overlimits [0-9]*')"
  # UDP datagrams the receiving socket had no room for (its receive buffer was full).
  echo "# udp $2: $(ip netns exec "$1" awk '/^Udp:/ { if (!h) { split($0, k); h = 1 } else { for (i = 2; i <= NF; i++) if (k[i] == "RcvbufErrors" || k[i] == "InDatagrams") printf "%s %s ", k[i], $i } }' /proc/net/snmp)"
done
exit "$rc"
