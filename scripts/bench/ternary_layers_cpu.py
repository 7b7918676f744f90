"""One decode token through a model's ternary layers alone, every layer's call in one mx.eval.

    python scripts/bench/ternary_layers_cpu.py --model DIR_OR_GGUF [--threads 1] [--repeats 20]

Prints the least process CPU time and wall time of the calls (the graph is built before the
clock starts). With one thread the CPU time is the kernels' own on a shared machine; to compare
two checkouts, run it alternately under each (PYTHONPATH=OTHER/ first) and compare the minima.
"""

import argparse
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()

    import mlx.core as mx

    import mlx_ternary
    from mlx_ternary.runtime import cpu
    from mlx_ternary.runtime.layers import ternary_layers

    model, _ = mlx_ternary.load(a.model)
    cpu.set_num_threads(a.threads)
    layers = [m for _, m in ternary_layers(model)]
    xs = {k: mx.random.normal((1, 1, k)) for k in {m.in_features for m in layers}}
    mx.eval(xs)
    cpu_ms, wall_ms = [], []
    for _ in range(a.repeats + 2):  # the first 2: warm-up
        outs = [m(xs[m.in_features]) for m in layers]
        w, c = time.perf_counter(), time.process_time()
        mx.eval(outs)
        wall_ms.append(1e3 * (time.perf_counter() - w))
        cpu_ms.append(1e3 * (time.process_time() - c))
    print(
        f"{mlx_ternary.__file__}: {len(layers)} ternary layers, {a.threads} thread(s), "
        f"{cpu.info()['isa']}: CPU ms min {min(cpu_ms[2:]):.2f}, wall ms min {min(wall_ms[2:]):.2f}"
    )


if __name__ == "__main__":
    main()
