#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian/Ubuntu machine (as root or
# with sudo), then runs every test of the workspace. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
# The build is the one `cargo run` makes (./target unless CARGO_TARGET_DIR says otherwise), so
# the README's two commands share it: a second cold build of Burn would cost ~50 minutes.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"

# System packages: iproute2 (ip/tc for the network-namespace lab tests), mesa-vulkan-drivers
# (lavapipe, the software Vulkan device the wgpu tests run on), and Slurm with munge (the
# two-node Slurm cluster of tests/slurm.rs; its daemons are started by the test, not here).
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
dpkg -s mesa-vulkan-drivers >/dev/null 2>&1 || need+=(mesa-vulkan-drivers)
for p in slurmctld slurmd slurm-client munge; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
if [ ${#need[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

# The Kubernetes example's schema check (tests/kubernetes.rs): kubernetes-validate, from PyPI.
if ! command -v kubernetes-validate >/dev/null 2>&1; then
  python3 -m pip install -q kubernetes-validate 2>/dev/null \
    || python3 -m pip install -q --break-system-packages kubernetes-validate
fi

# Skips: a test whose prerequisite is missing fails when CI is set and otherwise skips,
# writing a line here (tests/common/skip.rs); the list closes the run.
export WIRETRAIN_SKIP_LOG="${WIRETRAIN_SKIP_LOG:-$(mktemp)}"
: >"$WIRETRAIN_SKIP_LOG"
# test-hooks: the fault tests' injection points (a stalled checkpoint, a slow node, ...).
rc=0
cargo test --workspace --no-fail-fast --features wiretrain/test-hooks || rc=$?
if [ -s "$WIRETRAIN_SKIP_LOG" ]; then
  echo "== $(wc -l <"$WIRETRAIN_SKIP_LOG") test(s) skipped (a prerequisite is missing; CI=true fails them instead):"
  sed 's/^/   /' "$WIRETRAIN_SKIP_LOG"
else
  echo "== no test skipped"
fi
rm -f "$WIRETRAIN_SKIP_LOG"
exit "$rc"
