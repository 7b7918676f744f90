"""Measure the candidate CPU paths for TernaryLinear side by side (one run, interleaved).

Usage: python scripts/bench/cpu_path_options.py [--tokens 1 16] [--repeats 7]

Options timed, with the resident bytes each keeps per weight:
  unpack-compact  unpack base-3 bytes to float per call, then matmul       (1.6 bpw)
  unpack-fast     unpack 2-bit codes to float per call, then matmul        (2.0 bpw)
  qmm-fast        mx.quantized_matmul reads the fast codes in place,       (2.0 bpw +
                  shared unit scale/bias arrays, scale applied to output    shared units)
  dense-f32       a cached float32 copy of W (for comparison only)         (32 bpw)
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from mlx_ternary import format as F
from mlx_ternary.runtime import reference

SHAPES = [(6912, 2560), (2560, 6912)]  # BitNet-2B MLP (out, in)


def _time(fn, repeats):
    mx.eval(fn())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - t0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    print(
        f"{'shape':>12} {'M':>3} {'option':>15} {'ms (median)':>12} {'min':>8} {'max':>8} "
        f"{'resident bpw':>12}"
    )
    for n, k in SHAPES:
        t = rng.integers(-1, 2, (n, k)).astype(np.int8)
        s = np.full((n, 1), 0.05, np.float32)
        compact = mx.array(F.pack_compact(t))
        fast = mx.array(F.pack_fast(t))
        scales = mx.array(s)
        dense = mx.array(t * s)
        affine = reference.qmm_affine(scales, n, F.fast_padded_k(k), None, mx.float32)
        mx.eval(compact, fast, dense, *affine[:2])
        for m in args.tokens:
            x = mx.array(rng.normal(size=(m, k)).astype(np.float32))
            options = {
                "unpack-compact": (
                    lambda: reference.matmul_compact(x, compact, scales, k),
                    8 * (compact.nbytes + scales.nbytes) / (n * k),
                ),
                "unpack-fast": (
                    lambda: (
                        (x @ F.unpack_fast_mx(fast, k).astype(mx.float32).T) * scales.reshape(-1)
                    ),
                    8 * (fast.nbytes + scales.nbytes) / (n * k),
                ),
                "qmm-fast": (
                    lambda: reference.matmul_fast(x, fast, scales, k, None, affine),
                    8 * (fast.nbytes + scales.nbytes) / (n * k),
                ),
                "dense-f32": (lambda: x @ dense.T, 32.0),
            }
            times = {name: [] for name in options}
            for _ in range(args.repeats):  # interleaved: noise hits every option alike
                for name, (fn, _) in options.items():
                    times[name] += _time(fn, 1)
            for name, (_, bpw) in options.items():
                ms = [1e3 * v for v in times[name]]
                print(
                    f"{n:>5}x{k:<6} {m:>3} {name:>15} {statistics.median(ms):>12.2f} "
                    f"{min(ms):>8.2f} {max(ms):>8.2f} {bpw:>12.3f}"
                )


if __name__ == "__main__":
    main()
