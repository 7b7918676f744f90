"""Device bytes each kernel reads and writes per call, counted by the Metal emulator.

Runs every kernel once per configuration on a K x N layer (row scales, no bias) through
mlx_ternary.emulator and prints, per kernel launch, the bytes read from each buffer
(packed weights, x, scales, the pre-pass outputs...) and their sum; docs/KERNELS.md quotes
this table. Counts, not times: the emulator says nothing about speed.

    python scripts/bench/kernel_bytes.py [--k 2560] [--n 2560] [--tokens 1 4 8 16 64]
"""

import argparse

import mlx.core as mx
import numpy as np

from mlx_ternary import format as fmt
from mlx_ternary.runtime.metal import launch


def launches(packing, act, m, k, n, dtype):
    """[(kernel name, {buffer: bytes read}, bytes written)] of one call."""
    rng = np.random.default_rng(0)
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    pt = fmt.PackedTernary.from_trits(t, np.ones((n, 1), np.float32), packing, None)
    x = mx.array(rng.normal(size=(m, k)).astype(np.float32)).astype(dtype)
    launch.ternary_matmul(
        x,
        mx.array(pt.packed),
        mx.ones((n, 1), dtype=mx.float16),
        packing=packing,
        in_features=k,
        activation_bits=act,
        backend="emulate",
    )
    kind = launch.choose_kernel(m)
    names = ["prepass", "gemm"] if act and kind == "gemm" else ["gemm"] if kind == "gemm" else []
    names = names or [f"gemv_{packing}"]
    out = []
    for name in names:
        stats = launch.get_kernel(name, "emulate").last_stats
        out.append(
            (
                name,
                {b: v["read"] for b, v in stats.items() if v["read"]},
                sum(v["written"] for v in stats.values()),
            )
        )
    return out, pt.packed.nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2560)
    ap.add_argument("--n", type=int, default=2560)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    args = ap.parse_args()
    print(f"K = {args.k}, N = {args.n}, float16 x, row scales (float16); bytes per call")
    print(
        f"{'packing':8} {'x':5} {'M':>3}  {'kernel':13} {'read':>11} {'/weights':>8}  "
        "read per buffer"
    )
    for packing in ("fast", "compact"):
        for act in (None, 8):
            for m in args.tokens:
                rows, wbytes = launches(packing, act, m, args.k, args.n, mx.float16)
                total = 0
                for name, reads, _ in rows:
                    r = sum(reads.values())
                    total += r
                    parts = ", ".join(f"{b} {v:,}" for b, v in reads.items())
                    print(
                        f"{packing:8} {'int8' if act else 'fp16':5} {m:3d}  {name:13} "
                        f"{r:11,d} {r / wbytes:8.3f}  {parts}"
                    )
                if len(rows) > 1:
                    print(f"{'':19}{'call total':13} {total:11,d} {total / wbytes:8.3f}")


if __name__ == "__main__":
    main()
