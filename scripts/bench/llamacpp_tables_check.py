"""Does llama.cpp run a TQ2_0 GGUF with quantized tables as mlx-ternary does? (node-llama-cpp)

    python scripts/bench/llamacpp_tables_check.py --node-modules DIR --tables Q4_K,Q6_K

Writes a random TQ2_0 llama (bench_llamacpp.py's `write_gguf`, a small shape by default)
whose embedding and output layer are llama.cpp blocks of the given types, then compares
llama.cpp's greedy continuation of seeded random prompt ids and its teacher-forced argmax
after every prefix with mlx-ternary's on the same file, for each --activations mode
(q8k: llama.cpp's numerics, the default for its files; float). Prints a JSON line per mode;
exit status 1 when the default mode's greedy tokens differ. Needs Node.js.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_llamacpp import SHAPE, write_gguf  # noqa: E402

import mlx_ternary  # noqa: E402
from mlx_ternary.bench import llamacpp  # noqa: E402

SMALL = dict(SHAPE, layers=4, hidden=1024, intermediate=2816, vocab=8000, heads=16, kv_heads=4)


def first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mlx_greedy(model, prompt, n):
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(0.0))
    return [int(t) for t, _ in steps]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--node-modules", help="node_modules with node-llama-cpp")
    ap.add_argument("--tables", default="Q4_K,Q6_K")
    ap.add_argument("--full-shape", action="store_true", help="bench_llamacpp.py's 0.53 G shape")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=40)
    ap.add_argument("--teacher-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    node_modules = llamacpp.find(a.node_modules)
    if node_modules is None:
        ap.error("pass --node-modules DIR or set $MLX_TERNARY_LLAMA_CPP")
    shape = SHAPE if a.full_shape else SMALL
    tmp = Path(tempfile.mkdtemp(prefix="tables-check-"))
    gguf = tmp / "model.gguf"
    write_gguf(gguf, shape, a.seed, tables=tuple(a.tables.split(",")))
    prompt = llamacpp.random_prompt(a.prompt_tokens, shape["vocab"], a.seed)
    teacher = llamacpp.random_prompt(a.teacher_tokens, shape["vocab"], a.seed + 1)
    ref = llamacpp.evaluate(
        node_modules,
        gguf,
        threads=a.threads,
        prompt_ids=prompt,
        max_tokens=a.gen_tokens,
        teacher_ids=teacher,
    )
    status = 0
    for mode in ("q8k", "float"):
        model, _ = mlx_ternary.load(str(gguf), activations=mode)
        ours = mlx_greedy(model, prompt, a.gen_tokens)
        argmax = np.array(mx.argmax(model(mx.array([teacher]))[0], axis=-1)).tolist()
        theirs = ref["teacher_argmax"]
        same = sum(int(x == y) for x, y in zip(argmax, theirs))
        row = {
            "tables": a.tables,
            "activations": mode,
            "greedy_equal": f"{first_difference(ours, ref['generated'])}/{a.gen_tokens}",
            "teacher_top1": f"{same}/{len(theirs)}",
            "embed": type(model.model.embed_tokens).__name__,
            "head": type(model.lm_head).__name__,
        }
        print(json.dumps(row))
        if mode == "q8k" and ours != ref["generated"]:
            status = 1
    sys.exit(status)


if __name__ == "__main__":
    main()
