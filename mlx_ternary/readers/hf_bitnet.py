"""Reader for Hugging Face BitNet checkpoints, packed or float latent.

Packed ("offline"): uint8 (ceil(N/4), K); 2-bit field i of packed row r holds
output row r + i * ceil(N/4) as t + 1. `weight_scale` is one value per tensor:
1 / mean|W| for linear_class "bitlinear" (output divided by it), mean|W| for
"autobitlinear". Latent ("online", or 1bitLLM's `weight_bits: 1` configs): float
weights ternarized at load with absmean, s = mean|W| per tensor.
"""

from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import FormatError
from ..format import PackedTernary, QuantizationConfig, ternarize_absmean
from .common import load_tensors, shard_files


# 1bitLLM/bitnet_b1_58-* checkpoints: model_type "llama", architecture BitnetForCausalLM,
# with the BitNet sub-norms under their own names and a configurable activation.
ONEBIT_ARCH = "BitnetForCausalLM"
ONEBIT_RENAMES = {".self_attn.inner_attn_ln.": ".self_attn.attn_sub_norm.",
                  ".mlp.ffn_layernorm.": ".mlp.ffn_sub_norm."}
ACTIVATIONS = {"relu2": nn.relu2, "silu": nn.silu, "gelu": nn.gelu, "relu": nn.relu}


def model_config(config: dict) -> dict:
    """The config mlx-lm's classes need for a BitNet checkpoint."""
    if ONEBIT_ARCH in (config.get("architectures") or []):
        config = {**config, "model_type": "bitnet", "tie_word_embeddings":
                  config.get("tie_word_embeddings", False)}
    return config


class GatedMLP(nn.Module):
    """mlx-lm bitnet's MLP with the activation the checkpoint names (its class fixes relu2)."""

    def __init__(self, mlp: nn.Module, act):
        super().__init__()
        self.gate_proj, self.up_proj = mlp.gate_proj, mlp.up_proj
        self.down_proj, self.ffn_sub_norm = mlp.down_proj, mlp.ffn_sub_norm
        self._act = act

    def __call__(self, x):
        return self.down_proj(self.ffn_sub_norm(self._act(self.gate_proj(x)) * self.up_proj(x)))


def adapt_model(model: nn.Module, config: dict) -> None:
    """Give a bitnet-class model the checkpoint's MLP activation when it is not relu2."""
    act = config.get("hidden_act", "relu2")
    if config.get("model_type") != "bitnet" or act == "relu2":
        return
    if act not in ACTIVATIONS:
        raise FormatError(f"config.json: hidden_act {act!r} is not supported for BitNet models "
                          f"(supported: {', '.join(ACTIVATIONS)})")
    for layer in model.layers:
        layer.mlp = GatedMLP(layer.mlp, ACTIVATIONS[act])


def _rename(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    out = {}
    for k, v in weights.items():
        for old, new in ONEBIT_RENAMES.items():
            k = k.replace(old, new)
        out[k] = v
    return out


def _quant_config(config: dict) -> dict:
    qc = config.get("quantization_config") or {}
    return qc if qc.get("quant_method") == "bitnet" else {}


def detect(config: dict) -> bool:
    return bool(_quant_config(config)) or config.get("weight_bits") == 1


def unpack_hf(packed: np.ndarray, out_features: int) -> np.ndarray:
    """HF BitNet packed uint8 (ceil(N/4), K) -> trits (N, K) int8."""
    rows = packed.shape[0]
    fields = [((packed >> (2 * i)) & 3) for i in range(4)]
    return (np.concatenate(fields, axis=0)[:out_features].astype(np.int8) - 1)


def _excluded(path: str, skip) -> bool:
    return any(path == s or path.endswith("." + s) or path.startswith(s + ".") for s in skip)


def read(model_path: Path, config: dict, linears: Dict[str, tuple], packing: str,
         sanitize=None) -> Tuple[Dict[str, mx.array], QuantizationConfig]:
    """Tensors in native naming, ternary layers packed in `packing`.

    Args:
        linears: {module path: (in, out, has_bias)} of the model's Linear-like layers.
        sanitize: the model class's `sanitize`, applied to the raw tensors first.
    """
    qc = _quant_config(config)
    weights = _rename(load_tensors(shard_files(model_path)))
    if sanitize is not None:
        weights = sanitize(weights)
    invert = qc.get("linear_class", "bitlinear") != "autobitlinear"
    skip = set(qc.get("modules_to_not_convert") or []) | {"lm_head"}
    act_bits = qc.get("activation_bits", config.get("input_bits", 8))
    for path, (k, n, _) in linears.items():
        if _excluded(path, skip) or f"{path}.weight" not in weights:
            continue
        w = weights.pop(f"{path}.weight")
        name = f"{model_path.name}: {path}.weight"
        if w.dtype == mx.uint8:
            if f"{path}.weight_scale" not in weights:
                raise FormatError(f"{name} is packed but {path}.weight_scale is missing")
            ws = np.array(weights.pop(f"{path}.weight_scale").astype(mx.float32)).reshape(-1)
            if ws.size != 1:
                raise FormatError(f"{path}.weight_scale: expected one value per tensor, got {ws.size}")
            if w.shape != (-(-n // 4), k):
                raise FormatError(
                    f"{name}: packed shape {tuple(w.shape)} does not match the config's "
                    f"({n}, {k}) layer (expected ({-(-n // 4)}, {k}))"
                )
            t = unpack_hf(np.array(w), n)
            s = np.float32(1.0) / ws[:1] if invert else ws[:1]
            s = s.reshape(1, 1).astype(np.float32)
        else:
            if tuple(w.shape) != (n, k):
                raise FormatError(f"{name}: shape {tuple(w.shape)}, the config expects ({n}, {k})")
            t, s = ternarize_absmean(np.array(w.astype(mx.float32)))
        pt = PackedTernary.from_trits(t, s, packing, name=name)
        weights[f"{path}.packed"] = mx.array(pt.packed)
        weights[f"{path}.scales"] = mx.array(pt.scales)
    quant = QuantizationConfig(packing=packing, scale="tensor",
                               activation_bits=8 if act_bits else None)
    return weights, quant
