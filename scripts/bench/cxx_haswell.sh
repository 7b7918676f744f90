#!/bin/sh
# c++ with -march=native replaced by -march=haswell (AVX2, FMA, F16C; no AVX-512)
# MLX_TERNARY_NATIVE_CXX=scripts/bench/cxx_haswell.sh (with a separate MLX_TERNARY_NATIVE_CACHE)
# builds the native extension as for an AVX2 machine without AVX-512 (docs/NATIVE.md).

for a in "$@"; do
  case "$a" in
    -march=native) a="-march=haswell" ;;
  esac
  set -- "$@" "$a"
  shift
done
exec c++ "$@"
