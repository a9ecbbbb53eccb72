#!/usr/bin/env bash
# Issue 26's same-run comparison: an old wiretrain binary against the new one at several
# channel counts (QUIC connections per lane), with Gloo beside, alternating round by round so
# the machine's drift falls on every row alike. 2 nodes x 1 rank and 2 nodes x 2 ranks over
# loopback; with TBF=1 (root) also the 1 Gbit/s tbf link between two namespaces.
#
#   OLD=/tmp/wt-old BIN=$CARGO_TARGET_DIR/debug/wiretrain scripts/bench-channels.sh > out.txt
#   python3 scripts/bench-channels-table.py out.txt
#
# Env: OLD, BIN (binaries), CHANNELS (counts for BIN, default "1 2 4"), VARIANTS (instead of
#      CHANNELS: flag sets for BIN separated by '|', e.g. "|--mtu 65507"), ROUNDS (default 5),
#      BYTES (default 64M), ITERS (default 10), PY/GLOO (Gloo's python and script; rows skipped
#      when absent), TBF (1: add the shaped-link rows; needs root), LOOPBACK (0: skip the
#      loopback and Gloo rows).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release/wiretrain}
OLD=${OLD:?set OLD to the binary to compare against}
CHANNELS=${CHANNELS:-1 2 4}
ROUNDS=${ROUNDS:-5}
BYTES=${BYTES:-64M}
ITERS=${ITERS:-10}
PY=${PY:-$HOME/.venvs/torch/bin/python}
GLOO=${GLOO:-scripts/gloo_bench.py}
OPS=p2p,all-reduce,reduce-scatter,all-gather
echo "# $(date -u +%FT%TZ) $(nproc) cores, $(uname -sr); old=$OLD new=$BIN"
run() { # label, binary, shape args...
  local label=$1 bin=$2; shift 2
  echo "## $label"
  timeout 300 "$bin" bench --op "$OPS" --bytes "$BYTES" --iters "$ITERS" --check "$@" 2>&1 \
    | grep -E '^ +(p2p|all-reduce|reduce-scatter|all-gather) ' || echo "failed"
}
for r in $(seq 1 "$ROUNDS"); do
  echo "# round $r"
  [ "${LOOPBACK:-1}" = 1 ] && for shape in "2x1:--local 2" "2x2:--local 2 --ranks-per-node 2"; do
    name=${shape%%:*}; args=${shape#*:}
    # shellcheck disable=SC2086
    run "$name old" "$OLD" $args
    if [ -n "${VARIANTS+x}" ]; then
      IFS='|' read -ra vs <<< "$VARIANTS"
      for v in "${vs[@]}"; do
        # shellcheck disable=SC2086
        run "$name new${v:+ $v}" "$BIN" $args $v
      done
    else
      for c in $CHANNELS; do
        # shellcheck disable=SC2086
        run "$name new channels=$c" "$BIN" $args --channels "$c"
      done
    fi
  done
  if [ "${LOOPBACK:-1}" = 1 ] && [ -x "$PY" ] && [ -f "$GLOO" ]; then
    for w in 2 4; do
      echo "## gloo $w"
      timeout 300 "$PY" "$GLOO" "$w" 2>/dev/null | grep -E '^(allreduce|allgather|reducescatter) ' || echo "failed"
    done
  fi
  if [ "${TBF:-0}" = 1 ]; then
    echo "## tbf old"
    BIN=$OLD scripts/lab-tbf.sh --op "$OPS" --bytes "$BYTES" --iters "$ITERS" --check 2>&1 \
      | grep -E '^ +(p2p|all-reduce|reduce-scatter|all-gather) ' | head -4 || echo "failed"
    for c in $CHANNELS; do
      echo "## tbf new channels=$c"
      BIN=$BIN scripts/lab-tbf.sh --op "$OPS" --bytes "$BYTES" --iters "$ITERS" --check --channels "$c" 2>&1 \
        | grep -E '^ +(p2p|all-reduce|reduce-scatter|all-gather) ' | head -4 || echo "failed"
    done
  fi
done
