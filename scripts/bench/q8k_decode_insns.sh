#!/usr/bin/env bash
# Guest instructions per token of one q8k layer (N x K, fast packing) on arm64, per build
# (docs/NATIVE.md "Instructions per token"): per decoded token (one token a call) and per
# prefill token (M tokens a call), for armv8-a, +dotprod and +dotprod+i8mm. Cross-compiled,
# run under qemu-user with one instruction per translation block (-singlestep) and every
# executed block logged (-d exec,nochain); (count(REPS=3) - count(REPS=1)) / 2 is one call,
# divided by its tokens.
# Usage: q8k_decode_insns.sh [N K [M]] (default 256 512 16: the count is linear in N K, and the
# log of a larger layer takes minutes). CSRC=<another checkout's csrc> counts that source.
set -euo pipefail
N=${1:-256}
K=${2:-512}
M=${3:-16}
SRC="${CSRC:-$(cd "$(dirname "$0")/../../mlx_ternary/runtime/cpu/csrc" && pwd)}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
count() {  # guest instructions executed by "$@"
  qemu-aarch64-static -cpu max -singlestep -d exec,nochain -D /dev/stderr "$@" 2>&1 >/dev/null \
    | grep -c '^Trace'
}
per_token() {  # instructions of one call of $1 tokens, per token
  local one three
  one=$(count "$OUT/bin" "$N" "$K" 1 "$1")
  three=$(count "$OUT/bin" "$N" "$K" 3 "$1")
  echo $(((three - one) / 2 / $1))
}
for arch in armv8-a armv8.2-a+dotprod armv8.2-a+dotprod+i8mm; do
  aarch64-linux-gnu-g++ -std=c++20 -O2 -ffp-contract=off -w -I"$SRC" -march="$arch" -static \
    "$(dirname "$0")/q8k_decode_insns.cpp" -o "$OUT/bin"
  name=$(qemu-aarch64-static -cpu max "$OUT/bin" "$N" "$K" 1 "$M")
  echo "$arch ($name): $(per_token 1) per decoded token, $(per_token "$M") per prefill token" \
    "($N x $K, $M tokens a call)"
done
