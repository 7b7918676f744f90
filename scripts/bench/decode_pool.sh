#!/usr/bin/env bash
# A decode step's ternary layers outside MLX (decode_pool.cpp): this tree and optionally another
# (BASE=<another checkout's csrc>, e.g. main's), runs alternated, ROUNDS rounds, the best of each
# printed (docs/NATIVE.md "Threads"). Usage: decode_pool.sh SHAPE(b2b|small) THREADS [GAP_US ...]
# (default gaps 0 20 50); HOT=1: weights in cache; ROW_SCALES=1: a scale a row, as load() keeps
# both models; CPT=N: N chunks a thread (decode_pool.cpp). MARCH=haswell builds for AVX2.
set -euo pipefail
. "$(dirname "$0")/csrc_ab.sh"
SHAPE=${1:-b2b}
THREADS=${2:-2}
shift $(($# < 2 ? $# : 2))
GAPS=("$@")
[ ${#GAPS[@]} -eq 0 ] && GAPS=(0 20 50)
ab_build decode_pool.cpp
HOTARG=()
[ -n "${HOT:-}" ] && HOTARG=(hot)
for r in $(seq "${ROUNDS:-4}"); do
  for gap in "${GAPS[@]}"; do
    for t in "${TREES[@]}"; do
      echo "$t $(GAP_US=$gap "$OUT/$t" "$SHAPE" "$THREADS" 5 "${HOTARG[@]}")" >>"$OUT/log"
    done
  done
done
# the best (least ms) of each tree and gap, with every round's worker share
awk -F': ' '{split($1, h, " "); key=h[1]" "$1; ms=$2+0; match($2, /ran [0-9.]+/);
             share[key]=share[key]" "substr($2, RSTART+4, RLENGTH-4);
             if (!(key in b) || ms < b[key]) {b[key]=ms; l[key]=$0}}
     END {for (k in l) print l[k], "| workers ran:" share[k]}' "$OUT/log" | sort -t, -k3,3n -k1,1
