"""Writer for stock MLX affine checkpoints that plain `mlx_lm.load` reads.

A ternary weight s * t becomes, per group of g input columns, codes q = t + 1 with
scale = s and bias = -s: w = scale * q + bias reproduces s * t exactly at any bit
width (q only uses 0, 1, 2). `mx.quantize` would not: at 2 bits it spreads the four
levels over [-s, s] and rounds the trits to +-s/3 steps. Codes are packed as MLX
does: one little-endian bit stream per row, lowest bits first, in uint32 words.
"""

import json
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ...errors import TernaryError
from ...format import AFFINE_BITS, AFFINE_GROUP_SIZES, PackedTernary

_CHUNK_VALUES = 1 << 22  # codes packed per step: bounds the bit-stream scratch memory


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes (N, K) < 2**bits -> (N, K * bits / 32) uint32 in MLX's affine layout."""
    n, k = codes.shape
    if (k * bits) % 32:
        raise ValueError(f"K * bits must be a multiple of 32, got K={k}, bits={bits}")
    out = np.empty((n, k * bits // 32), dtype=np.uint32)
    step = max(1, _CHUNK_VALUES // k)
    shifts = np.arange(32, dtype=np.uint32)
    for r in range(0, n, step):
        c = codes[r : r + step].astype(np.uint32)
        stream = (c[:, :, None] >> np.arange(bits, dtype=np.uint32)) & 1  # (rows, K, bits)
        words = stream.reshape(c.shape[0], -1, 32) << shifts
        out[r : r + step] = words.sum(axis=-1, dtype=np.uint32)
    return out


def check_args(bits: int, group_size: int) -> None:
    if bits not in AFFINE_BITS:
        raise TernaryError(f"--q-bits must be one of {AFFINE_BITS}, got {bits}")
    if group_size not in AFFINE_GROUP_SIZES:
        raise TernaryError(f"--q-group-size must be one of {AFFINE_GROUP_SIZES}, got {group_size}")


def group_scales(pt: PackedTernary, group_size: int, name: str) -> np.ndarray:
    """Scales (N, K / g) for affine groups of g: exact only if each group has one scale."""
    n, k = pt.out_features, pt.in_features
    if k % group_size:
        raise TernaryError(
            f"{name}: in_features {k} is not a multiple of --q-group-size "
            f"{group_size}; pick a group size that divides it"
        )
    s = pt.scales
    if s.shape[1] == 1:
        return np.broadcast_to(s, (n, k // group_size))
    if pt.group_size % group_size:
        raise TernaryError(
            f"{name}: its ternary scales change every {pt.group_size} columns, so affine "
            f"groups of {group_size} would mix two scales; use --q-group-size that divides "
            f"{pt.group_size}"
        )
    return np.repeat(s, pt.group_size // group_size, axis=1)[:, : k // group_size]


def affine_tensors(
    path: str, pt: PackedTernary, bits: int, group_size: int, dtype=None
) -> List[Tuple[str, mx.array]]:
    """`{path}.weight/.scales/.biases` of a QuantizedLinear holding `pt` exactly.

    weight: (N, K * bits / 32) uint32; scales, biases: (N, K / g) in `dtype`
    (default: the ternary scales' dtype).
    """
    s = np.ascontiguousarray(group_scales(pt, group_size, path))
    codes = pt.trits().astype(np.uint8) + 1
    scales = mx.array(s)
    if dtype is not None:
        scales = scales.astype(dtype)
    return [
        (f"{path}.weight", mx.array(pack_codes(codes, bits))),
        (f"{path}.scales", scales),
        (f"{path}.biases", -scales),
    ]


def dequantized(path: str, pt: PackedTernary, dtype=None) -> List[Tuple[str, mx.array]]:
    """`{path}.weight` as floats s * t (exact in float32; --dtype rounds the scale)."""
    w = mx.array(pt.dequantize(np.float32))
    return [(f"{path}.weight", w.astype(dtype) if dtype is not None else w)]


def affine_config(config: dict, bits: int, group_size: int, layers: Optional[dict] = None) -> dict:
    """config.json for mlx-lm: mlx-lm's own `quantization` block (and its HF mirror),
    with a per-layer entry for each layer kept at its own bits (e.g. a 4-bit embedding)."""
    q = {
        "group_size": group_size,
        "bits": bits,
        "mode": "affine",
        **{path: dict(entry) for path, entry in sorted((layers or {}).items())},
    }
    out = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    out["quantization"] = q
    out["quantization_config"] = json.loads(json.dumps(q))
    return out


def model_card(
    source: str,
    kind: str,
    bits: Optional[int],
    group_size: Optional[int],
    activation_bits: Optional[int],
) -> str:
    """README.md for a stock MLX checkpoint written by convert."""
    what = f"MLX affine {bits}-bit, group size {group_size}" if bits else "float (dequantized)"
    lines = [
        "---",
        "library_name: mlx",
        "tags: [mlx, ternary]",
        "---",
        "",
        f"# {source} ({what})",
        "",
        f"Converted by `mlx-ternary convert` from {kind}. The ternary weights s * t are "
        "represented exactly: loads with plain `mlx_lm.load`, no mlx-ternary needed.",
        "",
    ]
    if activation_bits:
        lines += [
            f"**Activations.** The source model was trained with int{activation_bits} per-token "
            "activation quantization. Stock mlx-lm does not quantize activations, so this "
            "checkpoint computes what the ternary model computes with activation "
            "quantization switched off; outputs differ slightly from the original. "
            "`mlx_ternary.load` on the ternary-format conversion keeps the activation quantization.",
            "",
        ]
    return "\n".join(lines)
