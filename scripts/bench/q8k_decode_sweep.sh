#!/usr/bin/env bash
# One token through the 0.53 G llama's 84 ternary layers, outside MLX (q8k_decode_sweep.cpp),
# for this tree and optionally another (BASE=<another checkout's csrc>, e.g. main's), runs
# alternated ROUNDS times (default 8), the least wall time of each printed: on a shared machine
# the minima of interleaved runs are the comparison (docs/NATIVE.md "one row at a time").
# MARCH=haswell builds for AVX2 (default native). Usage: q8k_decode_sweep.sh [THREADS ...]
# (default 1 2); CACHED=1 sweeps one copy of the 7 layers (in cache: the kernels' compute).
set -euo pipefail
. "$(dirname "$0")/csrc_ab.sh"
THREADS=("$@")
[ $# -eq 0 ] && THREADS=(1 2)
ab_build q8k_decode_sweep.cpp ${CXXFLAGS_EXTRA:-}
mode=()
[ -n "${CACHED:-}" ] && mode=(cached)
for r in $(seq "${ROUNDS:-8}"); do
  for t in "${THREADS[@]}"; do
    for tree in "${TREES[@]}"; do
      echo "$tree $("$OUT/$tree" "$t" "${REPS:-5}" "${mode[@]}")" >>"$OUT/log"
    done
  done
done
# the least sweep time of each tree and thread count
awk '{key=$1" "$3; v=$7+0; if (!(key in b) || v < b[key]) {b[key]=v; l[key]=$0}} END {for (k in l) print l[k]}' \
  "$OUT/log" | sort -k3,3n -k1,1
