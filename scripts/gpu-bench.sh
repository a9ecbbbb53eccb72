#!/usr/bin/env bash
# The GPU-path figures in one prepared run of at most GPU_BENCH_BUDGET seconds (default 290) on
# a GPU machine with no toolchain and no network; binaries built beforehand with --pack:
#   1. transfer_bench: host<->device GB/s at 1, 16, 64, 256 MiB for the per-tensor path, the
#      transfer engine, one tensor through Burn's read/upload and through the staging ring,
#      and the kernels' buffers through fresh staging and through the ring, in the same run;
#   2. overhead: wiretrain at world 1 (device-resident, then the host path) against plain Burn,
#      char-lm at 3.2M (--d-model 256 --layers 4) and 25M (--d-model 512 --layers 8);
#   3. two node processes sharing the GPU, char-lm 25M, DDP and ZeRO-2: the new binary and the
#      old one (the commit before the device-resident path) in the same run.
# Raw output: OUT/gpu-bench.txt (everything) and OUT/figures.jsonl; copy OUT to docs/bench/.
#
#   scripts/gpu-bench.sh --pack DIR [OLD_REV]   # on a build machine (default OLD_REV b357b88):
#                                               # stripped, xz-compressed binaries under 64 MiB
#   GPU_BENCH_PREBUILT=DIR scripts/gpu-bench.sh OUT   # on the GPU machine
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

if [ "${1:-}" = "--pack" ]; then
  dir=${2:?usage: scripts/gpu-bench.sh --pack DIR [OLD_REV]}
  old=${3:-b357b88}
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  T=${CARGO_TARGET_DIR:-$root/target}
  cargo build --features wiretrain/test-hooks --bin wiretrain --example overhead --example transfer_bench || exit 1
  for b in "$T/debug/wiretrain" "$T/debug/examples/overhead" "$T/debug/examples/transfer_bench"; do
    strip -o "$dir/$(basename "$b")" "$b" && xz -T0 -6 -f "$dir/$(basename "$b")" || exit 1
  done
  # The old binary, from a worktree of OLD_REV sharing the target dir's dependencies.
  wt=$(mktemp -d)
  git worktree add --detach "$wt" "$old" >/dev/null || exit 1
  (cd "$wt" && CARGO_TARGET_DIR="$T" cargo build --features wiretrain/test-hooks --bin wiretrain) || exit 1
  strip -o "$dir/wiretrain-old" "$T/debug/wiretrain" && xz -T0 -6 -f "$dir/wiretrain-old" || exit 1
  git worktree remove --force "$wt"
  # The new binary again, so the target dir holds it.
  cargo build --features wiretrain/test-hooks --bin wiretrain >/dev/null 2>&1
  du -ch "$dir"/*.xz | tail -1
  exit 0
fi

out=${1:-gpu-bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu-bench.txt"
figs="$out/figures.jsonl"
: >"$log"
: >"$figs"
say() { echo "$*" | tee -a "$log"; }
start=$(date +%s)
budget=${GPU_BENCH_BUDGET:-290}
time_left() { [ $(($(date +%s) - start + $1)) -le "$budget" ]; }
step() { say ""; say "== $* ($(($(date +%s) - start)) s)"; }

bin=${GPU_BENCH_PREBUILT:?set GPU_BENCH_PREBUILT to the --pack directory}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for b in wiretrain wiretrain-old overhead transfer_bench; do
  xz -dc "$bin/$b.xz" >"$tmp/$b" && chmod +x "$tmp/$b" || { say "FAIL: $bin/$b.xz"; exit 1; }
done
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
  --format=csv,noheader 2>&1 | tee -a "$log"
for f in /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json \
  /usr/local/nvidia/icd.d/nvidia_icd.json; do
  [ -e "$f" ] && { case "$f" in /usr/share/*|/etc/*) ;; *) export VK_DRIVER_FILES="$f";; esac; break; }
done

# run NAME LIMIT CMD...: the command's output into the log; its JSON lines into figures.jsonl.
run() {
  local name=$1 limit=$2; shift 2
  if ! time_left "$limit"; then say "SKIPPED $name: the budget (${budget} s) would run out"; return; fi
  say "-- $name: $*"
  timeout "$limit" "$@" >"$tmp/$name.out" 2>>"$log"
  say "(exit $?)"
  tee -a "$log" <"$tmp/$name.out" | grep '^{' | sed "s/^{/{\"name\":\"$name\",/" >>"$figs"
}

step "1. host<->device transfers"
run transfer 60 "$tmp/transfer_bench" wgpu 1M,16M,64M,256M 64 5

step "2. world 1 against plain Burn (char-lm, 30 steps, batch 32)"
run overhead-3m 60 "$tmp/overhead" char-lm wgpu 30 32 --d-model 256 --layers 4
run overhead-25m 70 "$tmp/overhead" char-lm wgpu 30 32 --d-model 512 --layers 8
run overhead-25m-host 70 "$tmp/overhead" char-lm wgpu 30 32 --d-model 512 --layers 8 --host-path

step "3. two processes sharing the GPU, char-lm 25M, 20 steps: new binary, then old"
# train NAME BIN STRATEGY: median step of a 2-node launch into figures.jsonl
train() {
  local name=$1 b=$2 s=$3 m="$tmp/$1.jsonl"
  if ! time_left 70; then say "SKIPPED $name: the budget would run out"; return; fi
  say "-- $name"
  timeout 70 "$b" launch --local 2 -- train --example char-lm --d-model 512 --layers 8 \
    --strategy "$s" --steps 20 --seed 1 --device wgpu --no-progress --metrics "$m" >>"$log" 2>&1
  say "(exit $?)"
  [ -s "$m" ] && python3 - "$m" "$name" <<'PY' | tee -a "$figs" "$log"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
s = rows[-1]
print(json.dumps({"name": sys.argv[2], "figure": "train-2proc", "strategy": s["strategy"],
  "params": s["params_total"], "median_step_ms": s["median"]["step_ms"],
  "d2h_bytes": s["median"].get("d2h_bytes"), "h2d_bytes": s["median"].get("h2d_bytes"),
  "device_waits": s["median"].get("device_waits"), "device_mem_peak": s["median"].get("device_mem_peak"),
  "loss": [s["first_loss"], s["final_loss"]]}))
PY
}
train ddp-new "$tmp/wiretrain" ddp
train ddp-old "$tmp/wiretrain-old" ddp
train zero2-new "$tmp/wiretrain" zero2
train zero2-old "$tmp/wiretrain-old" zero2
step "done"
