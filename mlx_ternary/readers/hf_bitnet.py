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
import numpy as np

from ..errors import FormatError
from ..format import PackedTernary, QuantizationConfig, ternarize_absmean
from .common import load_tensors, shard_files


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
    weights = load_tensors(shard_files(model_path))
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
