"""Writer for mlx-lm's own packed BitLinear layout (`quant_method: bitnet`), what stock
`mlx_lm.load` builds `bitnet` models from (mlx_lm/models/bitlinear_layers.py).

Per linear layer: `weight` (N/4, K) uint8, 2-bit field i of packed row r holding output
row r + i * N/4 as t + 1 (Hugging Face's packing, which readers/hf_bitnet.py reads), and
`weight_scale` (1,), the one scale of the tensor, multiplied after the matmul (mlx-lm's
bitnet class builds its BitLinear layers with invert_weight_scales=False). mlx-lm's
kernel computes in the dtype of `weight_scale` and asserts the input has that dtype, so
every float tensor of the checkpoint is written in that one dtype.
"""

from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ...errors import TernaryError
from ...format import PackedTernary, to_numpy

# What mlx-lm's bitnet class reads as "multiply by weight_scale" (autobitlinear) and
# Hugging Face transformers reads the same way; the offline mode: weights stored packed.
QUANTIZATION_CONFIG = {
    "quant_method": "bitnet",
    "linear_class": "autobitlinear",
    "quantization_mode": "offline",
}


def one_scale(pt: PackedTernary, name: str) -> float:
    """The layer's single scale; refused when its scales differ (BitLinear holds one)."""
    s = np.unique(np.asarray(to_numpy(pt.scales), dtype=np.float32))
    if s.size != 1:
        raise TernaryError(
            f"{name}: its ternary scales vary ({s.size} distinct values, {pt.scale} "
            "scales); mlx-lm's BitLinear holds one scale per tensor, so this model cannot "
            "be written in its layout exactly; convert to the ternary format (--mlx-path) "
            "and load it with mlx_ternary.load"
        )
    return float(s[0])


def pack_rows(t: np.ndarray) -> np.ndarray:
    """Trits (N, K), N a multiple of 4 -> (N/4, K) uint8, field i of row r = row r + i*N/4."""
    n = t.shape[0]
    q = (t.astype(np.int16) + 1).astype(np.uint8).reshape(4, n // 4, t.shape[1])
    return q[0] | (q[1] << 2) | (q[2] << 4) | (q[3] << 6)


def check_shape(pt: PackedTernary, name: str) -> None:
    """mlx-lm's kernel walks N/4 packed rows and K in steps of 4 columns: both must divide."""
    if pt.out_features % 4 or pt.in_features % 4:
        raise TernaryError(
            f"{name}: shape ({pt.out_features}, {pt.in_features}); mlx-lm's BitLinear "
            "kernel needs both dimensions to be multiples of 4; convert to the ternary "
            "format (--mlx-path) instead"
        )


def bitlinear_tensors(path: str, pt: PackedTernary, dtype) -> List[Tuple[str, mx.array]]:
    """`{path}.weight` (N/4, K) uint8 and `{path}.weight_scale` (1,) in `dtype`."""
    check_shape(pt, path)
    s = one_scale(pt, path)
    return [
        (f"{path}.weight", mx.array(pack_rows(pt.trits()))),
        (f"{path}.weight_scale", mx.array([s], dtype=dtype)),
    ]


def bitnet_config(
    config: dict, activation_bits: Optional[int], not_converted: Tuple[str, ...] = ()
) -> dict:
    """config.json: the architecture with the BitNet block mlx-lm dispatches on.

    `input_bits: 0` records a source that runs without activation quantization (what
    readers/hf_bitnet.py reads back); mlx-lm ignores it either way."""
    out = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    q = dict(QUANTIZATION_CONFIG)
    if not_converted:
        q["modules_to_not_convert"] = list(not_converted)
    out["quantization_config"] = q
    if not activation_bits:
        out["input_bits"] = 0
    return out


def model_card(source: str, kind: str, dtype: str, activation_bits: Optional[int]) -> str:
    """README.md for a checkpoint in mlx-lm's BitLinear layout."""
    lines = [
        "---",
        "library_name: mlx",
        "tags: [mlx, bitnet, ternary]",
        "---",
        "",
        f"# {source} (mlx-lm BitLinear, {dtype})",
        "",
        f"Converted by `mlx-ternary convert --to-mlx-lm` from {kind}: mlx-lm's packed "
        "BitLinear layout (`quant_method: bitnet`, uint8 weights, one `weight_scale` per "
        "layer), ternary weights exact. It loads with stock `mlx_lm.load` (and so in apps "
        "that load models through mlx-lm); stock mlx-lm's BitLinear kernel is Metal-only, "
        "so it runs on Apple silicon GPUs. `mlx_ternary.load` reads it too, on any device.",
        "",
    ]
    if activation_bits:
        lines += [
            f"**Activations.** The source model quantizes activations to int{activation_bits} "
            "per token; stock mlx-lm's BitLinear does not, so its outputs differ slightly "
            "from the original. `mlx_ternary.load` keeps the activation quantization.",
            "",
        ]
    return "\n".join(lines)
