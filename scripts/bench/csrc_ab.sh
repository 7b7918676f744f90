# Sourced by the benchmarks that build a program from the native kernels' sources (csrc) of
# this tree and, with BASE=<another checkout's csrc>, of another, to run them alternated:
# q8k_prefill_gemm.sh, q8k_decode_sweep.sh, decode_pool.sh. Sets SRC (this tree's csrc), OUT
# (a temporary directory, removed on exit) and, after `ab_build PROGRAM.cpp [FLAG ...]`, TREES
# (base this, or this) with the programs at $OUT/<tree>. MARCH=haswell builds for AVX2 (default
# native). The contraction flag is the extension's, read from build.py (its one home).
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../mlx_ternary/runtime/cpu/csrc" && pwd)"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
CONTRACT=$(grep -o -- '"-ffp-contract=[a-z]*"' "$SRC/../build.py" | tr -d '"')

# ab_build PROGRAM.cpp [FLAG ...]: $OUT/this from this tree's csrc, $OUT/base from $BASE's;
# a function ab_flags TREE_CSRC, where the caller defines one, adds flags for one tree
ab_build() {
  local prog="$(dirname "${BASH_SOURCE[0]}")/$1" tree name extra
  shift
  TREES=(this)
  [ -n "${BASE:-}" ] && TREES=(base this)
  for name in "${TREES[@]}"; do
    tree=$SRC
    [ "$name" = base ] && tree=$BASE
    extra=()
    declare -F ab_flags >/dev/null && read -ra extra <<<"$(ab_flags "$tree")"
    g++ -std=c++20 -O3 "$CONTRACT" -w -march="${MARCH:-native}" -pthread "${extra[@]}" "$@" \
      -I"$tree" "$prog" -o "$OUT/$name"
  done
}
