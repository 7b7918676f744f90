"""Benchmark the ternary kernels against stock MLX 2-bit and 4-bit on a Mac.

The same as `mlx-ternary bench --kernels`: every kernel variant, checked against its
reference twin before it is timed, in chains of >= 50 dependent calls per evaluation
(no CPU-GPU round trip per call), weights rotated over copies, beside stock
mx.quantized_matmul 2-bit on the very same words and 4-bit g64, with a copy bandwidth
measured in the same run (mlx_ternary/kernels.py has the details).

    python scripts/bench_kernels.py --json kernels.json      # on a Mac, ~5-10 minutes
    python scripts/bench_kernels.py --quick                  # one shape
    python scripts/bench_kernels.py --backend emulate --quick  # off a Mac: smoke run, no timing
"""

import argparse
import json
import sys

from mlx_ternary.bench import kernels
from mlx_ternary.errors import TernaryError


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["metal", "emulate"], default="metal")
    ap.add_argument("--quick", action="store_true", help="one shape, fewer token counts")
    ap.add_argument("--bandwidth", type=float, help="chip bandwidth in GB/s if not known")
    ap.add_argument("--json", default=None, help="write the full results here")
    args = ap.parse_args()
    try:
        result = kernels.run(
            args.backend, args.quick, args.bandwidth, progress=lambda s: print(s, file=sys.stderr)
        )
    except TernaryError as e:
        sys.exit(f"error: {e}")
    print("\n".join(kernels.lines(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
