"""The bandwidth ceiling: bytes read per decoded token and the tokens/s they allow.

Decoding one token reads every weight once (the embedding table only for the one row
it looks up, unless it doubles as the output layer) plus the KV cache so far. At B bytes
per token a device that streams M bytes/s cannot decode faster than M / B tokens/s: the
ceiling every table in bench.py is measured against. Computed, never measured.
"""

import platform
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .. import format as fmt

# Apple silicon memory bandwidth (GB/s = 1e9 bytes/s) by chip and GPU core count, from
# Apple's published specifications (collected in the project notes on Apple GPUs).
APPLE_CHIPS: List[Tuple[str, int, float]] = [
    ("M1", 8, 68),
    ("M1 Pro", 16, 200),
    ("M1 Max", 32, 400),
    ("M1 Ultra", 64, 800),
    ("M2", 10, 100),
    ("M2 Pro", 19, 200),
    ("M2 Max", 38, 400),
    ("M2 Ultra", 76, 800),
    ("M3", 10, 100),
    ("M3 Pro", 18, 150),
    ("M3 Max", 30, 300),
    ("M3 Max", 40, 400),
    ("M3 Ultra", 80, 819),
    ("M4", 10, 120),
    ("M4 Pro", 20, 273),
    ("M4 Max", 32, 410),
    ("M4 Max", 40, 546),
]

# What a Metal run holds per format: 16-bit float parameters, KV cache and MLX affine
# scales/biases (group 64, mlx-lm's default), the ternary scales as stored.
METAL_FLOAT_BYTES = 2
Q_GROUP_SIZE = 64
Q_BITS = {"q2": 2, "q4": 4}
FLOAT_BYTES = {"bf16": 2, "f32": 4}


@dataclass
class LinearShape:
    """One ternary linear layer: N outputs, K inputs, its scales' shape and dtype size."""

    out_features: int
    in_features: int
    scales_shape: Tuple[int, int]
    scale_bytes: int
    group_size: Optional[int] = None


def chip_label(chip: str, cores: int) -> str:
    """`M3 Max (40-core GPU)` where a chip comes in variants of different bandwidth."""
    variants = [c for c, _, _ in APPLE_CHIPS if c == chip]
    return f"{chip} ({cores}-core GPU)" if len(variants) > 1 else chip


def linear_bytes(shape: LinearShape, format_name: str) -> int:
    """Bytes a format holds (and a decode step reads) for one ternary linear layer.

    compact/fast: the packed trits plus the scales as stored; q2/q4: MLX affine codes
    plus 16-bit scales and biases per group of 64; bf16/f32: the dense weight.
    """
    n, k = shape.out_features, shape.in_features
    scales = shape.scales_shape[0] * shape.scales_shape[1] * shape.scale_bytes
    if format_name in ("compact", "fast"):
        rows, cols = fmt.packed_shape(format_name, n, k, shape.group_size)
        item = 1 if format_name == "compact" else 4
        return rows * cols * item + scales
    if format_name in Q_BITS:
        groups = fmt.ceil_div(k, Q_GROUP_SIZE)
        return n * k * Q_BITS[format_name] // 8 + 2 * n * groups * METAL_FLOAT_BYTES
    if format_name in FLOAT_BYTES:
        return n * k * FLOAT_BYTES[format_name]
    raise ValueError(f"unknown format {format_name!r}")


def decode_bytes(weight_bytes: int, kv_bytes_per_token: int, state_bytes: int, context: int) -> int:
    """Bytes read to decode one token at `context` tokens of history."""
    return weight_bytes + kv_bytes_per_token * context + state_bytes


def ceiling_tps(bytes_per_token: int, bandwidth_gbs: float) -> float:
    """The decode rate a device streaming `bandwidth_gbs` GB/s cannot beat."""
    return bandwidth_gbs * 1e9 / bytes_per_token


def metal_decode_bytes(
    linears: List[LinearShape],
    format_name: str,
    float_elements_read: int,
    kv_elements_per_token: int,
    state_elements: int,
    context: int,
) -> int:
    """Bytes per decoded token for a format as a Metal run holds it (16-bit floats)."""
    weights = sum(linear_bytes(s, format_name) for s in linears)
    weights += float_elements_read * METAL_FLOAT_BYTES
    return decode_bytes(
        weights,
        kv_elements_per_token * METAL_FLOAT_BYTES,
        state_elements * METAL_FLOAT_BYTES,
        context,
    )


def apple_table(
    linears: List[LinearShape],
    formats: List[str],
    float_elements_read: int,
    kv_elements_per_token: int,
    state_elements: int,
    context: int,
) -> List[Dict]:
    """Ceiling tokens/s for each format on each Apple chip of APPLE_CHIPS.

    Returns:
        [{"chip", "bandwidth_gbs", "tps": {format: tokens/s}}], one per chip variant.
    """
    per_format = {
        f: metal_decode_bytes(
            linears, f, float_elements_read, kv_elements_per_token, state_elements, context
        )
        for f in formats
    }
    return [
        {
            "chip": chip_label(chip, cores),
            "bandwidth_gbs": bw,
            "tps": {f: ceiling_tps(b, bw) for f, b in per_format.items()},
        }
        for chip, cores, bw in APPLE_CHIPS
    ]


def _gpu_cores() -> Optional[int]:
    try:
        out = subprocess.run(
            ["ioreg", "-rc", "AGXAccelerator"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if '"gpu-core-count"' in line:
            try:
                return int(line.rsplit("=", 1)[1].strip())
            except ValueError:
                return None
    return None


def device_bandwidth(device_name: str) -> Tuple[Optional[float], str]:
    """(GB/s, how it was found) for the current device, or (None, why not).

    Known only for Apple chips named by MLX (e.g. "Apple M4 Pro"); a chip that comes in
    variants of different bandwidth is told apart by its GPU core count.
    """
    name = device_name.replace("Apple", "").strip()
    matches = [(c, n, bw) for c, n, bw in APPLE_CHIPS if c == name]
    if not matches:
        return None, f"bandwidth of {device_name!r} unknown; pass --bandwidth GB/S"
    if len({bw for _, _, bw in matches}) == 1:
        return matches[0][2], f"{name} (Apple spec)"
    cores = _gpu_cores() if platform.system() == "Darwin" else None
    for chip, n, bw in matches:
        if n == cores:
            return bw, f"{chip_label(chip, n)} (Apple spec)"
    return None, f"{name} GPU core count unknown; pass --bandwidth GB/S"
