"""Write a random ternary checkpoint with a real architecture's shape, for benchmarks.

    python scripts/make_synthetic_model.py --shape bitnet-2b --out /tmp/bitnet-2b

The model is mlx-lm's class for the architecture, built lazily (nothing materialized);
each tensor is drawn, packed and streamed to safetensors shards one at a time, so
memory holds one tensor, never the model. Weights are uniform random trits with
random scales: the checkpoint measures speed and memory, it says nothing sensible.
No tokenizer is written (`mlx-ternary bench` needs none).
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_ternary import format as fmt
from mlx_ternary.checkpoint.writers.native import ShardWriter, native_config
from mlx_ternary.runtime.layers import linear_paths

# Published shapes: BitNet b1.58 2B4T, Llama-3-8B (HF1BitLLM's ternary Llama3-8B-1.58),
# Llama-3.2-1B, Qwen3.5-27B (Ternary-Bonsai / Bonsai-2 27B). `tiny` is a BitNet for tests.
SHAPES = {
    "bitnet-2b": dict(
        config=dict(
            model_type="bitnet",
            hidden_size=2560,
            intermediate_size=6912,
            num_hidden_layers=30,
            num_attention_heads=20,
            num_key_value_heads=5,
            vocab_size=128256,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
        scale="tensor",
        group_size=None,
        activation_bits=8,
    ),
    "llama-8b": dict(
        config=dict(
            model_type="llama",
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        ),
        scale="tensor",
        group_size=None,
        activation_bits=8,
    ),
    "llama-1b": dict(  # Llama-3.2-1B: 32/8 heads split across 2, 4 or 8 ranks
        config=dict(
            model_type="llama",
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
        scale="tensor",
        group_size=None,
        activation_bits=8,
    ),
    "bonsai-27b": dict(
        config=dict(
            model_type="qwen3_5",
            text_config=dict(
                model_type="qwen3_5_text",
                hidden_size=5120,
                intermediate_size=17408,
                num_hidden_layers=64,
                num_attention_heads=24,
                num_key_value_heads=4,
                head_dim=256,
                linear_num_value_heads=48,
                linear_num_key_heads=16,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                linear_conv_kernel_dim=4,
                full_attention_interval=4,
                vocab_size=248320,
                rms_norm_eps=1e-6,
                max_position_embeddings=262144,
                tie_word_embeddings=False,
                rope_parameters={
                    "type": "default",
                    "rope_theta": 10000000.0,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": [11, 11, 10],
                },
            ),
        ),
        scale="group",
        group_size=128,
        activation_bits=None,
    ),
    "tiny": dict(
        config=dict(
            model_type="bitnet",
            hidden_size=128,
            intermediate_size=320,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        ),
        scale="tensor",
        group_size=None,
        activation_bits=8,
    ),
}
FLOAT_DTYPE = mx.bfloat16
SCALE_DTYPE = mx.bfloat16


def shape_config(shape: str, layers=None) -> dict:
    """The config.json (without its quantization section) of a named shape."""
    config = json.loads(json.dumps(SHAPES[shape]["config"]))
    if layers:
        (config.get("text_config") or config)["num_hidden_layers"] = layers
    return config


def tensors(config: dict, packing: str, scale: str, group_size, seed: int):
    """Yield (name, array) for every parameter of the model, ternary layers packed."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))  # lazy: nothing is computed
    linears = {p: d for p, d in linear_paths(model).items() if p.split(".")[-1] != "lm_head"}
    done = set()
    for i, (name, arr) in enumerate(tree_flatten(model.parameters())):
        k = mx.random.key(seed * 1_000_003 + i)  # one key per tensor: reproducible
        path = name.rsplit(".", 1)[0]
        if path in linears:
            if path in done:
                continue
            done.add(path)
            in_f, out_f, has_bias = linears[path]
            k1, k2 = mx.random.split(k)
            t = mx.random.randint(-1, 2, (out_f, in_f), dtype=mx.int8, key=k1)
            gs = group_size if scale == "group" else None
            yield f"{path}.packed", fmt.pack_mx(t, packing, gs)
            s_shape = fmt.scales_shape(scale, out_f, in_f, gs)
            yield (
                f"{path}.scales",
                mx.random.uniform(0.01, 0.05, s_shape, key=k2).astype(SCALE_DTYPE),
            )
            if has_bias:
                yield f"{path}.bias", mx.zeros((out_f,), dtype=FLOAT_DTYPE)
        elif arr.ndim >= 2:
            yield name, (0.02 * mx.random.normal(arr.shape, key=k)).astype(FLOAT_DTYPE)
        elif mx.issubdtype(arr.dtype, mx.floating):
            yield name, mx.ones(arr.shape, dtype=FLOAT_DTYPE)
        else:
            yield name, arr


def write(
    out: Path,
    shape: str,
    packing: str = "compact",
    layers=None,
    seed: int = 0,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Write the synthetic checkpoint of `shape` to `out`; returns `out`."""
    spec = SHAPES[shape]
    config = shape_config(shape, layers)
    quant = fmt.QuantizationConfig(
        packing=packing,
        scale=spec["scale"],
        group_size=spec["group_size"],
        activation_bits=spec["activation_bits"],
    )
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, max_shard_bytes)
    for name, arr in tensors(config, packing, spec["scale"], spec["group_size"], seed):
        writer.add(name, arr)
        del arr
    writer.close()
    (out / "config.json").write_text(json.dumps(native_config(config, quant), indent=2))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--out", required=True, type=Path, help="directory to write")
    ap.add_argument("--packing", default="compact", choices=fmt.PACKINGS)
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="override the number of layers (a cheaper model of the same width)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-gb", type=float, default=2.0)
    a = ap.parse_args(argv)
    if a.layers is not None and a.layers < 1:
        ap.error("--layers must be at least 1")
    write(a.out, a.shape, a.packing, a.layers, a.seed, int(a.max_shard_gb * (1 << 30)))
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
