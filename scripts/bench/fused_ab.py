"""Fused native decoder blocks against mlx-lm's own blocks, interleaved in one process.

    python scripts/bench/fused_ab.py --model DIR_OR_GGUF [--prompt-tokens 128] [--rounds 5]

Decode: one cache per mode after the same prompt; single steps (`model(tok, cache)`, mx.eval,
the cache trimmed back) alternate between fused and unfused, `--steps` each. Prefill (a fresh
cache each time, `--rounds`) and mlx-lm's `stream_generate` of `--gen-tokens` tokens after a
`--gen-prompt-tokens` prompt (its generation tok/s, `--gen-rounds`) alternate, the order
flipping each round. Prints medians: wall ms, the process's
CPU ms (every thread: MLX's stream thread, the kernel pool, Python), and the main thread's
CPU ms (time.thread_time: graph building and MLX's queueing). On a loaded machine the wall
times carry the scheduler's noise; the CPU times much less.
"""

import argparse
import statistics
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--gen-prompt-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen-rounds", type=int, default=6)
    a = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    import mlx_ternary
    from mlx_ternary.runtime.cpu import block

    model, tokenizer = mlx_ternary.load(str(Path(a.model)))
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(3, model.args.vocab_size, a.prompt_tokens), dtype=mx.uint32)
    results = {True: {}, False: {}}

    def timed(on, name, fn):
        block.set_enabled(on)
        w, c, t = time.perf_counter(), time.process_time(), time.thread_time()
        fn()
        results[on].setdefault(f"{name} ms", []).append(1e3 * (time.perf_counter() - w))
        results[on].setdefault(f"{name} CPU ms", []).append(1e3 * (time.process_time() - c))
        results[on].setdefault(f"{name} main-thread CPU ms", []).append(
            1e3 * (time.thread_time() - t)
        )

    caches = {}
    for on in (True, False):  # warm-up, and each mode's decode cache
        block.set_enabled(on)
        caches[on] = make_prompt_cache(model)
        mx.eval(model(prompt[None], cache=caches[on]))
    tok = mx.array([[5]], dtype=mx.uint32)

    def step(on):
        mx.eval(model(tok, cache=caches[on]))
        for c in caches[on]:
            c.trim(1)

    for i in range(2 * a.steps):
        on = i % 2 == 0
        timed(on, "decode step", lambda: step(on))

    sampler = make_sampler(0.0)
    tps = {True: [], False: []}

    def generate():
        out = list(
            stream_generate(
                model,
                tokenizer,
                prompt[: a.gen_prompt_tokens].tolist(),
                max_tokens=a.gen_tokens,
                sampler=sampler,
            )
        )
        tps[block.is_enabled()].append(out[-1].generation_tps)

    for r in range(a.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            timed(
                on, "prefill", lambda: mx.eval(model(prompt[None], cache=make_prompt_cache(model)))
            )
    for r in range(a.gen_rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            timed(on, "generate", generate)
    block.set_enabled(None)
    print(f"{'':34s} {'fused':>9s} {'unfused':>9s} {'ratio':>6s}")
    rows = [(k, results[True][k], results[False][k]) for k in results[True]]
    rows.append(("generate tok/s (mlx-lm)", tps[True], tps[False]))
    for key, f, u in rows:
        if key.startswith("generate") and "tok/s" not in key:
            continue
        f, u = statistics.median(f), statistics.median(u)
        print(f"{key:34s} {f:9.2f} {u:9.2f} {f / u:6.2f}")


if __name__ == "__main__":
    main()
