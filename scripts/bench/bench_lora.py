"""LoRA step time and peak memory: a ternary base against the same model in float and q4.

Each run builds one representation of one model in a fresh process (so peak memory is its
own), attaches mlx-lm LoRA layers (rank 8, every projection of every block) and runs
mlx-lm's compiled training step (value_and_grad of default_loss + Adam) on a fixed batch
of random tokens. Representations:

    ternary  the native TernaryLinear base (int8 activations, straight-through gradient)
    float    the same weights dequantized into nn.Linear (float32, no activation quant)
    q4       that float model through mlx-lm's quantize_model (4-bit, group 64): QLoRA

Models: `embedded` (the shipped tiny-shakespeare model) or `mid` (a random llama-shaped
ternary model, hidden 1024, 8 layers, 32k vocabulary: 94.4 M ternary weights).

    python scripts/bench/bench_lora.py --model embedded --batch 4 --seq 128 --steps 6 --repeats 3
    python scripts/bench/bench_lora.py --model mid --batch 1 --seq 128 --steps 4 --repeats 2

Prints a Markdown table (median over repeats of the median step time after the first,
compiling, step; peak memory as MLX reports it) and writes --json when given.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

MID = dict(
    model_type="llama",
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    rms_norm_eps=1e-5,
    vocab_size=32000,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
KINDS = ("ternary", "float", "q4")
LORA = {"rank": 8, "scale": 20.0, "dropout": 0.0}


def build(model_name: str, kind: str):
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_map

    import mlx_ternary
    from mlx_ternary.generate import EMBEDDED_MODEL
    from mlx_ternary.runtime.adapters import dequantize_model
    from mlx_ternary.runtime.layers import ternarize_model

    if model_name == "embedded":
        model, _ = mlx_ternary.load(str(EMBEDDED_MODEL))
    else:
        from mlx_lm.utils import _get_classes

        model_class, args_class = _get_classes(MID)
        model = model_class(args_class.from_dict(MID))
        rng = np.random.default_rng(0)
        model.update(
            tree_map(
                lambda a: mx.array(rng.normal(0, 0.02, a.shape).astype(np.float32)),
                model.parameters(),
            )
        )
        ternarize_model(model, packing="fast", activation_bits=8)
    if kind != "ternary":
        model = dequantize_model(model)
    if kind == "q4":
        from mlx_lm.utils import quantize_model

        model, _ = quantize_model(model, {}, 64, 4)
    mx.eval(model.parameters())
    vocab = model.model.embed_tokens.weight.shape[0]
    return model, vocab


def run_one(model_name: str, kind: str, batch: int, seq: int, steps: int) -> dict:
    from functools import partial

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.trainer import default_loss

    from mlx_ternary.runtime.adapters import linear_to_lora_layers

    model, vocab = build(model_name, kind)
    weights_mb = sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 2**20
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), LORA)
    model.train()
    optimizer = optim.Adam(learning_rate=1e-5)
    value_and_grad = nn.value_and_grad(model, default_loss)
    state = [model.state, optimizer.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(ids, lengths):  # mlx_lm.tuner.trainer's step, without accumulation
        (loss, toks), grad = value_and_grad(model, ids, lengths)
        optimizer.update(model, grad)
        return loss, toks

    mx.random.seed(0)
    ids = mx.random.randint(0, vocab, (batch, seq))
    lengths = mx.array([[0, seq]] * batch)
    mx.reset_peak_memory()
    times = []
    for _ in range(steps):
        tic = time.perf_counter()
        loss, _ = step(ids, lengths)
        mx.eval(state, loss)
        times.append(time.perf_counter() - tic)
    return {
        "model": model_name,
        "kind": kind,
        "step_s": statistics.median(times[1:]),
        "first_step_s": times[0],
        "peak_mb": mx.get_peak_memory() / 2**20,
        "weights_mb": weights_mb,
        "tokens": batch * seq,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("embedded", "mid"), default="embedded")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first compiles)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per kind, interleaved")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one kind
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step compiles)")
    if args.one:
        print(json.dumps(run_one(args.model, args.one, args.batch, args.seq, args.steps)))
        return
    runs = {k: [] for k in args.kinds.split(",")}
    for _ in range(args.repeats):
        for kind in runs:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--model",
                    args.model,
                    "--batch",
                    str(args.batch),
                    "--seq",
                    str(args.seq),
                    "--steps",
                    str(args.steps),
                    "--one",
                    kind,
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[kind].append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"LoRA rank {LORA['rank']}, every projection; batch {args.batch} x {args.seq} "
        f"tokens; {args.steps} steps per run, {args.repeats} interleaved runs; median (min-max)"
    )
    print("| base | weights MB | step s | tokens/s | peak MB |")
    print("|---|---|---|---|---|")
    for kind, rs in runs.items():
        t = [r["step_s"] for r in rs]
        m = [r["peak_mb"] for r in rs]
        med = statistics.median(t)
        print(
            f"| {kind} | {rs[0]['weights_mb']:.1f} | {med:.3f} ({min(t):.3f}-{max(t):.3f}) | "
            f"{rs[0]['tokens'] / med:.0f} | {statistics.median(m):.1f} "
            f"({min(m):.1f}-{max(m):.1f}) |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
