#!/usr/bin/env bash
# GPU smoke test for NVIDIA machines without internet: builds wiretrain with the `nccl`
# feature (cudarc loads libcuda/libnccl at run time; nothing to download), checks NCCL
# collectives against the reference (the comm crate's nccl test), then runs
# `wiretrain bench --backend nccl` over all GPUs of the machine (one rank per GPU) and, when
# NVIDIA's nccl-tests are on PATH (all_reduce_perf), the same sizes with them for the ratio.
# Finishes within 5 minutes (each step is bounded). Figures go to the file it names.
#
#   scripts/gpu-smoke.sh [out-dir]      # default: ./gpu-smoke-<date>
#
# libnccl missing? `pip install nvidia-nccl-cu13` ships libnccl.so.2; this script adds its
# directory to LD_LIBRARY_PATH when it finds it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-smoke-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
log="$out/gpu-smoke.txt"
say() { echo "$*" | tee -a "$log"; }
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target}"
start=$(date +%s)

command -v nvidia-smi >/dev/null && nvidia-smi -L | tee -a "$log" || say "no nvidia-smi"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${ngpu:-0}" -ge 1 ] || { say "FAIL: no NVIDIA GPU visible"; exit 1; }

if ! ldconfig -p 2>/dev/null | grep -q libnccl.so; then
  wheel=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
  if [ -n "$wheel" ] && [ -e "$wheel/libnccl.so.2" ]; then
    export LD_LIBRARY_PATH="$wheel:${LD_LIBRARY_PATH:-}"
    say "libnccl from the nvidia-nccl wheel: $wheel"
  else
    say "libnccl.so.2 not found: pip install nvidia-nccl-cu13 (or install NCCL), then rerun"
  fi
fi

say "== build (--features nccl)"
timeout 240 cargo build --offline --features nccl 2>&1 | tail -2 | tee -a "$log"
bin="$CARGO_TARGET_DIR/debug/wiretrain"
[ -x "$bin" ] || { say "FAIL: build"; exit 1; }

say "== NCCL collectives against the reference"
timeout 120 cargo test --offline -p wiretrain-comm --features nccl --test nccl -- --nocapture \
  2>&1 | grep -E "verified|SKIPPED|test result|panicked" | tee -a "$log"

say "== wiretrain bench --backend nccl, $ngpu rank(s), one per GPU"
timeout 120 "$bin" bench --backend nccl --local 1 --ranks-per-node "$ngpu" \
  --op all-reduce,all-gather,reduce-scatter,broadcast --bytes 1M,16M,256M --iters 20 --check \
  --json > "$out/wiretrain-nccl.jsonl" 2>>"$log"
rc=$?
cat "$out/wiretrain-nccl.jsonl" | tee -a "$log"
[ $rc = 0 ] && say "PASS: bench --backend nccl" || say "FAIL: bench --backend nccl (exit $rc)"

if command -v all_reduce_perf >/dev/null; then
  say "== nccl-tests all_reduce_perf on the same sizes"
  timeout 60 all_reduce_perf -b 1M -e 256M -f 16 -g "$ngpu" 2>&1 | tee "$out/nccl-tests.txt" | tee -a "$log"
else
  say "nccl-tests (all_reduce_perf) not on PATH: no ratio against it"
fi
say "training on CUDA: not part of this build (Burn's cuda feature needs a toolchain download; see README)"
say "done in $(( $(date +%s) - start )) s; figures in $out"
