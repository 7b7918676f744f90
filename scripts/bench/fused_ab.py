"""Fused native decoder blocks against mlx-lm's own blocks, interleaved in one process.

    python scripts/bench/fused_ab.py --model DIR_OR_GGUF [--prompt-tokens 128] [--rounds 5]

Each round runs, for fused on and off in turn (the order alternates): a 128-token prefill
into a fresh cache, `--steps` single decode steps after it (each step `model(tok, cache)` and
mx.eval), and mlx-lm's `stream_generate` of `--gen-tokens` tokens (its generation tok/s).
Prints medians: wall ms, and the main thread's CPU ms (time.thread_time around the model
call and the eval: graph building, MLX's queueing and whatever kernels ran on this thread).
"""

import argparse
import statistics
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    import mlx_ternary
    from mlx_ternary.runtime.cpu import block

    model, tokenizer = mlx_ternary.load(str(Path(a.model)))
    vocab = model.args.vocab_size
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(3, vocab, a.prompt_tokens), dtype=mx.uint32)
    results = {True: {}, False: {}}

    def add(on, key, value):
        results[on].setdefault(key, []).append(value)

    def one(on):
        block.set_enabled(on)
        cache = make_prompt_cache(model)
        w, c = time.perf_counter(), time.thread_time()
        mx.eval(model(prompt[None], cache=cache))
        add(on, "prefill ms", 1e3 * (time.perf_counter() - w))
        add(on, "prefill main-thread CPU ms", 1e3 * (time.thread_time() - c))
        tok = mx.array([[5]], dtype=mx.uint32)
        walls, cpus = [], []
        for _ in range(a.steps):
            w, c = time.perf_counter(), time.thread_time()
            mx.eval(model(tok, cache=cache))
            walls.append(1e3 * (time.perf_counter() - w))
            cpus.append(1e3 * (time.thread_time() - c))
        add(on, "decode step ms", statistics.median(walls))
        add(on, "decode main-thread CPU ms", statistics.median(cpus))
        sampler = make_sampler(0.0)
        out = list(
            stream_generate(
                model, tokenizer, prompt.tolist(), max_tokens=a.gen_tokens, sampler=sampler
            )
        )
        last = out[-1]
        add(on, "generate tok/s", last.generation_tps)
        add(on, "generate prefill tok/s", last.prompt_tps)

    one(True), one(False)  # warm-up
    for r in range(a.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            one(on)
    block.set_enabled(None)
    print(f"{'':28s} {'fused':>10s} {'unfused':>10s} {'ratio':>7s}")
    for key in results[True]:
        f, u = (statistics.median(results[on][key]) for on in (True, False))
        print(f"{key:28s} {f:10.2f} {u:10.2f} {f / u:7.2f}")


if __name__ == "__main__":
    main()
