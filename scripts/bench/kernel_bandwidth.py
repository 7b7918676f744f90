"""The native CPU kernels' effective bandwidth at the 0.53 G llama's shapes, beside the machine's.

    python scripts/bench/kernel_bandwidth.py [--threads 2] [--repeats 15] [--skip-bandwidth]

A TQ2_0 file as written: fast packing, float16 scales per 256 columns, llama.cpp's Q8_K
activations (q8k). Printed, medians over the repeats (and the min), each row timed inside one
mx.eval so no Python runs between the calls:

- decode (1 token) of each layer shape: ms per call and GB/s of packed weights + scales read;
  weights rotate over enough copies (>= 96 MB) that the last-level cache holds none of them
  (--cached: one copy, so the rows measure the kernel's own speed);
- "tiny" (16 x 256): the fixed cost of one call (pool wake, activation prep, MLX's primitive);
- the whole 84-layer sweep of one token (12 x q, k, v, o, gate, up, down; distinct weights);
- the float16 32000 x 2048 output layer (dense_matmul), one token;
- 128-token GEMMs of each shape: G int8 MACs/s (N * K * 128 per call);
- the streaming-read bandwidth of this machine (mlx_ternary/bench/bandwidth.py) on 1 and N
  threads, for scale.

The numbers are what one build does: compare two builds by running this script for each,
back to back (the extension cache is keyed by the sources, so a second XDG_CACHE_HOME holds
the other build), on a machine as quiet as can be had.
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from mlx_ternary.format import Q8K
from mlx_ternary.runtime import cpu

HIDDEN, INTER, KV, VOCAB, LAYERS = 2048, 5632, 256, 32000, 12
SHAPES = {  # name: (N out, K in)
    "q/o 2048x2048": (HIDDEN, HIDDEN),
    "k/v 256x2048": (KV, HIDDEN),
    "gate/up 5632x2048": (INTER, HIDDEN),
    "down 2048x5632": (HIDDEN, INTER),
    "tiny 16x256": (16, 256),
}
ROTATE_BYTES = 96 << 20
GROUP = 256


def layer(rng, n, k):
    """(packed uint32 (n, k/16), float16 scales (n, k/256)): random trits, fast packing."""
    codes = rng.integers(0, 3, size=(n, k // 4, 4), dtype=np.uint8)
    b = codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)
    packed = mx.array(np.ascontiguousarray(b).view(np.uint32))
    scales = mx.array(rng.uniform(0.5, 1.5, size=(n, k // GROUP)).astype(np.float16))
    return packed, scales


def nbytes(w):
    return w[0].nbytes + w[1].nbytes


def matmul(x, w, k):
    return cpu.ternary_matmul(
        x, w[0], w[1], packing="fast", in_features=k, group_size=GROUP, activation_bits=Q8K
    )


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = [time.perf_counter]


def timed(make, repeats):
    """Median and min seconds of mx.eval(make()) (the graph built before the clock starts)."""
    mx.eval(make())
    ts = []
    for _ in range(repeats):
        outs = make()
        t = CLOCK[0]()
        mx.eval(outs)
        ts.append(CLOCK[0]() - t)
    return statistics.median(ts), min(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=128, help="prefill tokens")
    ap.add_argument("--skip-bandwidth", action="store_true")
    ap.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="cpu: the process's CPU time (with --threads 1, the kernel's own time on a loaded "
        "machine; with more threads it counts the pool's spinning too)",
    )
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument(
        "--cached",
        action="store_true",
        help="decode rows on one copy of each layer (in cache): the kernel's compute, not DRAM",
    )
    args = ap.parse_args()
    CLOCK[0] = CLOCKS[args.clock]
    if not cpu.available():
        raise SystemExit(f"no native backend: {cpu.unavailable_reason()}")
    cpu.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(
        f"native {cpu.info()}, {args.threads} threads, {args.clock} clock, "
        f"medians (min) of {args.repeats}"
    )

    print(f"\n{'decode, 1 token':22} {'ms/call':>9} {'min':>7} {'GB/s':>6} {'max':>6}")
    weights = {}
    for name, (n, k) in SHAPES.items():
        one = layer(rng, n, k)
        if name.startswith("tiny") or args.cached:  # one cached weight, many calls
            copies = [one] * 200
        else:
            count = min(800, max(1, ROTATE_BYTES // nbytes(one)))
            copies = [one] + [layer(rng, n, k) for _ in range(count - 1)]
        weights[name] = copies
        x = mx.array(rng.normal(size=(1, k)).astype(np.float32))
        med, lo = timed(lambda c=copies, x=x, k=k: [matmul(x, w, k) for w in c], args.repeats)
        per, per_lo = med / len(copies), lo / len(copies)
        b = nbytes(one)
        print(
            f"{name:22} {1e3 * per:9.4f} {1e3 * per_lo:7.4f} {b / per / 1e9:6.2f} "
            f"{b / per_lo / 1e9:6.2f}"
        )

    stack = []
    for _ in range(LAYERS):
        for name in ("q/o", "k/v", "k/v", "q/o", "gate/up", "gate/up", "down"):
            key = next(s for s in SHAPES if s.startswith(name))
            n, k = SHAPES[key]
            stack.append((layer(rng, n, k), k))
    xs = {k: mx.array(rng.normal(size=(1, k)).astype(np.float32)) for k in (HIDDEN, INTER)}
    med, lo = timed(lambda: [matmul(xs[k], w, k) for w, k in stack], args.repeats)
    b = sum(nbytes(w) for w, _ in stack)
    print(
        f"{'84-layer sweep':22} {1e3 * med:9.3f} {1e3 * lo:7.3f} {b / med / 1e9:6.2f} "
        f"{b / lo / 1e9:6.2f}   ({b / 1e6:.1f} MB)"
    )
    stack.clear()

    head = mx.array(rng.normal(scale=0.02, size=(VOCAB, HIDDEN)).astype(np.float16))
    heads = [head, head + 0]  # two copies: 262 MB, none of it cached between calls
    mx.eval(heads)
    x = xs[HIDDEN]
    med, lo = timed(lambda: [cpu.dense_matmul(x, h) for h in heads], args.repeats)
    med, lo = med / 2, lo / 2
    print(
        f"{'lm_head f16 32000x2048':22} {1e3 * med:9.3f} {1e3 * lo:7.3f} "
        f"{head.nbytes / med / 1e9:6.2f} {head.nbytes / lo / 1e9:6.2f}"
    )
    heads.clear()

    m = args.tokens
    if args.skip_prefill:
        weights.clear()
    print(f"\n{f'prefill, {m} tokens':22} {'ms/call':>9} {'min':>7} {'GMAC/s':>7} {'max':>7}")
    for name, (n, k) in SHAPES.items():
        if name.startswith("tiny") or name not in weights:
            continue
        w = weights[name][0]
        x = mx.array(rng.normal(size=(m, k)).astype(np.float32))
        med, lo = timed(lambda w=w, x=x, k=k: [matmul(x, w, k) for _ in range(4)], args.repeats)
        med, lo = med / 4, lo / 4
        macs = n * k * m
        print(
            f"{name:22} {1e3 * med:9.3f} {1e3 * lo:7.3f} {macs / med / 1e9:7.1f} "
            f"{macs / lo / 1e9:7.1f}"
        )

    if not args.skip_bandwidth:
        from mlx_ternary.bench import bandwidth

        bw = bandwidth.measure(threads=sorted({1, args.threads}), mb=512)
        print(
            "\nstreaming read: "
            + ", ".join(f"{t} thread{'s' * (t > 1)} {g:.1f} GB/s" for t, g in bw["gbs"].items())
            + f" ({bw['method']})"
        )


if __name__ == "__main__":
    main()
