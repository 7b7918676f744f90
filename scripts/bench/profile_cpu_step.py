"""Where a decode step and a prefill go on the CPU: the ternary layers, the output layer, and
everything else MLX runs (norms, RoPE, attention, elementwise ops, Python graph building).

    python scripts/bench/profile_cpu_step.py --model DIR [--prompt-tokens 128] [--repeats 10]

Each piece is timed alone (mx.eval), median and min over the repeats, in milliseconds. "rest"
is the model with every ternary layer replaced by a free stand-in of the same output shape
(mlx-lm's own blocks: the fused native block needs the real layers). The whole step and the
whole prefill are timed with the fused native blocks (runtime/cpu/block.py) and without,
interleaved, with the main thread's CPU time (graph building and MLX's queueing).
"""

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def timed(fn, repeats):
    mx.eval(fn())
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(1e3 * (time.perf_counter() - t))
    return f"{statistics.median(ts):8.2f} (min {min(ts):.2f})"


def timed_ab(fn, repeats):
    """fn() with the fused blocks on and off, interleaved: wall and main-thread CPU medians."""
    from mlx_ternary.runtime.cpu import block

    runs = {True: ([], []), False: ([], [])}
    for on in (True, False):
        block.set_enabled(on)
        mx.eval(fn())
    for r in range(repeats):
        for on in (True, False) if r % 2 == 0 else (False, True):
            block.set_enabled(on)
            t, c = time.perf_counter(), time.thread_time()
            mx.eval(fn())
            runs[on][0].append(1e3 * (time.perf_counter() - t))
            runs[on][1].append(1e3 * (time.thread_time() - c))
    block.set_enabled(False)  # the pieces below are mlx-lm's own blocks
    return "  ".join(
        f"{name} {statistics.median(w):7.2f} (min {min(w):.2f}, main-thread CPU "
        f"{statistics.median(c):.2f})"
        for name, (w, c) in (("fused", runs[True]), ("unfused", runs[False]))
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()

    from mlx_lm.models.cache import make_prompt_cache

    from mlx_ternary.checkpoint.load import load_model
    from mlx_ternary.runtime import cpu, dispatch
    from mlx_ternary.runtime.cpu.attention import enabled
    from mlx_ternary.runtime.layers import TernaryLinear, ternary_layers

    model, config = load_model(a.model)
    print(f"backend {dispatch.resolve_backend()} {cpu.info()}; ms per call")
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(3, config["vocab_size"], a.prompt_tokens), dtype=mx.uint32)
    cache = make_prompt_cache(model)
    mx.eval(model(prompt[None], cache=cache))
    tok = mx.array([[5]], dtype=mx.uint32)
    layers = [m for _, m in ternary_layers(model)]
    dims = {m.in_features for m in layers}
    hidden = config.get("hidden_size")

    print("decode step (1 token, context", a.prompt_tokens, ")")

    def step():
        out = model(tok, cache=cache)
        mx.eval(out)
        for c in cache:  # the same context length every time
            c.trim(1)
        return out

    print("  whole step           ", timed_ab(step, a.repeats))
    x1 = {k: mx.random.normal((1, 1, k)) for k in dims}
    print(
        "  ternary layers only  ", timed(lambda: [m(x1[m.in_features]) for m in layers], a.repeats)
    )
    head = model.lm_head if hasattr(model, "lm_head") else None
    h = mx.random.normal((1, 1, hidden))
    if head is not None:
        print("  lm_head              ", timed(lambda: head(h), a.repeats))
    else:
        emb = model.model.embed_tokens
        print("  tied output layer    ", timed(lambda: emb.as_linear(h), a.repeats))

    free = {}

    def stand_in(self, x):
        key = (x.shape[:-1], self.out_features)
        if key not in free:
            free[key] = mx.zeros((*x.shape[:-1], self.out_features))
            mx.eval(free[key])
        return free[key] + x[..., :1]

    inner = model.model  # the decoder without the output layer, as model() runs it
    layer = inner.layers[0]
    attn_in = mx.random.normal((1, a.prompt_tokens, hidden))
    original = TernaryLinear.__call__
    with enabled():  # what model() turns on for its own attention calls on the native backend
        TernaryLinear.__call__ = stand_in
        try:
            print(
                "  rest (decoder with free ternary layers)",
                timed(lambda: inner(tok, cache=cache), a.repeats),
            )
        finally:
            TernaryLinear.__call__ = original
        print(f"prefill ({a.prompt_tokens} tokens)")
        print(
            "  whole decoder        ",
            timed_ab(lambda: inner(prompt[None], cache=make_prompt_cache(model)), 3),
        )
        xm = {k: mx.random.normal((1, a.prompt_tokens, k)) for k in dims}
        print("  ternary layers only  ", timed(lambda: [m(xm[m.in_features]) for m in layers], 3))
        TernaryLinear.__call__ = stand_in
        try:
            print(
                "  rest (free ternary)  ",
                timed(lambda: inner(prompt[None], cache=make_prompt_cache(model)), 3),
            )
            print(
                "  one layer's attention",
                timed(lambda: layer.self_attn(attn_in, "causal", make_prompt_cache(model)[0]), 3),
            )
        finally:
            TernaryLinear.__call__ = original
    print(
        "  one layer's attention, MLX's own",
        timed(lambda: layer.self_attn(attn_in, "causal", make_prompt_cache(model)[0]), 3),
    )


if __name__ == "__main__":
    main()
