#!/usr/bin/env bash
# Measures wiretrain against the Gloo baseline in one run, on this machine (the figures in
# docs/BENCHMARKS.md). Needs a release build; Gloo rows need ~/.venvs/torch (see shared/README).
# Output: one section per comparison on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/wiretrain-target}/release/wiretrain}
PY=${PY:-$HOME/.venvs/torch/bin/python}
GLOO=${GLOO:-../shared/anchors/gloo_bench.py}
ITERS=${ITERS:-10}
echo "# $(date -u +%FT%TZ) $(nproc) cores, $(uname -sr)"
if [ -x "$PY" ] && [ -f "$GLOO" ]; then
  for w in 4 2; do echo "## gloo, $w processes (op bytes time_ms algbw busbw)"; "$PY" "$GLOO" "$w" 2>/dev/null; done
else
  echo "## gloo: skipped (no $PY or $GLOO)"
fi
echo "## wiretrain 1 node x 4 ranks (shared buffers)"
"$BIN" bench --op memcpy,all-reduce,reduce-scatter,all-gather,broadcast --bytes 1M,16M,64M --local 1 --ranks-per-node 4 --iters "$ITERS" --check
echo "## wiretrain 2 nodes x 1 rank (QUIC on loopback)"
"$BIN" bench --op p2p,all-reduce,reduce-scatter,all-gather,broadcast --bytes 1M,16M,64M --local 2 --iters "$ITERS" --check
echo "## wiretrain 2 nodes x 2 ranks (hierarchical)"
"$BIN" bench --op all-reduce,reduce-scatter,all-gather --bytes 16M,64M --local 2 --ranks-per-node 2 --iters "$ITERS" --check
if [ "$(id -u)" = 0 ]; then
  for cc in cubic bbr; do
    echo "## wiretrain 2 nodes x 1 rank, veth shaped with tbf 1gbit (0.125 GB/s), congestion $cc"
    BIN="$BIN" scripts/lab-tbf.sh --op p2p,all-reduce,reduce-scatter,all-gather,broadcast --bytes 16M,64M --iters 5 --check --congestion "$cc"
  done
fi
