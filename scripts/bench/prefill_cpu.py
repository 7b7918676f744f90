"""CPU time of one prefill, in this process: a figure that holds on a shared machine.

    python scripts/bench/prefill_cpu.py /tmp/peers-small/model.gguf --tokens 128 --repeats 6

Loads the model (a GGUF as written, or a converted directory), runs `model(prompt, cache)`
over --tokens random prompt tokens with a fresh mlx-lm cache and evaluates the cache (what a
prompt's prefill computes; the logits stay lazy), once to warm up and --repeats times timed.
With --threads 1 (the default) the time is the process's CPU time, which other processes on
the cores do not inflate the way they do wall-clock time; with more threads it is wall time.
Prints the min and the mean. The C++ engines' counterpart: the CPU time of
`llama-bench -t 1 -p P -n 0 -r R` less that of `-r 1`, over R - 1 (docs/NATIVE.md).
"""

import argparse
import time

import mlx.core as mx
import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from mlx_lm.models.cache import make_prompt_cache

    import mlx_ternary
    from mlx_ternary.runtime import cpu

    cpu.require().set_num_threads(a.threads)
    model, _tok, config = mlx_ternary.load(a.model, return_config=True)
    rng = np.random.default_rng(a.seed)
    prompt = mx.array(rng.integers(3, config["vocab_size"], a.tokens), dtype=mx.uint32)
    clock = time.process_time if a.threads == 1 else time.perf_counter

    def prefill() -> float:
        cache = make_prompt_cache(model)
        t0 = clock()
        model(prompt[None], cache=cache)
        mx.eval([c.state for c in cache])
        return clock() - t0

    prefill()
    times = [prefill() for _ in range(a.repeats)]
    best, mean = min(times), sum(times) / len(times)
    kind = "CPU" if a.threads == 1 else "wall"
    print(
        f"prefill {a.tokens}, {a.threads} thread(s), {kind} time ({cpu.info()['isa']}): "
        f"min {best * 1e3:.1f} ms ({a.tokens / best:.1f} tok/s), "
        f"mean {mean * 1e3:.1f} ms ({a.tokens / mean:.1f} tok/s)"
    )


if __name__ == "__main__":
    main()
