"""Dispatch for the ternary matmul: Metal kernel, emulated Metal kernel, native CPU kernel,
or reference twin.

Choice, first match wins: the `backend` keyword; MLX_TERNARY_EMULATE_METAL=1;
MLX_TERNARY_BACKEND=metal|emulate|native|reference; the native CPU kernel where the default
device is the CPU and it builds; Metal where `mx.metal.is_available()`; the reference twin
elsewhere (CUDA, or a CPU without a compiler).

"metal" launches the project's kernels (metal/*.metal) through mx.fast.metal_kernel,
"emulate" launches the same sources through the CPU emulator (mlx_ternary.emulator),
"native" runs the C++ CPU primitive (mlx_ternary.native), and "reference" runs the pure-MLX
twins (reference.py). Importing this module never needs Metal or a compiler.
"""

import os
from typing import Optional

import mlx.core as mx

from . import metal_ops, native, reference
from .errors import TernaryError

BACKENDS = ("metal", "emulate", "native", "reference")
ENV_BACKEND = "MLX_TERNARY_BACKEND"
ENV_EMULATE = "MLX_TERNARY_EMULATE_METAL"
# The packing `convert` writes by default. The cost model in docs/KERNELS.md predicts the
# 2-bit layout's exponent-OR decode (~3 ALU slots per weight) at ~90 % of bandwidth on every
# Apple GPU, while base-3 is ALU-bound and wins only where ALU is plentiful per byte (M1, M2);
# on M1 Pro/Max/Ultra and M4 Pro/Max fast is faster. scripts/bench_kernels.py settles it.
DEFAULT_PACKING = "fast"


def resolve_backend(backend: Optional[str] = None) -> str:
    """The backend a call will use, after keyword, environment and hardware."""
    if backend is None:
        if os.environ.get(ENV_EMULATE, "") not in ("", "0"):
            backend = "emulate"
        else:
            backend = os.environ.get(ENV_BACKEND) or None
    if backend is None:
        if mx.default_device() == mx.cpu and native.available():
            return "native"
        return "metal" if mx.metal.is_available() else "reference"
    if backend not in BACKENDS:
        raise TernaryError(
            f"unknown ternary backend {backend!r} (from the keyword or ${ENV_BACKEND}); "
            f"expected one of {', '.join(BACKENDS)}"
        )
    if backend == "metal" and not mx.metal.is_available():
        raise TernaryError(
            "the Metal backend was requested but Metal is not available on this machine; "
            f"unset ${ENV_BACKEND} or use backend='reference' (or 'emulate' to run the "
            "Metal sources on the CPU)"
        )
    if backend == "native" and not native.available():
        raise TernaryError(f"the native CPU backend was requested but is unavailable: "
                           f"{native.unavailable_reason()}; unset ${ENV_BACKEND} or use "
                           "backend='reference'")
    return backend


def ternary_matmul(x: mx.array, packed: mx.array, scales: mx.array,
                   bias: Optional[mx.array] = None, *, packing: str, in_features: int,
                   group_size: Optional[int] = None, activation_bits: Optional[int] = None,
                   backend: Optional[str] = None, affine=None) -> mx.array:
    """y = act_quant(x) @ (s * t).T + bias for a packed ternary weight.

    Args:
        x: activations (..., in_features).
        packed: the packed trits in `packing` (see format.py).
        scales: (1, 1), (N, 1) or (N, ceil(K / group_size)).
        bias: optional (N,).
        packing: "compact" or "fast".
        in_features: K.
        group_size: the scale group along K, for group scales.
        activation_bits: 8 for BitNet int8 per-token activations, else None.
        backend: force "metal", "emulate", "native" or "reference".
        affine: the MLX affine arrays for the reference fast path, or a callable
            `affine(dtype)` that returns them (only called on that path).

    Returns:
        (..., out_features) in x's dtype.

    Raises:
        TernaryError: an unknown or unavailable backend.
        ValueError: (Metal kernels) shapes or dtypes that break a kernel's rule.
    """
    backend = resolve_backend(backend)
    if backend == "native":
        return native.ternary_matmul(
            x, packed, scales, bias, packing=packing, in_features=in_features,
            group_size=group_size, activation_bits=activation_bits,
        )
    if backend != "reference":
        return metal_ops.ternary_matmul(
            x, packed, scales, bias, packing=packing, in_features=in_features,
            group_size=group_size, activation_bits=activation_bits, backend=backend,
        )
    if callable(affine):
        affine = affine(x.dtype) if packing == "fast" else None
    return reference.ternary_matmul(
        x, packed, scales, bias, packing=packing, in_features=in_features,
        group_size=group_size, activation_bits=activation_bits, affine=affine,
    )
