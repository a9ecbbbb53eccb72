#!/usr/bin/env bash
# An elastic launch across three network namespaces ("machines" on a bridge, scripts/lab-net.sh),
# one `wiretrain launch --nnodes 2:3` agent in each, training the mlp example (ZeRO-2, a
# checkpoint every 10 steps): after CUT_AT metrics lines, the link of namespace 2 is cut
# (`ip link set eth0 down`). The two agents still connected restart without it and finish;
# the cut one loses the rendezvous and fails. Prints, for each agent, its exit code and when
# it exited (ms after the cut), then the metrics summary as JSON. Needs root (exit 77 without).
#
#   scripts/lab-elastic.sh            # BIN=target/debug/wiretrain, STEPS=300, CUT_AT=20
#
# Env: BIN, STEPS, CUT_AT, LIMIT (seconds per agent, default 240).
set -euo pipefail
NODES=3
STEPS=${STEPS:-300}
CUT_AT=${CUT_AT:-20}
LIMIT=${LIMIT:-240}
# shellcheck source=scripts/lab-net.sh
source "$(dirname "$0")/lab-net.sh"

export WIRETRAIN_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d " \n")
master="$net.1:29400"
m="$tmp/m.jsonl"
pids=()
for i in 0 1 2; do
  # Each agent's exit code and time (ms) go to a file of its own as it exits.
  (
    rc=0
    ip netns exec "$(ns "$i")" timeout "$LIMIT" "$BIN" launch --nnodes 2:3 --max-restarts 1 \
      --master "$master" --host "$net.$((i + 1))" --join-window 10 --grace 10 -- \
      train --example mlp --strategy zero2 --steps "$STEPS" --global-batch 24 --lr 0.01 \
      --seed 5 --device cpu --bucket-bytes 4096 --checkpoint-every 10 --checkpoint-keep 100 \
      --checkpoint-dir "$tmp/ck" --metrics "$m" --idle-timeout 3 --no-progress \
      >"$tmp/out$i" 2>"$tmp/err$i" || rc=$?
    echo "$rc $(date +%s%3N)" >"$tmp/rc$i"
  ) &
  pids+=($!)
  # Agents join in order (node i is agent i); agent 0 hosts the rendezvous.
  sleep 0.5
done
for _ in $(seq 1 6000); do
  [ -f "$m" ] && [ "$(wc -l <"$m")" -ge "$CUT_AT" ] && break
  sleep 0.02
done
[ -f "$m" ] && [ "$(wc -l <"$m")" -ge "$CUT_AT" ] || { echo "lab-elastic: no $CUT_AT steps" >&2; cat "$tmp"/err* >&2; exit 1; }
cut=$(date +%s%3N)
ip -n "$(ns 2)" link set eth0 down
echo "# cut: namespace 2 at $cut ms"
for i in 0 1 2; do
  wait "${pids[$i]}" || true
  read -r rc at <"$tmp/rc$i"
  echo "# agent $i: exit $rc after $(( at - cut )) ms"
done
for i in 0 1 2; do echo "== agent $i stderr" >&2; cat "$tmp/err$i" >&2; done
tail -n 1 "$m"
