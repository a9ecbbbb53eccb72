# Sourced by scripts/cross.sh and scripts/cross-check.sh: the C cross compilers and linkers
# for the two cross targets, and a `windres` on PATH (some build scripts, turso_sdk_kit through
# burn's cubecl-environment, call plain `windres`), removed on exit.
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
ln -s "$(command -v x86_64-w64-mingw32-windres || echo /usr/bin/x86_64-w64-mingw32-windres)" "$shim/windres"
export PATH="$shim:$PATH"
export CC_x86_64_pc_windows_gnu=x86_64-w64-mingw32-gcc
export CARGO_TARGET_X86_64_PC_WINDOWS_GNU_LINKER=x86_64-w64-mingw32-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
