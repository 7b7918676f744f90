"""Benchmark the ternary kernels against MLX's 2-bit and 4-bit quantized_matmul.

On a Mac (Metal available): every kernel variant's GB/s of packed weights (plus scales) at
decode (1/2/4/8 tokens) and prefill, beside mx.quantized_matmul 2-bit and 4-bit (group 64) on
the same shapes, and the fraction of the chip's bandwidth. Weights are rotated between runs
(enough copies to overflow the GPU caches) so no kernel is flattered by a cache hit. The last
table is the one that settles kernels.DEFAULT_PACKING: decode time per 1-token call, per
packing, best variant of each.

Elsewhere it says Metal is absent and times the reference path (reference.py).

    python scripts/bench_kernels.py                 # BitNet-2B and 27B shapes
    python scripts/bench_kernels.py --quick         # one small shape
    python scripts/bench_kernels.py --bandwidth 273 # chip bandwidth in GB/s if not known
    python scripts/bench_kernels.py --emulate       # check the script off a Mac (no speed)
"""

import argparse
import time

import mlx.core as mx
import numpy as np

from mlx_ternary import format as fmt
from mlx_ternary import metal_ops, reference

SHAPES = {  # name: (K in, N out)
    "2B qkv 2560->2560": (2560, 2560),
    "2B up 2560->6912": (2560, 6912),
    "2B down 6912->2560": (6912, 2560),
    "27B up 5120->17408": (5120, 17408),
    "27B down 17408->5120": (17408, 5120),
}
QUICK = {"small 1024->2048": (1024, 2048)}
DECODE_TOKENS = (1, 2, 4, 8)
PREFILL_TOKENS = 128
ROTATE_BYTES = 512 * 2**20  # weights cycled per measurement: well past any GPU cache
# Published unified-memory bandwidth (GB/s) by device name fragment (docs: shared/APPLE-GPU.md).
BANDWIDTH = {"M1 Ultra": 800, "M1 Max": 400, "M1 Pro": 200, "M1": 68, "M2 Ultra": 800,
             "M2 Max": 400, "M2 Pro": 200, "M2": 100, "M3 Ultra": 819, "M3 Max": 400,
             "M3 Pro": 150, "M3": 100, "M4 Max": 546, "M4 Pro": 273, "M4": 120}


def chip_bandwidth(override):
    if override:
        return override
    name = mx.metal.device_info().get("device_name", "") if mx.metal.is_available() else ""
    for key, bw in BANDWIDTH.items():  # longest names first in the dict order above
        if key in name:
            return bw
    return None


def make_weights(k, n, packing, copies, seed=0):
    """`copies` packed weights (separate buffers, same content) with fp16 group-128 scales."""
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    s = rng.uniform(0.5, 1.5, size=fmt.scales_shape("group", n, k, 128)).astype(np.float16)
    pt = fmt.PackedTernary.from_trits(t, s, packing, 128)
    out = [(mx.array(pt.packed.copy()), mx.array(s.copy())) for _ in range(copies)]
    mx.eval(out)
    return out


def make_affine(k, n, bits, copies, seed=0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.normal(size=(n, k)).astype(np.float16))
    q = [np.array(a) for a in mx.quantize(w, group_size=64, bits=bits)]
    out = [tuple(mx.array(a.copy()) for a in q) for _ in range(copies)]
    mx.eval(out)
    return out


def timeit(fn, weights, iters):
    """Seconds per call, cycling through `weights`."""
    for w in weights[:2]:
        mx.eval(fn(w))
    if mx.metal.is_available():
        mx.synchronize()
    start = time.perf_counter()
    for i in range(iters):
        mx.eval(fn(weights[i % len(weights)]))
    if mx.metal.is_available():
        mx.synchronize()
    return (time.perf_counter() - start) / iters


def nbytes(arrays):
    return sum(a.nbytes for a in arrays)


def bench_metal(shapes, bw, iters, backend="metal", tokens=DECODE_TOKENS + (PREFILL_TOKENS,)):
    rows = []
    for name, (k, n) in shapes.items():
        per_copy = n * k // 4
        copies = min(64, max(2, ROTATE_BYTES // per_copy))
        packs = {p: make_weights(k, n, p, copies) for p in fmt.PACKINGS}
        affine = {b: make_affine(k, n, b, copies) for b in (2, 4)}
        for m in tokens:
            x = mx.random.normal((m, k)).astype(mx.float16)
            variants = []
            for packing in fmt.PACKINGS:
                decodes = metal_ops.FAST_DECODES if packing == "fast" else metal_ops.COMPACT_DECODES
                if m <= metal_ops.MAX_GEMV_TOKENS:
                    choices = [(d, "gemv") for d in decodes]
                else:
                    choices = [(None, "gemm"), (None, "gemm_fma")]
                for dec, kern in choices:
                    def fn(w, packing=packing, dec=dec, kern=kern):
                        return metal_ops.ternary_matmul(
                            x, w[0], w[1], packing=packing, in_features=k, group_size=128,
                            backend=backend, decode=dec, kernel=kern)
                    variants.append((f"{packing}/{dec or kern}", fn, packs[packing]))
            for bits in (2, 4):
                def fn(w, bits=bits):
                    return mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=bits)
                variants.append((f"mlx {bits}-bit g64", fn, affine[bits]))
            for label, fn, ws in variants:
                sec = timeit(fn, ws, iters)
                gbs = nbytes(ws[0]) / sec / 1e9
                rows.append((name, m, label, sec * 1e6, gbs, gbs / bw if bw else float("nan")))
    return rows


def bench_reference(shapes, iters):
    rows = []
    for name, (k, n) in shapes.items():
        packs = {p: make_weights(k, n, p, 2) for p in fmt.PACKINGS}
        for m in (1, 8):
            x = mx.random.normal((m, k))
            for packing in fmt.PACKINGS:
                def fn(w, packing=packing):
                    return reference.ternary_matmul(x, w[0], w[1], packing=packing,
                                                    in_features=k, group_size=128)
                sec = timeit(fn, packs[packing], iters)
                rows.append((name, m, f"reference {packing}", sec * 1e6,
                             nbytes(packs[packing][0]) / sec / 1e9, float("nan")))
    return rows


def print_rows(rows):
    print(f"{'shape':24} {'M':>4} {'variant':20} {'us/call':>10} {'GB/s':>9} {'of BW':>7}")
    for name, m, label, us, gbs, frac in rows:
        print(f"{name:24} {m:4d} {label:20} {us:10.1f} {gbs:9.3f} {frac:7.1%}")


def print_verdict(rows):
    """Per shape, 1-token decode: the best variant of each packing, and the winner."""
    print("\ndefault packing (1-token decode, best variant per packing; lower us wins):")
    for name in dict.fromkeys(r[0] for r in rows):
        best = {}
        for r in rows:
            if r[0] == name and r[1] == 1:
                key = r[2].split("/")[0] if "/" in r[2] else r[2]
                if key not in best or r[3] < best[key][3]:
                    best[key] = r
        winner = min((v for k, v in best.items() if k in fmt.PACKINGS), key=lambda r: r[3])
        cols = "  ".join(f"{k}: {v[3]:.1f} us ({v[2]})" for k, v in best.items())
        print(f"  {name:24} {cols}  -> {winner[2].split('/')[0]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small shape")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--bandwidth", type=float, help="chip bandwidth in GB/s")
    ap.add_argument("--emulate", action="store_true",
                    help="run every variant once through the CPU emulator on a tiny shape: "
                         "checks this script off a Mac, measures nothing")
    args = ap.parse_args()
    shapes = QUICK if args.quick else SHAPES
    if args.emulate:
        rows = bench_metal({"tiny 128->40": (128, 40)}, None, 1, "emulate", (1, 8, 70))
        print_rows(rows)
        print_verdict(rows)
        return
    if not mx.metal.is_available():
        print("Metal is absent on this machine: timing the reference path (reference.py) "
              "on the CPU; the kernel variants need a Mac.")
        print_rows(bench_reference(shapes, max(3, args.iters // 10)))
        return
    bw = chip_bandwidth(args.bandwidth)
    print(f"device: {mx.metal.device_info().get('device_name')}, bandwidth "
          f"{bw or 'unknown (pass --bandwidth)'} GB/s, weights rotated over "
          f"{ROTATE_BYTES >> 20} MiB")
    rows = bench_metal(shapes, bw, args.iters)
    print_rows(rows)
    print_verdict(rows)


if __name__ == "__main__":
    main()
