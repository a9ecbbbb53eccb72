#!/usr/bin/env bash
# Elastic restart times (docs/RELIABILITY.md): RUNS times, an elastic local launch of 3 nodes
# (ZeRO-2, the mlp example, a checkpoint every 10 steps) loses node 2 to kill -9 after 20
# steps; prints, per run, the seconds from the kill to the launcher seeing a node fail, from
# there to the new epoch's start (the survivors notice the lost peer within the idle timeout
# and exit), from that start to the new epoch's first step (start-up, rendezvous, resharded
# resume), the step resumed from and the steps lost, then the medians. Linux (/proc) only.
# MODE=agents runs the same job as an elastic launch across machines instead: three agents
# (`launch --nnodes 2:3 --master 127.0.0.1:PORT --host 127.0.0.x`), and kills agent 2 (its node
# dies with it, as with its machine); "the launcher sees" is then the rendezvous host seeing
# the first node fail or the agent fall silent. With GROW=1 (agents only), agent 2 is started
# again once epoch 1 runs, and the world grows back to 3 at the next restart point: the run
# adds the seconds from its join to the new epoch's start, from there to its first step, and
# the steps that growth lost.
# MODE=heal runs the local launch under DDP, where the survivors heal from their live replicas
# instead of restarting: "detect" is then a survivor's own failure (its idle timeout), "restart"
# the end of the heal (new epoch joined in-process, state agreed), and the step gone on from is
# the one the state holds (no checkpoint read).
# MODE=agents-heal is MODE=agents under DDP: the survivors heal in place, and with GROW=1 the
# returning agent joins in place (the nodes regroup after a step and its node receives their
# state); the growth's columns are then the seconds from the host seeing the join to the
# regrouped epoch's state agreed, from there to its first step, and the steps lost.
#
#   BIN=$CARGO_TARGET_DIR/debug/wiretrain scripts/bench-elastic.sh
#
# Env: BIN (default the release build), RUNS (default 5), IDLE (the nodes' --idle-timeout,
#      default 3 s: how soon a killed node is noticed), DEVICE (default cpu), MODE (local,
#      agents or heal, default local), GROW (0 or 1, default 0), STEPS (default 300; 3000 with GROW=1,
#      so that the job is still running when the agent comes back).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release/wiretrain}
RUNS=${RUNS:-5}
IDLE=${IDLE:-3}
DEVICE=${DEVICE:-cpu}
MODE=${MODE:-local}
GROW=${GROW:-0}
AGENTS=$([[ "$MODE" = agents* ]] && echo 1 || echo 0)
[ "$GROW" = 0 ] || [ "$AGENTS" = 1 ] || { echo "GROW=1 needs MODE=agents or agents-heal"; exit 2; }
STEPS=${STEPS:-$([ "$GROW" = 1 ] && echo 3000 || echo 300)}
STRATEGY=$([[ "$MODE" = *heal ]] && echo ddp || echo zero2)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# $(date -u +%FT%TZ) $(nproc) cores; idle timeout ${IDLE} s; mode $MODE; grow $GROW; $STEPS steps"
echo -n "run kill_to_detect_s detect_to_restart_s restart_to_first_step_s detect_to_first_step_s resumed_from steps_lost"
[ "$GROW" = 1 ] && echo " join_to_restart_s restart_to_first_step_s steps_lost" || echo
for r in $(seq 1 "$RUNS"); do
  d="$work/$r"; mkdir -p "$d"
  train=(train --example mlp --strategy "$STRATEGY" --steps "$STEPS" --global-batch 24 --device "$DEVICE"
    --checkpoint-every 10 --checkpoint-keep 100 --checkpoint-dir "$d/ck" --metrics "$d/m.jsonl"
    --idle-timeout "$IDLE" --no-progress)
  if [ "$AGENTS" = 1 ]; then
    export WIRETRAIN_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    port=$(python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    agents=()
    for i in 0 1 2; do
      "$BIN" launch --nnodes 2:3 --max-restarts 1 --master "127.0.0.1:$port" \
        --host "127.0.0.$((i + 1))" --join-window 10 -- "${train[@]}" 2> "$d/err$i.txt" &
      agents+=($!)
      sleep 0.5
    done
  else
    "$BIN" launch --local 3 --nnodes 2:3 --max-restarts 1 -- "${train[@]}" 2> "$d/err.txt" &
    launcher=$!
  fi
  for _ in $(seq 1 1200); do
    [ -f "$d/m.jsonl" ] && [ "$(wc -l < "$d/m.jsonl")" -ge 20 ] && break
    sleep 0.1
  done
  if [ "$AGENTS" = 1 ]; then
    kill_ms=$(date +%s%3N)
    kill -9 "${agents[2]}"
    if [ "$GROW" = 1 ]; then
      # Agent 2 comes back once epoch 1 has run 20 steps (the survivors wrote none since the
      # kill: they waited for node 2 until their idle timeout).
      base=$(wc -l < "$d/m.jsonl")
      for _ in $(seq 1 1200); do
        [ "$(wc -l < "$d/m.jsonl")" -ge $(( base + 20 )) ] && break
        sleep 0.05
      done
      "$BIN" launch --nnodes 2:3 --max-restarts 1 --master "127.0.0.1:$port" \
        --host 127.0.0.3 --join-window 10 -- "${train[@]}" 2> "$d/err2b.txt" &
      agents+=($!)
    fi
    for a in "${agents[0]}" "${agents[1]}" ${agents[3]:-}; do
      wait "$a" || { echo "run $r: an agent failed"; tail -5 "$d"/err*.txt; exit 1; }
    done
  else
    victim=
    for p in $(cat "/proc/$launcher/task/$launcher/children"); do
      if tr '\0' ' ' < "/proc/$p/cmdline" | grep -q -- '--node-rank 2 '; then victim=$p; fi
    done
    [ -n "$victim" ] || { echo "run $r: node 2 not found"; kill "$launcher"; exit 1; }
    kill_ms=$(date +%s%3N)
    kill -9 "$victim"
    wait "$launcher" || { echo "run $r: the launch failed"; tail -5 "$d/err.txt"; exit 1; }
  fi
  python3 - "$d/m.jsonl" "$kill_ms" "$r" "$GROW" "$MODE" <<'EOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
if sys.argv[5].endswith("heal"):
    # The same processes went on: one summary, its heal's times as the survivors saw them.
    el = lines[-1]["elastic"]
    assert el["recovery"] == "live", el
    h, kill = el["heals"][0], int(sys.argv[2])
    d, t, f = h["detected_unix_ms"], h["healed_unix_ms"], h["first_step_unix_ms"]
    row = [sys.argv[3], f"{(d - kill) / 1e3:.2f}", f"{(t - d) / 1e3:.2f}", f"{(f - t) / 1e3:.2f}",
           f"{(f - d) / 1e3:.2f}", h["went_on_from"], h["steps_lost"]]
    if sys.argv[4] == "1":
        # The growth in place: the host saw the join, the nodes regrouped and agreed.
        r2, h2 = el["restarts"][1], el["heals"][1]
        assert r2["joined"] == [2] and r2["recovery"] == "live" and h2["state_transferred"], el
        row += [f"{(h2['healed_unix_ms'] - r2['detected_unix_ms']) / 1e3:.2f}",
                f"{(h2['first_step_unix_ms'] - h2['healed_unix_ms']) / 1e3:.2f}",
                h2["steps_lost"]]
    print(*row)
    sys.exit(0)
# One summary per epoch that ended on its own terms (epoch 0's nodes failed: none); each
# carries its restart's cost (elastic.steps_lost: done after the checkpoint, then again).
by_epoch = {l["elastic"]["epoch"]: l for l in lines if "summary" in l and l.get("elastic")}
last = lines[-1]
kill = int(sys.argv[2])
r, s1 = last["elastic"]["restarts"][0], by_epoch[1]
d, t, f = r["detected_unix_ms"], r["restarted_unix_ms"], s1["first_step_unix_ms"]
row = [sys.argv[3], f"{(d - kill) / 1e3:.2f}", f"{(t - d) / 1e3:.2f}", f"{(f - t) / 1e3:.2f}",
       f"{(f - d) / 1e3:.2f}", s1["resumed_from"], s1["elastic"]["steps_lost"]]
if sys.argv[4] == "1":
    r2, s2 = last["elastic"]["restarts"][1], by_epoch[2]
    assert r2["joined"] == [2] and s2["world"] == 3, last
    t2, f2 = r2["restarted_unix_ms"], s2["first_step_unix_ms"]
    row += [f"{(t2 - r2['detected_unix_ms']) / 1e3:.2f}", f"{(f2 - t2) / 1e3:.2f}",
            s2["elastic"]["steps_lost"]]
print(*row)
EOF
done | tee "$work/rows.txt"
python3 - "$work/rows.txt" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l[0].isdigit()]
col = lambda i: statistics.median(float(r[i]) for r in rows)
print(f"median: kill->detect {col(1):.2f} s, detect->restart {col(2):.2f} s, "
      f"restart->first step {col(3):.2f} s, detect->first step {col(4):.2f} s, steps lost {col(6):.0f}")
if len(rows[0]) > 7:
    print(f"median growth: join->restart {col(7):.2f} s, restart->first step {col(8):.2f} s, "
          f"steps lost {col(9):.0f}")
EOF
