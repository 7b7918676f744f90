#!/usr/bin/env python
"""Re-check the trained tiny models in MLX with mlx-lm's own llama class.

latent/: mlx_lm.models.llama.Model built from config.json, latent weights loaded by HF name,
then every decoder nn.Linear replaced by absmean-ternary weights (s * t) with int8 per-token
absmax activation quantization in front (float32) -- the inference semantics. float/: loaded
with stock mlx_lm.load. Reports held-out slice perplexity next to the trainer's numbers in
metrics.json, and a greedy sample.

Usage: python scripts/train/train_check_mlx.py [--dir build/tiny] [--all-windows]
"""

import argparse
import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import generate, load
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.utils import load_tokenizer


class TernaryInt8Linear(nn.Module):
    """y = Q8(x) @ (s * t).T with s = mean|W|, t = clamp(round(W / s), -1, 1) computed at load."""

    def __init__(self, weight: mx.array):
        super().__init__()
        w = weight.astype(mx.float32)
        scale = 1.0 / mx.maximum(mx.abs(w).mean(), 1e-5)
        self.weight = mx.clip(mx.round(w * scale), -1, 1) / scale
        self.ternary = mx.clip(mx.round(w * scale), -1, 1)

    def __call__(self, x):
        scale = 127.0 / mx.maximum(mx.abs(x).max(axis=-1, keepdims=True), 1e-5)
        xq = mx.clip(mx.round(x * scale), -128, 127) / scale
        return xq @ self.weight.T


def load_ternary(path: Path):
    config = json.loads((path / "config.json").read_text())
    model = Model(ModelArgs.from_dict(config))
    weights = model.sanitize(mx.load(str(path / "model.safetensors")))
    model.load_weights(list(weights.items()), strict=True)
    skip = set(config["quantization_config"]["modules_to_not_convert"])
    swaps = [
        (name, TernaryInt8Linear(m.weight))
        for name, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
        if isinstance(m, nn.Linear) and name not in skip
    ]
    model.update_modules(tree_unflatten(swaps))
    mx.eval(model.parameters())
    return model, config, [n for n, _ in swaps]


def slice_nll(model, windows: np.ndarray) -> float:
    total, count = 0.0, 0
    for w in windows:
        x = mx.array(w[None].astype(np.int32))
        logits = model(x[:, :-1]).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll = -mx.take_along_axis(lp, x[:, 1:, None], axis=-1).sum()
        total += nll.item()
        count += w.size - 1
    return total / count


def main():
    p = argparse.ArgumentParser()
    p.add_argument(
        "--dir", type=Path, default=Path(__file__).resolve().parents[2] / "build" / "tiny"
    )
    p.add_argument("--prompt", default="ROMEO:\n")
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument(
        "--all-windows",
        action="store_true",
        help="evaluate every held-out window (compare with heldout_ppl), not the slice",
    )
    args = p.parse_args()
    metrics = json.loads((args.dir / "metrics.json").read_text())
    seq = metrics["args"]["seq"]
    n_slice = metrics["corpus"]["heldout_slice_windows"]
    key = "heldout_nll" if args.all_windows else "heldout_slice_nll"
    label = "full held-out" if args.all_windows else "held-out slice"
    report = {}

    tokenizer = load_tokenizer(args.dir / "latent")
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(args.dir / "latent"))
    heldout = (args.dir / "heldout.txt").read_text(encoding="utf-8")
    ids = np.array(tokenizer.encode(heldout, add_special_tokens=False))
    assert ids.tolist() == hf_tok.encode(heldout, add_special_tokens=False), "tokenizers disagree"
    if args.all_windows:
        n_slice = len(ids) // seq
    windows = ids[: n_slice * seq].reshape(n_slice, seq)
    print(
        f"held-out tokens {len(ids)} (trainer: {metrics['corpus']['heldout_tokens']}); "
        f"{n_slice} windows x {seq}; bos={hf_tok.bos_token!r} eos={hf_tok.eos_token!r}"
    )

    model, config, swapped = load_ternary(args.dir / "latent")
    tern = [
        np.unique(np.array(m.ternary)).tolist()
        for n, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
        if isinstance(m, TernaryInt8Linear)
    ]
    print(
        f"ternary: swapped {len(swapped)} linears ({swapped[0]} ... {swapped[-1]}); "
        f"levels {sorted(set(v for t in tern for v in t))}"
    )

    def check(run, m, tok):
        # MLX perplexity of one run against the trainer's own figure, plus a greedy sample.
        nll, ref = slice_nll(m, windows), metrics["runs"][run][key]
        text = generate(m, tok, args.prompt, max_tokens=args.max_tokens, verbose=False)
        report[run] = {
            "windows": n_slice,
            "mlx_nll": nll,
            "mlx_ppl": math.exp(nll),
            "trainer_nll": ref,
            "trainer_ppl": math.exp(ref),
            "rel_diff_ppl": math.exp(nll - ref) - 1,
            "sample": args.prompt + text,
        }
        print(f"{run} {label} ppl: MLX {math.exp(nll):.4f} vs trainer {math.exp(ref):.4f}")
        print(f"{run} sample:\n" + args.prompt + text + "\n---")

    check("ternary", model, tokenizer)
    if "float" in metrics["runs"]:
        check("float", *load(str(args.dir / "float")))  # stock mlx-lm loader
    (args.dir / ("mlx_check_all.json" if args.all_windows else "mlx_check.json")).write_text(
        json.dumps(report, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
