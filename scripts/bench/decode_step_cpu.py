"""The main thread's CPU time per decode step: the Python that builds a step's graph (the
fused blocks' own included) and MLX's queueing, not the kernels' threads.

    python scripts/bench/decode_step_cpu.py --model DIR [--steps 64] [--prompt-tokens 128]

Single steps (`model(tok, cache)`, mx.eval, the cache trimmed back) after one prompt, as
fused_ab.py's decode. Prints the min and median time.thread_time() per step and the wall
time. To compare two checkouts, run it alternately under each (PYTHONPATH=OLD/ first) and
take the minima: the main thread's CPU time carries little of a shared machine's noise.
"""

import argparse
import statistics
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_ternary

    model, _ = mlx_ternary.load(str(a.model))
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(3, model.args.vocab_size, a.prompt_tokens), dtype=mx.uint32)
    cache = make_prompt_cache(model)
    mx.eval(model(prompt[None], cache=cache))
    tok = mx.array([[5]], dtype=mx.uint32)
    cpu, wall = [], []
    for _ in range(a.steps + 4):  # the first 4: warm-up
        w, t = time.perf_counter(), time.thread_time()
        mx.eval(model(tok, cache=cache))
        cpu.append(1e3 * (time.thread_time() - t))
        wall.append(1e3 * (time.perf_counter() - w))
        for c in cache:
            c.trim(1)
    cpu, wall = cpu[4:], wall[4:]
    print(
        f"{mlx_ternary.__file__}: main-thread CPU ms/step min {min(cpu):.3f} median "
        f"{statistics.median(cpu):.3f}; wall ms min {min(wall):.2f} median "
        f"{statistics.median(wall):.2f}"
    )


if __name__ == "__main__":
    main()
