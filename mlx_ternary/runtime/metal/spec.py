"""A layer's arrays validated once for the Metal kernels: `check_layer` -> LayerSpec."""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ...format import (
    CODES_PER_WORD,
    TERNARY_GROUP_SIZES,
    ceil_div,
    check_packing,
    compact_row_bytes,
    fast_padded_k,
)

# MLX binds an input of fewer elements in the `constant` address space, where the kernels'
# `(const device uint*)` casts do not compile: such layers run the reference path.
MIN_DEVICE_ELEMENTS = 8
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


@dataclass(frozen=True)
class LayerSpec:
    """What the launches need to know about one layer, validated once."""

    packing: str
    n: int  # out_features
    k: int  # in_features
    group_size: Optional[int]
    mode: int  # scales: 0 tensor, 1 row, 2 group
    act: bool  # int8 activation quantization
    has_bias: bool
    row_width: int  # uint32 words (fast) or bytes (compact) per packed row
    scale_cols: int
    scale_dtype: object
    bias_dtype: object
    packed_size: int

    @property
    def fits_kernels(self) -> bool:
        """False for toy layers MLX would bind as `constant` (the <8-element guard)."""
        return self.packed_size >= MIN_DEVICE_ELEMENTS and self.k >= MIN_DEVICE_ELEMENTS


def _check_packed(packed: mx.array, packing: str, in_features: int, group_size) -> None:
    n = packed.shape[0]
    if packing == "fast":
        want, dtype = (n, fast_padded_k(in_features) // CODES_PER_WORD), mx.uint32
    else:
        want, dtype = (n, compact_row_bytes(in_features, group_size)), mx.uint8
    if packed.dtype != dtype or tuple(packed.shape) != want:
        raise ValueError(
            f"{packing} packed weight for K = {in_features}, group_size = "
            f"{group_size} must be {dtype} of shape {want}, got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )


def _scale_mode(scales: mx.array, n: int, in_features: int, group_size) -> int:
    """The kernels' SMODE of a scales array: 0 tensor, 1 row, 2 group."""
    if scales.dtype not in FLOAT_DTYPES or scales.ndim != 2:
        raise ValueError(
            f"scales must be a 2-D float array, got {scales.dtype} {tuple(scales.shape)}"
        )
    groups = ceil_div(in_features, group_size) if group_size else None
    shapes = {(1, 1): 0, (n, 1): 1}
    if groups is not None:
        shapes[(n, groups)] = 2
    mode = shapes.get(tuple(scales.shape))
    if mode is None:
        raise ValueError(
            f"scales must be (1, 1), (N, 1) or (N, ceil(K / group_size)) = "
            f"(1, 1), ({n}, 1) or ({n}, {groups or '?'}), got "
            f"{tuple(scales.shape)} with group_size = {group_size}"
        )
    return mode


def check_layer(
    packed: mx.array,
    scales: mx.array,
    bias: Optional[mx.array],
    *,
    packing: str,
    in_features: int,
    group_size: Optional[int],
    activation_bits: Optional[int],
) -> LayerSpec:
    """Validate a layer's arrays for the kernels; returns its LayerSpec.

    Raises:
        ValueError: naming the rule a shape or dtype breaks.
    """
    check_packing(packing)
    if packed.ndim != 2:
        raise ValueError(f"packed must be 2-D (N, row), got shape {tuple(packed.shape)}")
    n = packed.shape[0]
    if group_size is not None and group_size not in TERNARY_GROUP_SIZES:
        raise ValueError(
            f"group_size must be one of {TERNARY_GROUP_SIZES} or None, got {group_size}"
        )
    _check_packed(packed, packing, in_features, group_size)
    mode = _scale_mode(scales, n, in_features, group_size)
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype not in FLOAT_DTYPES):
        raise ValueError(f"bias must be a float ({n},) array, got {bias.dtype} {tuple(bias.shape)}")
    if activation_bits not in (None, 8):
        raise ValueError(f"activation_bits must be 8 or None, got {activation_bits}")
    return LayerSpec(
        packing,
        n,
        in_features,
        group_size,
        mode,
        bool(activation_bits),
        bias is not None,
        packed.shape[1],
        scales.shape[1],
        scales.dtype,
        bias.dtype if bias is not None else mx.float32,
        packed.size,
    )


def check_x(x: mx.array, spec: LayerSpec) -> None:
    """Raises ValueError unless x is (..., K) float16, bfloat16 or float32."""
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != spec.k:
        raise ValueError(
            f"x must end in in_features = {spec.k} columns, got shape {tuple(x.shape)}"
        )
