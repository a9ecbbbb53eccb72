#!/usr/bin/env bash
# Measures wiretrain against the Gloo baseline in one run, on this machine (the figures in
# docs/BENCHMARKS.md). Needs a release build; Gloo rows need ~/.venvs/torch (see shared/README).
# Output: one section per comparison on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-${CARGO_TARGET_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target}/release/wiretrain}
PY=${PY:-$HOME/.venvs/torch/bin/python}
GLOO=${GLOO:-scripts/gloo_bench.py}
ITERS=${ITERS:-10}
echo "# $(date -u +%FT%TZ) $(nproc) cores, $(uname -sr)"
if [ -x "$PY" ] && [ -f "$GLOO" ]; then
  for w in 4 2; do echo "## gloo, $w processes (op bytes time_ms algbw busbw)"; "$PY" "$GLOO" "$w" 2>"${TMPDIR:-/tmp}/gloo-$w.err" || { echo "## gloo, $w processes: failed"; tail -3 "${TMPDIR:-/tmp}/gloo-$w.err"; }; done
else
  echo "## gloo: skipped (no $PY or $GLOO)"
fi
echo "## wiretrain 1 node x 4 ranks (shared buffers)"
"$BIN" bench --op memcpy,all-reduce,reduce-scatter,all-gather,broadcast --bytes 1M,16M,64M --local 1 --ranks-per-node 4 --iters "$ITERS" --check
echo "## wiretrain 2 nodes x 1 rank (QUIC on loopback)"
"$BIN" bench --op p2p,all-reduce,reduce-scatter,all-gather,broadcast --bytes 1M,16M,64M --local 2 --iters "$ITERS" --check
echo "## wiretrain 2 nodes x 1 rank, --mtu 1452 (the datagram size of 1500-byte Ethernet; the default before 2026-12-03)"
"$BIN" bench --op p2p,all-reduce,reduce-scatter,all-gather,broadcast --bytes 1M,16M,64M --local 2 --iters "$ITERS" --check --mtu 1452
echo "## wiretrain 2 nodes x 2 ranks (hierarchical)"
"$BIN" bench --op all-reduce,reduce-scatter,all-gather --bytes 16M,64M --local 2 --ranks-per-node 2 --iters "$ITERS" --check
if [ "$(id -u)" = 0 ]; then
  for mtu in 1500 9000; do
    echo "## wiretrain 2 nodes x 1 rank, veth MTU $mtu shaped with tbf 1gbit (0.125 GB/s)"
    BIN="$BIN" MTU=$mtu scripts/lab-tbf.sh --op p2p,all-reduce,reduce-scatter,all-gather,broadcast --bytes 16M,64M --iters 9 --check
  done
fi
