#!/usr/bin/env bash
# q8k prefill GEMMs of the 0.53 G llama's and BitNet 2B4T's layer shapes, one thread, for this
# tree and optionally another (BASE=<another checkout's csrc>, e.g. main's), runs alternated,
# ROUNDS rounds, the best of each printed (docs/NATIVE.md "row panels"). MARCH=haswell builds
# for AVX2. Usage: q8k_prefill_gemm.sh [M ...] (default 128 2048).
set -euo pipefail
. "$(dirname "$0")/csrc_ab.sh"
MS=("$@")
[ $# -eq 0 ] && MS=(128 2048)
ab_flags() {  # a tree's own prefill chunks where it has panels
  grep -q q8k_panel_chunk "$1/kernels/q8k.h" && echo -DPANEL_CHUNK || true
}
ab_build q8k_prefill_gemm.cpp
SHAPES=("2048 2048" "256 2048" "5632 2048" "2048 5632" "2560 2560" "640 2560" "6912 2560" "2560 6912")
for r in $(seq "${ROUNDS:-2}"); do
  for m in "${MS[@]}"; do
    for s in "${SHAPES[@]}"; do
      for t in "${TREES[@]}"; do
        reps=$((m >= 1024 ? 2 : 5))
        echo "$t $("$OUT/$t" $s "$m" $reps)" >>"$OUT/log"
      done
    done
  done
done
# the best (highest G MACs/s) of each tree and shape
sort -t, -k3 "$OUT/log" | awk '{key=$1" "$3" "$5" "$6; v=$(NF-3)+0; if (!(key in b) || v > b[key]) {b[key]=v; l[key]=$0}} END {for (k in l) print l[k]}' | sort -k6,6n -k3,3n -k5,5n -k1,1
