"""Resident bytes of a loaded Ternary-Bonsai-style pack against its file bytes.

    python scripts/bench/bonsai_memory.py --shape 8b --layers 2 --out /tmp/bonsai-8b-2l
    python scripts/bench/bonsai_memory.py --shape 8b --layers 2 --out /tmp/bonsai-8b-2l  # again:
        # the pack exists, so this run only loads and measures (peak RSS of the load alone)

Writes an MLX 2-bit g128 pack laid out as prism-ml/Ternary-Bonsai-*-mlx-2bit ships
(Qwen3; every linear, the embedding and the lm_head hold codes t + 1 with fp16 scales and
biases = -scales), streaming one tensor at a time, then loads it with mlx_ternary.load and
prints one JSON line: file bytes, bytes of the loaded model's arrays (ternary layers,
affine layers, float norms), and what the embedding and head cost as float16, which is
how they were held before they stayed packed. `--layers` shrinks the depth (the embedding
and head keep their full size). Random codes: the pack measures memory, nothing else.
`--write-only` skips the load; scripts/bench/convert_memory.py measures `convert` on it.
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# Qwen3 base shapes of the three Ternary-Bonsai sizes (1.7B and 4B tie the head).
SHAPES = {
    "1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    # Bonsai 27B's largest tensors on Qwen3's class: its 248320 x 5120 embedding and head
    # and 24 x 256 attention heads (Qwen3.5-27B, as scripts/fixtures/make_synthetic_model.py
    # writes it); its linear-attention layers are smaller and not modelled here.
    "27b-head": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=248320,
        tie_word_embeddings=False,
    ),
}
GROUP = 128
ROWS = 4096  # rows drawn per step


def config(shape: str, layers=None) -> dict:
    c = dict(
        model_type="qwen3",
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
    )
    c.update(SHAPES[shape])
    if layers:
        c["num_hidden_layers"] = layers
    q = {"group_size": GROUP, "bits": 2}
    return {**c, "quantization": q, "quantization_config": dict(q)}


def packed(n: int, k: int):
    """(weight (n, k/16) uint32 of random codes 0..2, scales, biases (n, k/128) fp16)."""
    shifts = 2 * mx.arange(16, dtype=mx.uint32)
    words = []
    for r in range(0, n, ROWS):
        codes = mx.random.randint(0, 3, (min(ROWS, n - r), k // 16, 16)).astype(mx.uint32)
        words.append((codes << shifts).sum(axis=-1).astype(mx.uint32))
        mx.eval(words[-1])
    scales = mx.random.uniform(0.01, 0.1, (n, k // GROUP)).astype(mx.float16)
    return mx.concatenate(words), scales, -scales


def write(out: Path, cfg: dict) -> None:
    from mlx_lm.utils import _get_classes

    from mlx_ternary.checkpoint.writers.ternary import ShardWriter

    out.mkdir(parents=True, exist_ok=False)
    model_class, args_class = _get_classes(cfg)
    writer = ShardWriter(out)
    for name, v in tree_flatten(model_class(args_class.from_dict(cfg)).parameters()):
        if v.ndim == 2:
            w, s, b = packed(*v.shape)
            path = name.rpartition(".")[0]
            for leaf, arr in (("weight", w), ("scales", s), ("biases", b)):
                writer.add(f"{path}.{leaf}", arr)
        else:
            writer.add(name, mx.ones(v.shape, dtype=mx.float16))
    writer.close()
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def measure(out: Path, cfg: dict) -> dict:
    from mlx_ternary.checkpoint.load import load_model
    from mlx_ternary.runtime.layers import TernaryLinear

    model, _ = load_model(out)
    sizes = {"ternary": 0, "affine": 0, "float": 0}
    for _, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        kind = (
            "ternary"
            if isinstance(m, TernaryLinear)
            else "affine"
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            else "float"
        )
        sizes[kind] += sum(a.nbytes for _, a in tree_flatten(m.parameters()))
    resident = sum(sizes.values())
    files = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    table = cfg["vocab_size"] * cfg["hidden_size"]
    heads = 1 if cfg["tie_word_embeddings"] else 2
    return {
        "files_bytes": files,
        "resident_bytes": resident,
        "resident_over_files": round(resident / files, 4),
        **sizes,
        "embedding_and_head_float16_bytes": 2 * table * heads,
        "embedding_and_head_packed_bytes": table * heads * (2 / 8 + 4 / GROUP),
        "backend": "mlx " + mx.__version__ + ", default device " + str(mx.default_device()),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: all)")
    ap.add_argument(
        "--out",
        type=Path,
        required=True,
        help="directory to write, or a pack this script wrote to measure again",
    )
    ap.add_argument("--write-only", action="store_true", help="write the pack, do not load it")
    args = ap.parse_args(argv)
    mx.random.seed(0)
    cfg = config(args.shape, args.layers)
    if (args.out / "config.json").is_file():  # measure an existing pack in a fresh process
        cfg = json.loads((args.out / "config.json").read_text())
    else:
        write(args.out, cfg)
    if args.write_only:
        return 0
    print(
        json.dumps(
            {"shape": args.shape, "layers": cfg["num_hidden_layers"], **measure(args.out, cfg)}
        )
    )


if __name__ == "__main__":
    sys.exit(main())
