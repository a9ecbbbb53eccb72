#!/usr/bin/env bash
# `cargo check` of wiretrain for the cross targets it ships to (x86_64-pc-windows-gnu,
# aarch64-unknown-linux-gnu): installs the Rust targets and the C cross compilers that ring's
# build script needs, then checks the comm and shaders crates and, when
# CROSS_FULL_IF_ELAPSED_UNDER (seconds, default: always) allows, the whole workspace with its
# tests and examples. The builds and emulated runs of the binaries are scripts/cross.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target}"
budget=${CROSS_FULL_IF_ELAPSED_UNDER:-999999}
start=$(date +%s)
targets=(x86_64-pc-windows-gnu aarch64-unknown-linux-gnu)
need=()
command -v x86_64-w64-mingw32-gcc >/dev/null || need+=(gcc-mingw-w64-x86-64)
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
rustup target add "${targets[@]}" >/dev/null
# shellcheck source=scripts/cross-env.sh
source scripts/cross-env.sh
for t in "${targets[@]}"; do
  t0=$(date +%s)
  cargo check --target "$t" -p wiretrain-comm -p wiretrain-shaders --all-targets
  echo "cross-check $t: comm + shaders in $(( $(date +%s) - t0 )) s"
done
for t in "${targets[@]}"; do
  used=$(( $(date +%s) - start ))
  if [ "$used" -ge "$budget" ]; then
    echo "cross-check $t: whole workspace SKIPPED (time budget of this CI run spent; run scripts/cross-check.sh)"
    continue
  fi
  t0=$(date +%s)
  cargo check --target "$t" --workspace --all-targets
  echo "cross-check $t: whole workspace in $(( $(date +%s) - t0 )) s"
done
