#!/usr/bin/env bash
# CI on aarch64 (the Mac's CPU architecture; docs/NATIVE.md "aarch64 in CI"), under qemu-user
# on an x86 machine, no binfmt:
#   1. the NEON self-check (scripts/bench/check_native_isas.sh --arm-only) for armv8-a,
#      armv8.2-a+dotprod and armv8.2-a+dotprod+i8mm;
#   2. the native-backend test files on the aarch64 stack: Debian's arm64 python3.11 and MLX's
#      Linux aarch64 wheel in a private sysroot, run with qemu-aarch64 -L <sysroot>.
# Installs g++-aarch64-linux-gnu and qemu-user-static with apt-get when missing. The sysroot is
# (glibc 2.36: MLX's wheel is manylinux_2_35) cached outside the checkout, keyed by the versions below ($MLX_TERNARY_CI_CACHE moves it).
# Every aarch64 process gets a private TMPDIR: MLX's JIT cache lives in $TMPDIR/mlx/<ver>/cpu,
# and aarch64 objects there would break every x86 MLX process on the machine.
# Exit status 0 only when every check ran and passed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY=3.11
MLX=0.32.4
# What the native test files import, pinned so the cache key names the whole stack.
WHEELS=(
  "mlx==$MLX" "mlx-cpu==$MLX" "numpy==2.4.6" "nanobind==3.1.0" "pytest==9.2.0"
  "iniconfig==2.3.1" "pluggy==1.7.0" "packaging==26.4" "pygments==2.21.0"
  "gguf==0.19.0" "pyyaml==6.0.4" "tqdm==4.70.1" "safetensors==0.8.0"
  # mlx-lm and what importing it loads (tokenizers, transformers, the Hub client)
  "mlx-lm==0.32.2" "transformers==5.25.0" "tokenizers==0.23.3" "huggingface_hub==2.4.0"
  "regex==2026.11.19" "filelock==4.3.2" "fsspec==2026.9.0" "typing_extensions==4.16.0"
  "jinja2==3.1.6" "markupsafe==3.0.4" "sentencepiece==0.2.3" "protobuf==7.36.2"
  "httpx2==2.16.2" "httpcore2==2.16.2" "h11==0.16.0" "anyio==4.16.0" "sniffio==1.3.1"
  "idna==3.20" "certifi==2026.10.19.post1" "truststore==0.10.5" "hf-xet==1.8.0" "click==8.5.1"
  "rich==15.0.0" "markdown-it-py==4.3.0" "mdurl==0.1.2"
)
DEBS=(
  python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev libc6
  libgcc-s1 libstdc++6 libexpat1 zlib1g libffi8 libssl3 libbz2-1.0 liblzma5 libuuid1
  libsqlite3-0 libcrypt1 libncursesw6 libtinfo6 libreadline8 libgomp1
)
KEY="py$PY-mlx$MLX-$(printf '%s\n' "${WHEELS[@]}" "${DEBS[@]}" | sha256sum | cut -c1-12)"
CACHE="${MLX_TERNARY_CI_CACHE:-$HOME/.cache/mlx_ternary-ci}/aarch64/$KEY"
SYSROOT="$CACHE/sysroot"
SITE="$CACHE/site-packages"

need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  dpkg --add-architecture arm64
  apt-get update -qq
fi
if [ "${#need[@]}" -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
QEMU=(qemu-aarch64-static -cpu max)

# One CI run at a time builds the sysroot (another waits, then finds it complete).
mkdir -p "$(dirname "$CACHE")"
exec 9>"$(dirname "$CACHE").lock"
flock 9
if [ ! -f "$CACHE/.complete" ]; then
  echo "== aarch64 sysroot: building $CACHE"
  rm -rf "$(dirname "$CACHE")"  # stacks of other versions too
  mkdir -p "$CACHE/debs" "$SYSROOT" "$SITE"
  if ! (cd "$CACHE/debs" && apt-get download -qq "${DEBS[@]/%/:arm64}" 2>/dev/null); then
    apt-get update -qq
    (cd "$CACHE/debs" && apt-get download -qq "${DEBS[@]/%/:arm64}")
  fi
  for deb in "$CACHE"/debs/*.deb; do dpkg-deb -x "$deb" "$SYSROOT"; done
  rm -f "$SYSROOT"/usr/lib/python$PY/config-*/*.a  # the static libpython: unused
  python3 -m pip install -q --root-user-action=ignore --no-deps --target "$SITE" \
    --platform manylinux_2_35_aarch64 --platform manylinux_2_28_aarch64 \
    --platform manylinux_2_17_aarch64 --python-version "$PY" --implementation cp \
    --only-binary=:all: "${WHEELS[@]}"
  rm -rf "$CACHE/debs"
  touch "$CACHE/.complete"
fi
flock -u 9

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# MLX's CPU JIT runs "g++" from PATH: on this machine that must be the aarch64 cross compiler.
# The extension's build asks for -mcpu=native, which a cross compiler cannot detect: the
# wrapper names the CPU the tests run on (qemu's "max" has SDOT and SMMLA).
ARCH="armv8.2-a+dotprod+i8mm"
mkdir -p "$work/bin" "$work/tmp"
ln -s "$(command -v aarch64-linux-gnu-g++)" "$work/bin/g++"
cat >"$work/bin/aarch64-cxx" <<EOF
#!/usr/bin/env bash
args=()
for a in "\$@"; do [ "\$a" = -mcpu=native ] && a=-march=$ARCH; args+=("\$a"); done
# Debian's pyconfig.h includes <aarch64-linux-gnu/python3.11/pyconfig.h>: searched last.
exec aarch64-linux-gnu-g++ "\${args[@]}" -idirafter "$SYSROOT/usr/include"
EOF
chmod +x "$work/bin/aarch64-cxx"

status=0
echo "== NEON self-check (cross-built, run under qemu)"
TMPDIR="$work/tmp" bash "$ROOT/scripts/bench/check_native_isas.sh" --arm-only || status=1

echo "== native-backend tests on aarch64 (python$PY, mlx $MLX, under qemu)"
(
  cd "$ROOT"
  export TMPDIR="$work/tmp" PATH="$work/bin:$PATH" PYTHONPATH="$SITE:$ROOT:$ROOT/tests"
  export PYTHONDONTWRITEBYTECODE=1 PYTHONNOUSERSITE=1
  export MLX_TERNARY_NATIVE_CXX="$work/bin/aarch64-cxx"
  export MLX_TERNARY_NATIVE_CACHE="$CACHE/native-$ARCH"  # keyed by source hash: reruns reuse it
  # No binfmt: a test that starts a second Python starts it through qemu (tests/tiny.py).
  export MLX_TERNARY_TEST_PYTHON="${QEMU[*]} -L $SYSROOT $SYSROOT/usr/bin/python$PY"
  "${QEMU[@]}" -L "$SYSROOT" "$SYSROOT/usr/bin/python$PY" -m pytest -q -p no:cacheprovider \
    tests/runtime/test_native.py tests/runtime/test_native_build_safety.py \
    tests/runtime/test_q8k.py tests/runtime/test_ggml_tables.py
) || status=1
exit $status
