"""Device bytes each kernel reads per call, counted by the Metal emulator.

Runs every launch of one call per configuration on a K -> N layer (row scales, no bias,
float16 x) through mlx_ternary.emulator and prints, per launch, the bytes read from each
buffer (packed weights, x, scales, params...) and their sum; docs/KERNELS.md quotes this
table. Counts, not times: the emulator says nothing about speed.

    python scripts/bench/kernel_bytes.py [--k 2560] [--n 2560] [--tokens 1 4 8 16 64]
    python scripts/bench/kernel_bytes.py --check   # issue 30's targets at its three shapes

    python scripts/bench/kernel_bytes.py --times 9 64 --k 4096 --n 256   # emulator seconds

--times prints the emulator's own seconds per call (best of 3, the tokens interleaved, float16
x, row scales, fast packing): a CPU program's time, a rough proxy of a kernel's work that
docs/KERNELS.md quotes for 9 tokens (one GEMV launch) against 64 (one GEMM tile), kept out of
the test suite because it is a time.

--check asserts, for 2560 x 2560, 2560 -> 6912 and 4096 x 4096, both packings, int8 and
float activations: packed-weight bytes at every M <= 16 equal M = 1's; all bytes at M = 16
<= the 17-token (GEMM) call's; one launch per call up to 16 tokens; and all bytes at M = 1
<= the GEMV's before issue 30 (OLD_M1 below: this script's output at commit 54d154b).
"""

import argparse
import sys

import mlx.core as mx
import numpy as np

from mlx_ternary import format as fmt
from mlx_ternary.runtime.metal import launch

CHECK_SHAPES = ((2560, 2560), (2560, 6912), (4096, 4096))  # (K, N)
# All device bytes of one M = 1 call (fp16 x, row scales) before issue 30: pre-pass + GEMV
# with int8 activations; measured by this script at commit 54d154b.
OLD_M1 = {
    (2560, 2560): {
        ("fast", None): 5411840,
        ("fast", 8): 5843968,
        ("compact", None): 5166080,
        ("compact", 8): 5188608,
    },
    (2560, 6912): {
        ("fast", None): 14611968,
        ("fast", 8): 15757824,
        ("compact", None): 13948416,
        ("compact", 8): 13988352,
    },
    (4096, 4096): {
        ("fast", None): 13377536,
        ("fast", 8): 14460928,
        ("compact", None): 12673024,
        ("compact", 8): 12707840,
    },
}


def _layer(packing, k, n):
    rng = np.random.default_rng(0)
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    pt = fmt.PackedTernary.from_trits(t, np.ones((n, 1), np.float32), packing, None)
    return mx.array(pt.packed), mx.ones((n, 1), dtype=mx.float16)


def launches(packing, act, m, k, n, dtype=mx.float16, layer=None):
    """[(kernel name, {buffer: bytes read}, bytes written)] of one call, in launch order."""
    packed, scales = layer or _layer(packing, k, n)
    x = mx.array(np.random.default_rng(1).normal(size=(m, k)).astype(np.float32)).astype(dtype)
    spec = launch.check_layer(
        packed, scales, None, packing=packing, in_features=k, group_size=None, activation_bits=act
    )
    run, variants = launch.prepare(spec, packed, scales, None, dtype, (m, k), "emulate")
    mx.eval(run(x))
    out = []
    for variant in variants:  # one per launch
        stats = launch.get_kernel(variant[0], "emulate").last_stats
        reads = {b: v["read"] for b, v in stats.items() if v["read"]}
        out.append((variant[0], reads, sum(v["written"] for v in stats.values())))
    return out


def emulated_seconds(tokens, k, n, rounds=3):
    """{tokens: the emulator's best seconds for one call}, calls interleaved across tokens."""
    layer = _layer("fast", k, n)
    best = {m: float("inf") for m in tokens}
    for r in range(rounds + 1):  # the first round compiles
        for m in tokens:
            launches("fast", None, m, k, n, layer=layer)
            name = launch.choose_kernel(m, None)
            name = "gemm" if name.startswith("gemm") else "gemv_fast"
            if r:
                best[m] = min(best[m], launch.get_kernel(name, "emulate").last_launch.seconds)
    return best


def table(k, n, tokens):
    print(f"K = {k}, N = {n}, float16 x, row scales (float16); bytes per call")
    print(
        f"{'packing':8} {'x':5} {'M':>3}  {'kernel':13} {'read':>11} {'/weights':>8}  "
        "read per buffer"
    )
    for packing in fmt.PACKINGS[::-1]:
        layer = _layer(packing, k, n)
        wbytes = layer[0].nbytes
        for act in (None, 8):
            for m in tokens:
                rows = launches(packing, act, m, k, n, layer=layer)
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


def check() -> int:
    """Issue 30's byte targets at CHECK_SHAPES; prints one line per case, returns failures."""
    failures = 0
    for k, n in CHECK_SHAPES:
        for packing in fmt.PACKINGS[::-1]:
            layer = _layer(packing, k, n)
            for act in (None, 8):
                per_m = {}
                for m in (*range(1, launch.MAX_GEMV_TOKENS + 1), launch.MAX_GEMV_TOKENS + 1):
                    rows = launches(packing, act, m, k, n, layer=layer)
                    per_m[m] = (
                        sum(r.get("wq", 0) for _, r, _ in rows),
                        sum(sum(r.values()) for _, r, _ in rows),
                        len(rows),
                    )
                w1, t1, _ = per_m[1]
                t16, t17 = per_m[16][1], per_m[17][1]
                old = OLD_M1[(k, n)][(packing, act)]
                ok = (
                    all(per_m[m][0] == w1 for m in range(1, 17))
                    and all(per_m[m][2] == 1 for m in range(1, 17))
                    and t16 <= t17
                    and t1 <= old
                )
                failures += not ok
                print(
                    f"{'ok  ' if ok else 'FAIL'} {k}x{n} {packing:7} {'int8' if act else 'fp16'}: "
                    f"weights read {w1:,} B at every M <= 16; M = 16 {t16:,} B <= M = 17 "
                    f"{t17:,} B ({t16 / t17:.2f}x); M = 1 {t1:,} B <= before {old:,} B "
                    f"({t1 / old:.2f}x); one launch per call up to 16 tokens"
                )
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2560)
    ap.add_argument("--n", type=int, default=2560)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 17, 64])
    ap.add_argument("--check", action="store_true", help="assert issue 30's targets")
    ap.add_argument("--times", type=int, nargs="+", help="the emulator's seconds at these tokens")
    args = ap.parse_args()
    if args.check:
        sys.exit(1 if check() else 0)
    if args.times:
        best = emulated_seconds(args.times, args.k, args.n)
        for m, sec in best.items():
            print(
                f"{m:3d} tokens: {sec * 1e3:8.2f} ms in the emulator ({sec / best[max(best)]:.2f}x)"
            )
        return
    table(args.k, args.n, args.tokens)


if __name__ == "__main__":
    main()
