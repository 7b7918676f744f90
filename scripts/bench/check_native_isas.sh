#!/usr/bin/env bash
# Check the native kernels' SIMD paths beyond the one this machine runs (docs/NATIVE.md):
#   - this CPU (-march=native): the self-check, run (with --arm-only too: the reference digest);
#   - x86-64 AVX2 without AVX-512 (-march=haswell), run where this CPU has AVX2;
#   - arm64 NEON without and with SDOT, and with SDOT + i8mm (the SMMLA tiles): cross-compiled
#     and run under qemu-user, when
#     aarch64-linux-gnu-g++ and qemu-aarch64(-static) are installed
#     (Debian: apt-get install g++-aarch64-linux-gnu qemu-user-static);
#   - AVX-VNNI / AVX-512 VNNI: compiled only, and the VNNI instruction must be emitted.
# Every run build prints digests of its integer-activation outputs (selfcheck.h): the exact
# records must equal this CPU's on every ISA, and group-scaled int8 must be one on arm64.
# --arm-only: only the arm64 builds, and a missing cross compiler or qemu is a failure
# (scripts/ci_aarch64.sh). Exit status 0 when every check that could run passed.
set -uo pipefail
SRC="$(cd "$(dirname "$0")/../../mlx_ternary/runtime/cpu/csrc" && pwd)"  # selftest.cpp, arch/ ...
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
CXX="${CXX:-g++}"
# The extension's floating-point contraction flag, read from build.py (its one home): the
# digests below differ between ISAs if it is dropped.
CONTRACT=$(grep -o -- '"-ffp-contract=[a-z]*"' "$SRC/../build.py" | tr -d '"')
FLAGS=(-std=c++20 -O2 $CONTRACT -I"$SRC")
status=0
ARM_ONLY=0
[ "${1:-}" = "--arm-only" ] && ARM_ONLY=1

# run NAME CMD...: runs a self-check, prints its output, keeps its digests in $OUT/NAME.d
run() {
  local name=$1
  shift
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  cat "$OUT/$name.log"
  grep digest "$OUT/$name.log" >"$OUT/$name.d"
  return $rc
}
# same A B WHICH: the digests WHICH (exact or grouped) of two builds agree
same() {
  if [ "$(grep "^$3" "$OUT/$1.d")" != "$(grep "^$3" "$OUT/$2.d")" ] || [ ! -s "$OUT/$1.d" ]; then
    echo "FAIL: $1 and $2 differ in their $3 integer-activation outputs"
    return 1
  fi
  echo "$1 = $2 ($3 digest)"
}

echo "== this CPU"
"$CXX" "${FLAGS[@]}" -march=native "$SRC/selftest.cpp" -o "$OUT/native" && run native "$OUT/native" \
  || status=1

if [ "$ARM_ONLY" = 0 ] && grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
  echo "== x86-64 -march=haswell (AVX2 + FMA + F16C, no AVX-512)"
  "$CXX" "${FLAGS[@]}" -march=haswell "$SRC/selftest.cpp" -o "$OUT/avx2" && run avx2 "$OUT/avx2" \
    || status=1
  same native avx2 exact || status=1
fi

QEMU="$(command -v qemu-aarch64-static || command -v qemu-aarch64 || true)"
if command -v aarch64-linux-gnu-g++ >/dev/null && [ -n "$QEMU" ]; then
  # qemu's "max" CPU has SDOT and SMMLA (i8mm), so all three run.
  for arch in armv8-a armv8.2-a+dotprod armv8.2-a+dotprod+i8mm; do
    echo "== arm64 -march=$arch (run under $(basename "$QEMU"))"
    aarch64-linux-gnu-g++ "${FLAGS[@]}" -march="$arch" -static "$SRC/selftest.cpp" -o "$OUT/arm" \
      && run "$arch" "$QEMU" -cpu max "$OUT/arm" || status=1
    # exact records: bit for bit this machine's; group-scaled int8: one lane order on arm64
    same "$arch" native exact || status=1
    same "$arch" armv8-a grouped || status=1
    # the +i8mm build must have checked the i8mm (SMMLA) tiles (arch/neon.h has_mmla)
    if [[ "$arch" == *i8mm* ]] && ! grep -q '^neon-dotprod-i8mm ' "$OUT/$arch.log"; then
      echo "FAIL: the $arch build does not select the SMMLA tiles"
      status=1
    fi
  done
else
  echo "== arm64: skipped (no aarch64-linux-gnu-g++ or qemu-aarch64)"
  [ "$ARM_ONLY" = 1 ] && status=1
fi
[ "$ARM_ONLY" = 1 ] && exit $status

for arch in alderlake icelake-server sapphirerapids; do
  echo "== x86-64 -march=$arch: compile only"
  if "$CXX" "${FLAGS[@]}" -march="$arch" -S "$SRC/selftest.cpp" -o "$OUT/$arch.s"; then
    n=$(grep -c vpdpbusd "$OUT/$arch.s")
    echo "vpdpbusd instructions: $n"
    [ "$n" -gt 0 ] || status=1
  else
    status=1
  fi
done
exit $status
