"""Whole decode steps as mlx-lm generates them: the process's CPU time and the wall time a token.

    python scripts/bench/decode_cpu_time.py --model GGUF_OR_DIR [--tokens 64] [--runs 5]
        [--threads 1]

Each run is mlx-lm's `generate_step` after its own 16-token prompt (the sampler's
log-probabilities included, as every mlx-lm generation computes them); the clocks start at
the first decoded token. Prints the best and median over the runs of the process CPU ms and
wall ms per token. With one thread the CPU time is the step's own work on a shared machine;
to compare two checkouts, run it alternately under each (PYTHONPATH=OTHER/ first) in fresh
processes and compare the minima (docs/NATIVE.md, the AVX2 decode against ik_llama.cpp).
"""

import argparse
import statistics
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import mlx_ternary
    from mlx_ternary.runtime import cpu

    model, _ = mlx_ternary.load(a.model)
    cpu.set_num_threads(a.threads)
    for _ in generate_step(mx.array([1, 2, 3, 4], dtype=mx.uint32), model, max_tokens=4):
        pass  # warm: the extension, MLX's caches
    cpu_ms, wall_ms = [], []
    for r in range(a.runs):
        prompt = mx.array(list(range(100 + r, 116 + r)), dtype=mx.uint32)
        for k, _ in enumerate(generate_step(prompt, model, max_tokens=a.tokens)):
            if k == 0:
                c0, w0 = time.process_time(), time.perf_counter()
        cpu_ms.append(1e3 * (time.process_time() - c0) / (a.tokens - 1))
        wall_ms.append(1e3 * (time.perf_counter() - w0) / (a.tokens - 1))
    print(
        f"{mlx_ternary.__file__}: {a.threads} thread(s), {cpu.info()['isa']}: a token's CPU ms "
        f"best {min(cpu_ms):.2f} median {statistics.median(cpu_ms):.2f}, wall ms best "
        f"{min(wall_ms):.2f} median {statistics.median(wall_ms):.2f}"
    )


if __name__ == "__main__":
    main()
