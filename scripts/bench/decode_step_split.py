"""Where a decode step's time goes, per step of the real model: wall, the main thread's CPU
(Python building the graph + MLX's scheduling), each other thread's CPU (MLX's CPU stream
thread, the native pool's workers), the whole process's CPU, and the native kernels alone.

    python scripts/bench/decode_step_split.py --model DIR/model.gguf [--prompt-tokens 128]
        [--gen 32] [--steps 48]

- "pipelined": mlx-lm's generate_step (async_eval: the next step's graph is built while this
  one computes), --gen tokens after the prompt; per token after the first.
- "single": one step at a time (`model(tok, cache)`, mx.eval, the cache trimmed back), the
  main thread's CPU split into building the graph and mx.eval.
- "fused ops' phases": single steps with the native block's phase clocks on
  (`block_times`): the ms per step its tasks spent in norms, activation preparation, the
  ternary rows, RoPE, attention..., summed over the layers (the rows: the matmuls).
- "kernels alone": the model's ternary layers on one token, and its output layer, each
  evaluated alone (as profile_cpu_step.py); the rest of a single step is everything else.

Threads' CPU comes from /proc/self/task/*/schedstat (nanoseconds; Linux only). A pool
worker's CPU includes its spinning between jobs. To compare two checkouts, run this under
each (PYTHONPATH=TREE) alternately and compare minima / CPU times: those carry little of a
shared machine's noise.
"""

import argparse
import os
import statistics
import threading
import time
from pathlib import Path


def thread_cpu() -> dict:
    """{tid: CPU seconds} of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) * 1e-9
        except OSError:  # a thread that ended
            pass
    return out


def per_thread(before: dict, after: dict, n: int, main: int) -> str:
    """Each thread's CPU ms per step between two thread_cpu() readings, busiest first."""
    d = {t: (after[t] - before.get(t, 0.0)) * 1e3 / n for t in after}
    others = sorted((v for t, v in d.items() if t != main and v > 0.05), reverse=True)
    return (
        f"main {d.get(main, 0.0):.2f}, others "
        + ", ".join(f"{v:.2f}" for v in others)
        + f" (all {sum(d.values()):.2f})"
    )


def stats(xs) -> str:
    return f"min {min(xs):.2f} median {statistics.median(xs):.2f}"


def pipelined(model, prompt, gen: int, main: int) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    wall, cpu = [], []
    t_cpu, t_wall, t0 = None, None, None
    for i, _ in enumerate(generate_step(prompt, model, max_tokens=gen)):
        w, c = time.perf_counter(), time.thread_time()
        if i == 0:
            t0 = thread_cpu()
        else:
            wall.append(1e3 * (w - t_wall))
            cpu.append(1e3 * (c - t_cpu))
        t_wall, t_cpu = w, c
    t1 = thread_cpu()
    mx.synchronize()
    n = len(wall)
    print(f"pipelined ({n} tokens after the first): wall ms {stats(wall)}")
    print(
        f"  main-thread CPU ms {stats(cpu)}; CPU ms/step by thread: {per_thread(t0, t1, n, main)}"
    )


def single(model, cache, steps: int, main: int) -> float:
    import mlx.core as mx

    tok = mx.array([[5]], dtype=mx.uint32)
    wall, build, ev = [], [], []
    t0 = None
    for i in range(steps + 4):  # the first 4: warm-up
        if i == 4:
            t0 = thread_cpu()
        w, c = time.perf_counter(), time.thread_time()
        out = model(tok, cache=cache)
        c1 = time.thread_time()
        mx.eval(out)
        build.append(1e3 * (c1 - c))
        ev.append(1e3 * (time.thread_time() - c1))
        wall.append(1e3 * (time.perf_counter() - w))
        for k in cache:
            k.trim(1)
    t1 = thread_cpu()
    wall, build, ev = wall[4:], build[4:], ev[4:]
    print(f"single steps ({steps}): wall ms {stats(wall)}")
    print(f"  main-thread CPU ms: building {stats(build)}; mx.eval {stats(ev)}")
    print(f"  CPU ms/step by thread: {per_thread(t0, t1, steps, main)}")
    return min(wall)


def phases(model, cache, steps: int) -> None:
    import mlx.core as mx

    from mlx_ternary.runtime.cpu import require

    m = require()
    if not hasattr(m, "block_times"):  # a checkout from before the phase clocks
        return
    tok = mx.array([[5]], dtype=mx.uint32)
    mx.eval(model(tok, cache=cache))
    for k in cache:
        k.trim(1)
    m.block_times(True)
    for _ in range(steps):
        mx.eval(model(tok, cache=cache))
        for k in cache:
            k.trim(1)
    t = m.block_times(False)
    tasks = t.pop("tasks")
    total = sum(t.values())
    print(
        f"  fused ops' phases, ms/step ({tasks / steps:.0f} tasks a step): total {total / steps / 1e6:.2f}"
    )
    print("    " + ", ".join(f"{k} {v / steps / 1e6:.3f}" for k, v in t.items()))


def kernels_alone(model, steps: int) -> float:
    import mlx.core as mx

    from mlx_ternary.runtime.layers import ternary_layers

    layers = [m for _, m in ternary_layers(model)]
    x1 = {k: mx.random.normal((1, 1, k)) for k in {m.in_features for m in layers}}
    h = mx.random.normal((1, 1, model.args.hidden_size))
    head = getattr(model, "lm_head", None)
    out_layer = head if head is not None else model.model.embed_tokens.as_linear
    total = 0.0
    for name, fn in (
        (f"{len(layers)} ternary layers", lambda: [m(x1[m.in_features]) for m in layers]),
        ("output layer", lambda: out_layer(h)),
    ):
        mx.eval(fn())
        ts = []
        for _ in range(steps):
            t = time.perf_counter()
            mx.eval(fn())
            ts.append(1e3 * (time.perf_counter() - t))
        total += min(ts)
        print(f"  {name} alone: wall ms {stats(ts)}")
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    a = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_ternary

    model, _ = mlx_ternary.load(str(a.model))
    print(f"{mlx_ternary.__file__}; {a.model}, context {a.prompt_tokens}")
    main_tid = threading.get_native_id()
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(3, model.args.vocab_size, a.prompt_tokens), dtype=mx.uint32)
    pipelined(model, prompt, a.gen, main_tid)
    cache = make_prompt_cache(model)
    mx.eval(model(prompt[None], cache=cache))
    step = single(model, cache, a.steps, main_tid)
    phases(model, cache, a.steps)
    alone = kernels_alone(model, a.steps)
    print(f"  single step's minimum less the kernels' minima: {step - alone:.2f} ms")


if __name__ == "__main__":
    main()
