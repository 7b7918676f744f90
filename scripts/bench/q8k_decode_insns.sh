#!/usr/bin/env bash
# Guest instructions per decoded token of one q8k layer (N x K, fast packing) on arm64, per
# build (docs/NATIVE.md "Instructions per decoded token"): cross-compiled, run under
# qemu-user with one instruction per translation block (-singlestep) and every executed block
# logged (-d exec,nochain); (count(REPS=3) - count(REPS=1)) / 2 is one token's layer.
# Usage: q8k_decode_insns.sh [N K] (default 256 512: the count is linear in N K, and the log
# of a larger layer takes minutes). CSRC=<another checkout's csrc> counts that source.
set -euo pipefail
N=${1:-256}
K=${2:-512}
SRC="${CSRC:-$(cd "$(dirname "$0")/../../mlx_ternary/runtime/cpu/csrc" && pwd)}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
count() {  # guest instructions executed by "$@"
  qemu-aarch64-static -cpu max -singlestep -d exec,nochain -D /dev/stderr "$@" 2>&1 >/dev/null \
    | grep -c '^Trace'
}
for arch in armv8-a armv8.2-a+dotprod; do
  aarch64-linux-gnu-g++ -std=c++20 -O2 -ffp-contract=off -w -I"$SRC" -march="$arch" -static \
    "$(dirname "$0")/q8k_decode_insns.cpp" -o "$OUT/bin"
  one=$(count "$OUT/bin" "$N" "$K" 1)
  three=$(count "$OUT/bin" "$N" "$K" 3)
  echo "$arch: $(qemu-aarch64-static -cpu max "$OUT/bin" "$N" "$K" 1): $(((three - one) / 2)) instructions per token ($N x $K)"
done
