"""Writer for the native mlx-ternary format: config.json + safetensors shards + index."""

import json
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..format import QuantizationConfig
from ..nn import ternary_layers

MAX_SHARD_BYTES = 5 << 30
FOREIGN_QUANT_KEYS = ("quantization", "quantization_config")


def write_shards(out_dir: Path, tensors: Iterable[Tuple[str, mx.array]],
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> Dict[str, str]:
    """Stream tensors into model-0000i-of-0000n.safetensors shards; returns the weight map."""
    shards, current, size = [], {}, 0
    for name, arr in tensors:
        if current and size + arr.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = arr
        size += arr.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        mx.save_safetensors(str(out_dir / fname), shard, metadata={"format": "mlx"})
        weight_map.update({k: fname for k in shard})
    total = sum(a.nbytes for s in shards for a in s.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return weight_map


def native_config(config: dict, quant: QuantizationConfig) -> dict:
    out = {k: v for k, v in config.items() if k not in FOREIGN_QUANT_KEYS}
    out["quantization"] = quant.to_dict()
    return out


def model_quantization(model: nn.Module) -> QuantizationConfig:
    layers = [m for _, m in ternary_layers(model)]
    if not layers:
        raise ValueError("the model has no TernaryLinear layers to save")
    first = layers[0]
    return QuantizationConfig(packing=first.packing, scale=first.scale,
                              group_size=first.group_size,
                              activation_bits=first.activation_bits)


def save_model(model: nn.Module, config: dict, out_dir, tokenizer=None,
               packing: Optional[str] = None) -> Path:
    """Save a model with TernaryLinear layers in the native format.

    Args:
        model: an mlx-lm model whose ternary layers are TernaryLinear.
        config: its config dict (foreign quantization sections are dropped).
        out_dir: the directory to write (created).
        tokenizer: a TokenizerWrapper or HF tokenizer to save beside the weights.
        packing: repack every ternary layer to this packing first.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if packing:
        for _, layer in ternary_layers(model):
            layer.repack(packing)
    quant = model_quantization(model)
    write_shards(out_dir, tree_flatten(model.parameters()))
    (out_dir / "config.json").write_text(json.dumps(native_config(config, quant), indent=2))
    if tokenizer is not None:
        getattr(tokenizer, "_tokenizer", tokenizer).save_pretrained(str(out_dir))
    return out_dir
