#!/usr/bin/env bash
# Cross builds of the `wiretrain` binary and smoke runs of the foreign binaries under
# emulation, on a Debian x86_64 machine:
#   x86_64-pc-windows-gnu      built with mingw-w64, run under wine (64-bit);
#   aarch64-unknown-linux-gnu  built with gcc-aarch64-linux-gnu, run under qemu-aarch64
#                              (user mode, Debian's aarch64 sysroot).
# Per target: a release build (`cargo build --release`, debuginfo off), then four runs, each
# bounded in time: `--version`, a `plan`, `bench --local 2` (two emulated node processes
# talking QUIC over loopback, results checked) and a short `train --example mlp` with
# `--device auto` (no GPU under emulation: the CPU-backend fallback must work).
# One PASS/FAIL line per target and step; exit status 0 only when every step passed.
#
#   scripts/cross.sh [target ...]        # default: both targets; log in target/cross/
#
# Bounds: each build BUILD_LIMIT seconds (default 5400: a cold release build of Burn and wgpu
# takes 20-30 minutes on 2 cores), each smoke run 120-600 s.
#
# Needs root (or sudo) for apt-get and, for the aarch64 bench (whose launcher starts more
# aarch64 processes), for registering qemu-aarch64 with binfmt_misc. macOS targets cannot be
# built here: ring's C code needs Apple's SDK (see docs/PLATFORMS.md).
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target}"
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(x86_64-pc-windows-gnu aarch64-unknown-linux-gnu)
out=target/cross
mkdir -p "$out"
log="$out/cross-$(date +%Y%m%d-%H%M%S).txt"
: > "$log"
say() { echo "$*" | tee -a "$log"; }
fails=0
result() { # target step status detail
  say "$(printf '%-28s %-8s %-4s %s' "$1" "$2" "$3" "$4")"
  [ "$3" = PASS ] || fails=$((fails + 1))
}
sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
start=$(date +%s)

# --- tools -------------------------------------------------------------------------------
need_pkgs=()
for t in "${targets[@]}"; do
  case $t in
    x86_64-pc-windows-gnu)
      command -v x86_64-w64-mingw32-gcc >/dev/null || need_pkgs+=(gcc-mingw-w64-x86-64)
      command -v wine >/dev/null || need_pkgs+=(wine wine64) ;;
    aarch64-unknown-linux-gnu)
      command -v aarch64-linux-gnu-gcc >/dev/null || need_pkgs+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
      command -v qemu-aarch64 >/dev/null || need_pkgs+=(qemu-user)
      [ -e /usr/lib/binfmt.d/qemu-aarch64.conf ] || need_pkgs+=(qemu-user-binfmt) ;;
    *) say "unknown target $t (known: x86_64-pc-windows-gnu aarch64-unknown-linux-gnu)"; exit 2 ;;
  esac
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  say "installing ${need_pkgs[*]}"
  sudo_ apt-get update -qq >>"$log" 2>&1
  DEBIAN_FRONTEND=noninteractive sudo_ apt-get install -y -qq --no-install-recommends \
    "${need_pkgs[@]}" >>"$log" 2>&1 || { say "apt-get install failed (see $log)"; exit 1; }
fi
rustup target add "${targets[@]}" >>"$log" 2>&1 || { say "rustup target add failed"; exit 1; }
# shellcheck source=scripts/cross-env.sh
source scripts/cross-env.sh
export CARGO_PROFILE_RELEASE_DEBUG=false

# Rust's std (1.78+) takes random bytes from ProcessPrng in bcryptprimitives.dll, which every
# Windows 10+ has and Wine 8 lacks. This prefix-local stand-in (not shipped, emulation only)
# forwards to RtlGenRandom.
wine_shim() {
  local d; d=$(mktemp -d)
  cat > "$d/b.c" <<'C'
#include <windows.h>
BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG len);
BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len) {
  while (len > 0) {
    ULONG n = len > 0x40000000 ? 0x40000000 : (ULONG)len;
    if (!SystemFunction036(data, n)) return FALSE;
    data += n; len -= n;
  }
  return TRUE;
}
C
  printf 'LIBRARY bcryptprimitives\nEXPORTS\n  ProcessPrng\n' > "$d/b.def"
  x86_64-w64-mingw32-gcc -shared -O2 -o "$WINEPREFIX/drive_c/windows/system32/bcryptprimitives.dll" \
    "$d/b.c" "$d/b.def" -ladvapi32 >>"$log" 2>&1 || say "could not build the bcryptprimitives stand-in"
  rm -rf "$d"
}

# `run <seconds> <cmd...>`: the foreign binary through its emulator, bounded.
bounded() { timeout --kill-after=10 "$@"; }

smoke() { # target runner...
  local t=$1; shift
  local runner=("$@")
  local o
  o=$(bounded 120 "${runner[@]}" --version 2>&1)
  if [[ $o == wiretrain\ * ]]; then result "$t" version PASS "$o"; else result "$t" version FAIL "$o"; fi

  o=$(bounded 300 "${runner[@]}" plan --params 1.3e9 --nodes 2 --gpus-per-node 4 2>&1)
  local rows_plan
  rows_plan=$(grep -cE '^ *(ddp|zero1|zero2|zero3|hybrid) ' <<<"$o" || true)
  if [ "$rows_plan" -eq 5 ] && grep -q "^recommendation:" <<<"$o"; then
    result "$t" plan PASS "5 strategy rows and a recommendation"
  else result "$t" plan FAIL "$(tail -c 400 <<<"$o")"; fi

  o=$(bounded 600 "${runner[@]}" bench --local 2 --op all-reduce --bytes 64K,1M --iters 5 \
      --warmup 1 --check --json 2>&1)
  local rows wrong
  rows=$(grep -c '"busbw' <<<"$o" || true)
  wrong=$(grep -o '"wrong":[0-9]*' <<<"$o" | grep -vc '"wrong":0' || true)
  if [ "$rows" -ge 2 ] && [ "$wrong" -eq 0 ]; then
    result "$t" bench PASS "$rows rows over QUIC between 2 emulated nodes, 0 wrong; $(grep -o '"busbw_gbps":[0-9.]*' <<<"$o" | tr '\n' ' ')"
  else result "$t" bench FAIL "$(tail -c 600 <<<"$o")"; fi

  o=$(bounded 600 "${runner[@]}" train --example mlp --steps 5 --global-batch 32 --device auto \
      --no-progress 2>&1)
  if [ $? -eq 0 ] && grep -q "loss" <<<"$o"; then
    result "$t" train PASS "$(grep -o 'CPU backend' <<<"$o" | head -1): $(grep -i 'loss' <<<"$o" | tail -1 | cut -c1-120)"
  else result "$t" train FAIL "$(tail -c 600 <<<"$o")"; fi
}

for t in "${targets[@]}"; do
  t0=$(date +%s)
  if bounded "${BUILD_LIMIT:-5400}" cargo build --release --target "$t" --bin wiretrain >>"$log" 2>&1; then
    ext=""; [ "$t" = x86_64-pc-windows-gnu ] && ext=.exe
    bin="$CARGO_TARGET_DIR/$t/release/wiretrain$ext"
    result "$t" build PASS "$(( $(date +%s) - t0 )) s, $(du -h "$bin" | cut -f1) $(file -b "$bin" | cut -d, -f1-2)"
  else
    result "$t" build FAIL "see $log"
    continue
  fi
  case $t in
    x86_64-pc-windows-gnu)
      export WINEDEBUG=-all WINEPREFIX="$HOME/.cache/wiretrain-wine"
      bounded 300 wineboot --init >>"$log" 2>&1 || true
      wine_shim
      smoke "$t" wine "$bin" ;;
    aarch64-unknown-linux-gnu)
      export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu
      # The launcher execs more aarch64 processes: the kernel needs to know qemu runs them.
      if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        [ -e /proc/sys/fs/binfmt_misc/register ] ||
          sudo_ mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc 2>>"$log"
        sudo_ sh -c 'cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register' 2>>"$log" ||
          say "could not register qemu-aarch64 with binfmt_misc: the bench step will fail"
      fi
      smoke "$t" qemu-aarch64 "$bin" ;;
  esac
done
say "cross.sh: $fails failed step(s), $(( $(date +%s) - start )) s; log $log"
[ "$fails" -eq 0 ]
