"""Where a tensor-parallel decode step's time goes on one host: compute, collectives, the rest.

    MLX_TERNARY_NUM_THREADS=2 python scripts/bench/tp_cost.py --model DIR          # 1 process
    MLX_TERNARY_NUM_THREADS=1 mlx.launch -n 2 --backend ring -- \\
        python scripts/bench/tp_cost.py --model DIR                               # 2 ranks

Each rank loads the model (`load()` + `model.shard(group)` under mlx.launch), prefills a
16-token seeded prompt and times `--gen-tokens` greedy decode steps three ways, printing one
JSON line per rank (milliseconds per token):
  ms_per_token   the real run;
  compute_ms     the same steps with mx.distributed's collectives replaced by the identity
                 (same shapes and kernels, no waiting on the other rank; wrong numbers);
  collectives_ms the collectives counted in one step times one all_sum of the hidden size
                 timed back to back (after 20 warm-up calls);
  rest_ms        what is left: waiting for the other rank to arrive (scheduling, skew).
"""

import argparse
import json
import time

import mlx.core as mx

COLLECTIVES = ("all_sum", "all_max", "all_gather")


def decode_ms(model, steps: int) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    vocab = model.model.embed_tokens.weight.shape[0]
    prompt = mx.random.randint(0, vocab, (1, 16), key=mx.random.key(0))
    tok = mx.argmax(model(prompt, cache=cache)[:, -1], -1)
    mx.eval(tok)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = mx.argmax(model(tok[:, None], cache=cache)[:, -1], -1)
        mx.eval(tok)
    return (time.perf_counter() - t0) / max(steps, 1) * 1e3


def patched(replacement):
    """Replace mx.distributed's collectives by replacement(name, original); returns undo."""
    real = {k: getattr(mx.distributed, k) for k in COLLECTIVES}
    for k, f in real.items():
        setattr(mx.distributed, k, replacement(k, f))
    return lambda: [setattr(mx.distributed, k, f) for k, f in real.items()]


def collectives_per_step(model) -> int:
    count = {"n": 0}

    def counting(_, f):
        def call(*a, **kw):
            count["n"] += 1
            return f(*a, **kw)

        return call

    undo = patched(counting)
    decode_ms(model, 1)
    one = count["n"]
    count["n"] = 0
    decode_ms(model, 3)
    undo()
    return (count["n"] - one) // 2


def one_all_sum_ms(model, group, calls: int = 200) -> float:
    x = mx.ones((1, 1, model.model.embed_tokens.weight.shape[1]))
    for _ in range(20):
        mx.eval(mx.distributed.all_sum(x, group=group))
    t0 = time.perf_counter()
    for _ in range(calls):
        mx.eval(mx.distributed.all_sum(x, group=group))
    return (time.perf_counter() - t0) / calls * 1e3


def main():
    from mlx_ternary.checkpoint.load import load
    from mlx_ternary.parallel import world

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlx_ternary/assets/tiny-shakespeare")
    ap.add_argument("--gen-tokens", type=int, default=32)
    args = ap.parse_args()
    group = world()
    model = load(args.model)[0]
    if group.size() > 1:
        model.shard(group)
    mx.eval(model.parameters())
    per_step = collectives_per_step(model) if group.size() > 1 else 0
    total = decode_ms(model, args.gen_tokens)
    compute, one = total, 0.0
    if group.size() > 1:
        undo = patched(lambda _, f: lambda x, *a, **kw: x)
        compute = decode_ms(model, args.gen_tokens)
        undo()
        one = one_all_sum_ms(model, group)
    row = dict(
        rank=group.rank(),
        ranks=group.size(),
        ms_per_token=round(total, 3),
        compute_ms=round(compute, 3),
        collectives_per_token=per_step,
        one_all_sum_ms=round(one, 3),
        collectives_ms=round(one * per_step, 3),
        rest_ms=round(total - compute - one * per_step, 3),
    )
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
