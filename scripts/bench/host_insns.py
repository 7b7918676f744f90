"""Instructions per layer call on the host, for A/B tests that the machine's load cannot blur.

Runs one path of `mlx-ternary bench --overhead` (2560 -> 2560, one float16 token, Metal
launches stubbed) `calls` times after a warm-up; run it under valgrind twice, with and
without the calls, and divide the difference (docs/KERNELS.md, "Host time", quotes it):

    for n in 0 4000; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python scripts/bench/host_insns.py layer $n 2>&1 | grep Collected; done

Paths: stock (nn.QuantizedLinear 2-bit g64), stub (the stub's launch alone, as the bench's
row), layer (TernaryLinear on the Metal path), and the layer's repeated call taken apart:
launch (a function that only launches as the layer does), shape (+ the shape check),
check (+ the dtype check).
"""

import sys

import mlx.core as mx
import mlx.nn as nn

from mlx_ternary.bench import overhead as ov
from mlx_ternary.runtime import cpu

K = N = 2560
WARMUP = 200


def main(path: str, calls: int) -> None:
    cpu.available = lambda *a, **k: False  # the Metal rows only: no native build
    x = mx.zeros((1, 1, K), mx.float16)
    stock = nn.QuantizedLinear(K, N, False, group_size=64, bits=2)
    stock.set_dtype(mx.float16)
    with ov.stubbed_metal() as stub:
        layer = ov._ternary(K, N, False, "metal")
        layer.eval()
        layer(x)
        shape, dtype, _, kern, w, s, b, p, tmpl, grid, tg, osh, odt = layer._last

        def launch(x):
            return kern(
                inputs=[x, w, s, b, p],
                template=tmpl,
                grid=grid,
                threadgroup=tg,
                output_shapes=osh,
                output_dtypes=odt,
            )[0]

        def with_shape(x):
            if x.shape == shape:
                return kern(
                    inputs=[x, w, s, b, p],
                    template=tmpl,
                    grid=grid,
                    threadgroup=tg,
                    output_shapes=osh,
                    output_dtypes=odt,
                )[0]

        def with_check(x):
            if x.shape == shape and x.dtype == dtype:
                return kern(
                    inputs=[x, w, s, b, p],
                    template=tmpl,
                    grid=grid,
                    threadgroup=tg,
                    output_shapes=osh,
                    output_dtypes=odt,
                )[0]

        fns = {
            "stock": lambda: stock(x),
            "stub": lambda: stub(
                inputs=[x],
                template=[],
                grid=(1, 1, 1),
                threadgroup=(1, 1, 1),
                output_shapes=[(1, 1, N)],
                output_dtypes=[mx.float16],
            ),
            "layer": lambda: layer(x),
            "launch": lambda: launch(x),
            "shape": lambda: with_shape(x),
            "check": lambda: with_check(x),
        }
        fn = fns[path]
        for _ in range(WARMUP):
            fn()
        for _ in range(calls):
            fn()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
