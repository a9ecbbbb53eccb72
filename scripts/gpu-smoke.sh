#!/usr/bin/env bash
# GPU smoke test and figures for an NVIDIA machine without internet, in one bounded run
# (GPU_SMOKE_BUDGET seconds, default 420; a step that would start after it is skipped, saying so):
#   1. driver, GPU, Vulkan loader and NVIDIA ICD;  2. the binaries (prebuilt, or built here);
#   3. `wiretrain devices`;  4. char-lm training through wgpu (Vulkan) on the GPU: world 1, two
#   node processes over QUIC sharing the GPU, one node of two ranks sharing it, and the same model
#   on Burn's CPU backend (plus a wider model on both);  5. kernel_bench (fused AdamW vs Burn's);
#   6. `wiretrain bench --backend nccl` beside nccl-tests' all_reduce_perf (built here with nvcc
#   from NCCL_TESTS_SRC when not on PATH);  7. Burn-CUDA training: skipped, with the reason.
# Figures: OUT/figures.jsonl (one JSON object per measurement), OUT/gpu-smoke.txt (the log),
# OUT/kernel_bench.txt, OUT/wiretrain-nccl.jsonl, OUT/nccl-tests.txt. Rerunning overwrites them.
#
#   scripts/gpu-smoke.sh [OUT]                 # default OUT: ./gpu-smoke-<date>
#   scripts/gpu-smoke.sh --pack DIR            # on a build machine: build (dev profile, `nccl`),
#                                              # strip and xz wiretrain and kernel_bench into DIR
#   GPU_SMOKE_PREBUILT=DIR scripts/gpu-smoke.sh OUT   # on the GPU machine: use DIR's binaries
#
# The GPU machine needs no Rust toolchain with --pack/GPU_SMOKE_PREBUILT. libnccl comes from the
# system or from pip's nvidia-nccl-cu12/cu13 wheel (cudarc looks for `libnccl.so`, which the wheel
# lacks: the script links it in a private directory). lavapipe is not measured here unless
# `wiretrain devices` lists it (mesa-vulkan-drivers installed).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

if [ "${1:-}" = "--pack" ]; then
  dir=${2:?usage: scripts/gpu-smoke.sh --pack DIR}
  mkdir -p "$dir"
  T=${CARGO_TARGET_DIR:-$root/target}
  cargo build --features nccl --bin wiretrain --example kernel_bench || exit 1
  for b in "$T/debug/wiretrain" "$T/debug/examples/kernel_bench"; do
    strip -o "$dir/$(basename "$b")" "$b" && xz -T0 -6 -f "$dir/$(basename "$b")" || exit 1
  done
  ls -la "$dir"
  exit 0
fi

out=${1:-gpu-smoke-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu-smoke.txt"
figs="$out/figures.jsonl"
: >"$log"
: >"$figs"
say() { echo "$*" | tee -a "$log"; }
step() { say ""; say "== $* ($(($(date +%s) - start)) s)"; }
start=$(date +%s)
budget=${GPU_SMOKE_BUDGET:-420}
steps=${GPU_SMOKE_STEPS:-200}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; [ -n "${ntpid:-}" ] && kill "$ntpid" 2>/dev/null' EXIT
# time_left NEED: true when NEED more seconds fit in the budget
time_left() { [ $(($(date +%s) - start + $1)) -le "$budget" ]; }

step "1. GPU, driver, Vulkan"
command -v nvidia-smi >/dev/null || { say "FAIL: no nvidia-smi: not an NVIDIA machine"; exit 1; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${ngpu:-0}" -ge 1 ] || { say "FAIL: no NVIDIA GPU visible"; exit 1; }
if ldconfig -p | grep -q 'libvulkan.so.1'; then say "Vulkan loader: $(ldconfig -p | grep -m1 'libvulkan.so.1' | sed 's/.*=> //')"
else say "no Vulkan loader (libvulkan1): wgpu will not see the GPU"; fi
icd=""
for f in /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json \
  /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/local/nvidia/icd.d/nvidia_icd.json; do
  [ -e "$f" ] && { icd=$f; break; }
done
if [ -n "$icd" ]; then
  say "NVIDIA Vulkan ICD: $icd"
  case "$icd" in /usr/share/*|/etc/*) ;; *) export VK_DRIVER_FILES="$icd"; say "(outside the loader's search path: VK_DRIVER_FILES set)";; esac
else say "no NVIDIA Vulkan ICD found (nvidia_icd.json): wgpu falls back to other adapters"; fi

# libnccl: the system's, else pip's nvidia-nccl wheel, linked as libnccl.so for cudarc.
ncclhome=""
if ! ldconfig -p | grep -q 'libnccl.so '; then
  lib=$(ldconfig -p | grep -m1 'libnccl.so.2' | sed 's/.*=> //')
  [ -n "$lib" ] || lib=$(python3 - <<'PY' 2>/dev/null
import glob, site, sys
for d in site.getsitepackages() + sys.path:
    for f in glob.glob(d + "/nvidia/**/libnccl.so.2", recursive=True):
        print(f); raise SystemExit
PY
)
  if [ -n "$lib" ]; then
    ncclhome="$tmp/nccl"
    mkdir -p "$ncclhome/lib" "$ncclhome/include"
    ln -sf "$lib" "$ncclhome/lib/libnccl.so"; ln -sf "$lib" "$ncclhome/lib/libnccl.so.2"
    hdr=$(ls "$(dirname "$lib")"/../include/nccl.h 2>/dev/null | head -1)
    [ -n "$hdr" ] && ln -sf "$hdr" "$ncclhome/include/nccl.h"
    export LD_LIBRARY_PATH="$ncclhome/lib:${LD_LIBRARY_PATH:-}"
    say "libnccl: $lib (linked as libnccl.so in a private directory)"
  else
    say "libnccl.so.2 not found: pip install nvidia-nccl-cu13 (or install NCCL) for the NCCL steps"
  fi
else
  say "libnccl: $(ldconfig -p | grep -m1 'libnccl.so ' | sed 's/.*=> //')"
  [ -e /usr/include/nccl.h ] && ncclhome=/usr
fi

step "2. binaries"
bin="" kb=""
if [ -n "${GPU_SMOKE_PREBUILT:-}" ]; then
  mkdir -p "$tmp/bin"
  for b in wiretrain kernel_bench; do
    src="$GPU_SMOKE_PREBUILT/$b"
    if [ -e "$src.xz" ]; then
      if command -v xz >/dev/null; then xz -dc "$src.xz" >"$tmp/bin/$b"
      else python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$src.xz" "$tmp/bin/$b"; fi
    elif [ -e "$src" ]; then cp "$src" "$tmp/bin/$b"; fi
    chmod +x "$tmp/bin/$b" 2>/dev/null
  done
  bin="$tmp/bin/wiretrain" kb="$tmp/bin/kernel_bench"
  say "prebuilt from $GPU_SMOKE_PREBUILT (dev profile: dependencies at opt-level 2, see Cargo.toml)"
elif command -v cargo >/dev/null; then
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
  timeout 1800 cargo build --release --offline --features nccl --bin wiretrain --example kernel_bench 2>&1 | tail -2 | tee -a "$log"
  bin="$CARGO_TARGET_DIR/release/wiretrain" kb="$CARGO_TARGET_DIR/release/examples/kernel_bench"
  say "built here, release profile"
fi
[ -x "$bin" ] || { say "FAIL: no wiretrain binary (no cargo here and no GPU_SMOKE_PREBUILT; see --pack)"; exit 1; }

# nccl-tests in the background while the GPU trains (nvcc, sm_90 only, about a minute).
nt=$(command -v all_reduce_perf || true)
if [ -z "$nt" ] && [ -n "${NCCL_TESTS_SRC:-}" ] && command -v nvcc >/dev/null && [ -n "$ncclhome" ] \
  && [ -e "$ncclhome/include/nccl.h" ]; then
  mkdir -p "$tmp/nt"
  if [ -d "$NCCL_TESTS_SRC" ]; then cp -r "$NCCL_TESTS_SRC"/. "$tmp/nt/"; else tar xzf "$NCCL_TESTS_SRC" -C "$tmp/nt" --strip-components=1; fi
  cuda_home=$(dirname "$(dirname "$(command -v nvcc)")")
  (cd "$tmp/nt/src" && timeout 300 make -j"$(nproc)" MPI=0 CUDA_HOME="$cuda_home" NCCL_HOME="$ncclhome" \
    NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" BUILDDIR="$tmp/nt/build" "$tmp/nt/build/all_reduce_perf" \
    >"$tmp/nt-build.log" 2>&1) &
  ntpid=$!
  say "building nccl-tests' all_reduce_perf from $NCCL_TESTS_SRC in the background"
fi

step "3. wiretrain devices"
timeout 60 "$bin" devices 2>&1 | tee -a "$log"

# train NAME TIMEOUT ARGS...: one run's samples/s and median step into figures.jsonl
train() {
  local name=$1 limit=$2; shift 2
  if ! time_left "$limit"; then say "SKIPPED $name: the budget (${budget} s) would run out"; return; fi
  say "-- $name: $*"
  local m="$tmp/$name.jsonl" t0=$(date +%s) rc
  timeout "$limit" "$@" --no-progress --metrics "$m" --plot "$tmp/$name.png" >>"$log" 2>&1
  rc=$?
  if [ $rc != 0 ] || [ ! -s "$m" ]; then say "FAIL $name (exit $rc, $(($(date +%s) - t0)) s): see the log above"; return; fi
  python3 - "$m" "$name" "$(($(date +%s) - t0))" <<'PY' | tee -a "$figs" "$log"
import json, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print(json.dumps({"figure": "train", "name": sys.argv[2], "world": s["world"], "devices": s["devices"],
  "d_model": s["d_model"], "layers": s["layers"], "params": s["params_total"], "steps": s["steps_done"],
  "global_batch": s["global_batch"], "samples_per_s": round(s["samples_per_s"], 1),
  "samples_per_s_median_step": round(s["global_batch"] * 1000 / s["median"]["step_ms"], 1),
  "median_step_ms": round(s["median"]["step_ms"], 3), "median_compute_ms": round(s["median"]["compute_ms"], 3),
  "loss": [round(s["first_loss"], 4), round(s["final_loss"], 4)], "wall_s": int(sys.argv[3])}))
PY
}

step "4. char-lm training ($steps steps)"
W="$bin train --example char-lm --seed 1"
train wgpu-w1 90 $W --steps "$steps" --device wgpu
train cpu-w1 90 $W --steps "$steps" --device cpu
train wgpu-w1-wide 90 $W --steps "$steps" --device wgpu --d-model 256 --layers 4
train cpu-w1-wide 90 $W --steps 20 --device cpu --d-model 256 --layers 4

step "5. kernel_bench: fused AdamW vs Burn's, on the GPU"
if [ -x "$kb" ] && time_left 60; then
  timeout 90 "$kb" $((16 << 20)) wgpu 2>&1 | tee "$out/kernel_bench.txt" | tee -a "$log"
else say "SKIPPED kernel_bench: no binary or no budget left"; fi

step "6. NCCL: wiretrain bench --backend nccl, $ngpu rank(s), one per GPU"
if time_left 60; then
  timeout 90 "$bin" bench --backend nccl --ranks-per-node "$ngpu" \
    --op all-reduce,all-gather,reduce-scatter,broadcast --bytes 1M,16M,256M --iters 20 --check \
    --json >"$out/wiretrain-nccl.jsonl" 2>>"$log"
  rc=$?
  tee -a "$log" <"$out/wiretrain-nccl.jsonl"
  [ $rc = 0 ] && say "PASS: bench --backend nccl" || say "FAIL: bench --backend nccl (exit $rc)"
  [ "$ngpu" = 1 ] && say "(one GPU: world 1 only; NCCL's world-1 collectives are device copies)"
fi
if [ -n "${ntpid:-}" ]; then
  wait "$ntpid"; ntpid=""
  if [ -x "$tmp/nt/build/all_reduce_perf" ]; then nt="$tmp/nt/build/all_reduce_perf"
  else say "nccl-tests build failed:"; tail -5 "$tmp/nt-build.log" | tee -a "$log"; fi
fi
if [ -n "$nt" ] && time_left 30; then
  say "-- nccl-tests all_reduce_perf, same sizes"
  timeout 60 "$nt" -b 1M -e 256M -f 16 -g "$ngpu" -n 20 -w 2 2>&1 | tee "$out/nccl-tests.txt" | tee -a "$log"
else say "nccl-tests all_reduce_perf: not available (no binary, no nvcc/NCCL header, or no budget)"; fi

step "4b. training with two ranks sharing the GPU"
train wgpu-2nodes-quic 100 "$bin" launch --local 2 -- train --example char-lm --seed 1 --steps "$steps" --device wgpu
train wgpu-1node-2ranks 100 $W --ranks-per-node 2 --share-device --steps "$steps" --device wgpu

step "7. Burn-CUDA training"
say "SKIPPED: Burn's cuda backend needs the LLVM bundle that tracel-llvm-bundler downloads at build time (no internet here); see docs/PLATFORMS.md 'CUDA and NCCL'"
say "done in $(($(date +%s) - start)) s; figures in $out"
