"""Tensor parallelism on one machine: tokens/s and memory, 1 process against N ranks.

    python scripts/bench/tp_bench.py --model DIR --ranks 2 --repeats 3      # the comparison
    mlx.launch -n 2 --backend ring -- python scripts/bench/tp_bench.py --model DIR --worker

The comparison alternates a single process and an `mlx.launch -n N --backend ring` run of
this script (`--worker`), `--repeats` times each, and prints the median (min-max) per
setting. Each worker loads the model (sharded across the ranks when launched), times a
prefill of `--prompt-tokens` seeded random tokens and `--gen-tokens` greedy decode steps,
and prints one JSON line per rank: tokens/s, the ternary bytes it holds, MLX's active
memory after loading and its peak over the run.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx


def worker(args) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_ternary.checkpoint.load import load
    from mlx_ternary.parallel import sharded_load, world
    from mlx_ternary.runtime.shard import ternary_bytes

    group = world()
    t0 = time.perf_counter()
    model = (sharded_load(args.model, group) if group.size() > 1 else load(args.model))[0]
    load_s = time.perf_counter() - t0
    active = mx.get_active_memory()
    vocab = model.model.embed_tokens.weight.shape[0]
    prompt = mx.random.randint(0, vocab, (1, args.prompt_tokens), key=mx.random.key(0))
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    logits = model(prompt, cache=cache)
    y = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(y)
    prefill = args.prompt_tokens / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(args.gen_tokens):
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.eval(y)
    decode = args.gen_tokens / (time.perf_counter() - t0)
    print(
        json.dumps(
            {
                "rank": group.rank(),
                "ranks": group.size(),
                "load_s": load_s,
                "prefill_tps": prefill,
                "decode_tps": decode,
                "ternary_bytes": ternary_bytes(model),
                "active_bytes": active,
                "peak_bytes": mx.get_peak_memory(),
            }
        ),
        flush=True,
    )


def run(args, ranks: int) -> list:
    from mlx_ternary.parallel import local_launch

    me = [
        str(Path(__file__).resolve()),
        "--worker",
        "--model",
        args.model,
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--gen-tokens",
        str(args.gen_tokens),
    ]
    me = local_launch(ranks, *me) if ranks > 1 else [sys.executable, *me]
    done = subprocess.run(me, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode:
        raise SystemExit(f"{' '.join(me)} failed:\n{done.stdout}\n{done.stderr}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"])


def fmt(values, scale=1.0, digits=1) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def compare(args) -> None:
    results = {1: [], args.ranks: []}
    for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
        for ranks in results:
            results[ranks].append(run(args, ranks))
    print(
        f"model {args.model}: prompt {args.prompt_tokens}, {args.gen_tokens} generated, "
        f"{args.repeats} interleaved repeats; median (min-max); memory of rank 0"
    )
    print(
        "| processes | prefill tok/s | decode tok/s | ternary MB per rank | "
        "active MB after load | peak MB |"
    )
    print("|---|---|---|---|---|---|")
    for ranks, runs in results.items():
        r0 = [rows[0] for rows in runs]
        print(
            f"| {ranks} | {fmt([r['prefill_tps'] for r in r0])} | "
            f"{fmt([r['decode_tps'] for r in r0], digits=2)} | "
            f"{r0[0]['ternary_bytes'] / 1e6:.2f} | {r0[0]['active_bytes'] / 1e6:.1f} | "
            f"{fmt([r['peak_bytes'] for r in r0], 1e-6)} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the launched run")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write every run's rows here")
    ap.add_argument("--worker", action="store_true", help="measure this process (one rank)")
    args = ap.parse_args()
    worker(args) if args.worker else compare(args)


if __name__ == "__main__":
    main()
