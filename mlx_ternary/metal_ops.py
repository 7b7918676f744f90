"""Launch wrappers for the Metal kernels in metal/*.metal (real GPU or CPU emulator).

Each wrapper validates shapes and dtypes (ValueError naming the rule), then owns the grid,
threadgroup and template arguments. Kernels are built on first use through
`mx.fast.metal_kernel` ("metal") or `mlx_ternary.emulator.metal_kernel` ("emulate"); each
.metal file is split at its "//// BODY ////" line into `header` and kernel `source`.

Kernels (docs/KERNELS.md has the thread mappings and the cost model):
    gemv_fast      decode, fast packing, M <= 8 tokens; decode "offset" | "exact"
    gemv_compact   decode, compact packing, M <= 8 tokens; decode "select" | "table"
    gemm           prefill, either packing, any M; weights decoded once per 64 tokens
"""

import re
from typing import Dict, Optional, Tuple

import mlx.core as mx

from .format import (CODES_PER_WORD, GROUP_SIZES, PACKINGS, TRITS_PER_BYTE,
                     compact_row_bytes, fast_padded_k)
from .metal_sources import read_source

BODY_MARKER = "//// BODY ////"
MAX_GEMV_TOKENS = 8
FAST_DECODES = ("offset", "exact")
COMPACT_DECODES = ("select", "table")
# "offset" adds ~1e-4 relative error (measured through the emulator, docs/KERNELS.md): below
# float16/bfloat16 output rounding, so it is the default there; float32 gets "exact".
DEFAULT_FAST_DECODE = {mx.float16: "offset", mx.bfloat16: "offset", mx.float32: "exact"}
DEFAULT_COMPACT_DECODE = "select"
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
TABLE_BYTES = 24 * 1024  # threadgroup memory for the T-MAC tables (of 32 KB)

_INPUTS = ["x", "wq", "scales", "bias", "params"]
_KERNELS: Dict[Tuple[str, str], object] = {}
_DUMMY_BIAS = {}


def split_source(text: str) -> Tuple[str, str]:
    """(header, body) of a kernel file; the body is what mx.fast.metal_kernel calls source.

    The two are separated by a line holding exactly BODY_MARKER.
    """
    parts = re.split(rf"^{re.escape(BODY_MARKER)}[ \t]*$", text, maxsplit=1, flags=re.M)
    if len(parts) != 2:
        raise ValueError(f"kernel source has no {BODY_MARKER!r} line separating header and body")
    return parts[0], parts[1]


def _factory(backend: str):
    if backend == "metal":
        return mx.fast.metal_kernel
    if backend == "emulate":
        from .emulator import metal_kernel

        return metal_kernel
    raise ValueError(f"metal_ops runs backend 'metal' or 'emulate', not {backend!r}")


def get_kernel(name: str, backend: str):
    """The built kernel `name` (file metal/<name>.metal) for `backend`, built on first use."""
    key = (backend, name)
    if key not in _KERNELS:
        header, body = split_source(read_source(f"{name}.metal"))
        _KERNELS[key] = _factory(backend)(
            name=f"ternary_{name}", input_names=_INPUTS, output_names=["y"],
            source=body, header=header, ensure_row_contiguous=True,
        )
    return _KERNELS[key]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check(x: mx.array, packed: mx.array, scales: mx.array, bias: Optional[mx.array],
           packing: str, in_features: int, group_size: Optional[int],
           activation_bits: Optional[int]) -> int:
    """Validate one call; returns the scale mode (0 tensor, 1 row, 2 group)."""
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != in_features:
        raise ValueError(f"x must end in in_features = {in_features} columns, got shape "
                         f"{tuple(x.shape)}")
    if packed.ndim != 2:
        raise ValueError(f"packed must be 2-D (N, row), got shape {tuple(packed.shape)}")
    n = packed.shape[0]
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES} or None, got {group_size}")
    if packing == "fast":
        want, dtype = (n, fast_padded_k(in_features) // CODES_PER_WORD), mx.uint32
    else:
        want, dtype = (n, compact_row_bytes(in_features, group_size)), mx.uint8
    if packed.dtype != dtype or tuple(packed.shape) != want:
        raise ValueError(f"{packing} packed weight for K = {in_features}, group_size = "
                         f"{group_size} must be {dtype} of shape {want}, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    if scales.dtype not in FLOAT_DTYPES or scales.ndim != 2:
        raise ValueError(f"scales must be a 2-D float array, got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    rows, cols = scales.shape
    if (rows, cols) == (1, 1):
        mode = 0
    elif (rows, cols) == (n, 1):
        mode = 1
    elif group_size is not None and (rows, cols) == (n, _ceil_div(in_features, group_size)):
        mode = 2
    else:
        raise ValueError(f"scales must be (1, 1), (N, 1) or (N, ceil(K / group_size)) = "
                         f"(1, 1), ({n}, 1) or ({n}, "
                         f"{_ceil_div(in_features, group_size) if group_size else '?'}), got "
                         f"{(rows, cols)} with group_size = {group_size}")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype not in FLOAT_DTYPES):
        raise ValueError(f"bias must be a float ({n},) array, got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if activation_bits not in (None, 8):
        raise ValueError(f"activation_bits must be 8 or None, got {activation_bits}")
    return mode


def _bias(bias: Optional[mx.array]) -> mx.array:
    if bias is not None:
        return bias
    if "b" not in _DUMMY_BIAS:
        _DUMMY_BIAS["b"] = mx.zeros((1,), dtype=mx.float32)
    return _DUMMY_BIAS["b"]


def _blocks(in_features: int, group_size: Optional[int]) -> Tuple[int, int, int]:
    """(B columns per compact block, BPB bytes per block, NB blocks per row)."""
    b = group_size or in_features
    return b, _ceil_div(b, TRITS_PER_BYTE), _ceil_div(in_features, b)


def _common_templates(x, scales, bias, mode, group_size, activation_bits):
    return [("T", x.dtype), ("ST", scales.dtype), ("BT", _bias(bias).dtype),
            ("SMODE", mode), ("ACTQ", bool(activation_bits)), ("HAS_BIAS", bias is not None),
            ("G", group_size or 0)]


def table_slice_bytes(tokens: int) -> int:
    """Byte positions per slice of the T-MAC tables ([M][SB][256] float32 <= TABLE_BYTES)."""
    return max(1, TABLE_BYTES // (tokens * 256 * 4))


def gemv(x2: mx.array, packed: mx.array, scales: mx.array, bias: Optional[mx.array], *,
         packing: str, in_features: int, group_size: Optional[int], mode: int,
         activation_bits: Optional[int], decode: Optional[str], backend: str) -> mx.array:
    """Decode GEMV for x2 (M <= 8, K): launches gemv_fast or gemv_compact."""
    m, k = x2.shape
    n = packed.shape[0]
    tmpl = _common_templates(x2, scales, bias, mode, group_size, activation_bits)
    tmpl.append(("M", m))
    if packing == "fast":
        decode = decode or DEFAULT_FAST_DECODE[x2.dtype]
        if decode not in FAST_DECODES:
            raise ValueError(f"fast decode must be one of {FAST_DECODES}, got {decode!r}")
        params = [n, k, packed.shape[1], scales.shape[1]]
        tmpl.append(("DECODE", FAST_DECODES.index(decode)))
        grid, tg = (64, _ceil_div(n, 8), 1), (64, 1, 1)
        name = "gemv_fast"
    else:
        decode = decode or DEFAULT_COMPACT_DECODE
        if decode not in COMPACT_DECODES:
            raise ValueError(f"compact decode must be one of {COMPACT_DECODES}, got {decode!r}")
        b, bpb, nb = _blocks(k, group_size)
        params = [n, k, packed.shape[1], scales.shape[1], b, bpb, nb]
        tmpl += [("DECODE", COMPACT_DECODES.index(decode)), ("SB", table_slice_bytes(m))]
        if decode == "select":
            grid, tg = (64, _ceil_div(n, 8), 1), (64, 1, 1)
        else:
            grid, tg = (128, _ceil_div(n, 128), 1), (128, 1, 1)
        name = "gemv_compact"
    kernel = get_kernel(name, backend)
    return kernel(
        inputs=[x2, packed, scales, _bias(bias), mx.array(params, dtype=mx.int32)],
        template=tmpl, grid=grid, threadgroup=tg,
        output_shapes=[(m, n)], output_dtypes=[x2.dtype],
    )[0]


def gemm(x2: mx.array, packed: mx.array, scales: mx.array, bias: Optional[mx.array], *,
         packing: str, in_features: int, group_size: Optional[int], mode: int,
         activation_bits: Optional[int], backend: str, mma: bool = True) -> mx.array:
    """Prefill GEMM for x2 (M, K): 64-token x 32-row tiles, weights decoded once per tile.

    `mma` multiplies the tiles with simdgroup 8x8 matrices; False uses plain FMA.
    """
    m, k = x2.shape
    n = packed.shape[0]
    b, bpb, nb = _blocks(k, group_size)
    params = [m, n, k, packed.shape[1], scales.shape[1], b, bpb, nb]
    tmpl = _common_templates(x2, scales, bias, mode, group_size, activation_bits)
    tmpl += [("PACKING", PACKINGS.index(packing)), ("MMA", bool(mma))]
    kernel = get_kernel("gemm", backend)
    return kernel(
        inputs=[x2, packed, scales, _bias(bias), mx.array(params, dtype=mx.int32)],
        template=tmpl, grid=(256, _ceil_div(n, 32), _ceil_div(m, 64)),
        threadgroup=(256, 1, 1), output_shapes=[(m, n)], output_dtypes=[x2.dtype],
    )[0]


def ternary_matmul(x: mx.array, packed: mx.array, scales: mx.array,
                   bias: Optional[mx.array] = None, *, packing: str, in_features: int,
                   group_size: Optional[int] = None, activation_bits: Optional[int] = None,
                   backend: str = "metal", decode: Optional[str] = None,
                   kernel: Optional[str] = None) -> mx.array:
    """y = act_quant(x) @ (s * t).T + bias through the project's Metal kernels.

    Args:
        x: (..., K) float16, bfloat16 or float32 activations.
        packed: (N, Kp/16) uint32 (fast) or (N, row_bytes) uint8 (compact), format.py.
        scales: (1, 1), (N, 1) or (N, ceil(K / group_size)), any float dtype.
        bias: optional (N,) float.
        packing: "fast" or "compact".
        in_features: K.
        group_size: scale group (and compact block) size, 64/128/256, or None.
        activation_bits: 8 for fused BitNet int8 per-token activations, else None.
        backend: "metal" (mx.fast.metal_kernel) or "emulate" (the CPU emulator).
        decode: GEMV decode strategy ("offset"/"exact" fast, "select"/"table" compact).
        kernel: force "gemv", "gemm" (simdgroup-matrix tiles) or "gemm_fma" (FMA tiles);
            default: GEMV for at most 8 tokens, else "gemm".

    Returns:
        (..., N) in x's dtype.

    Raises:
        ValueError: shapes or dtypes that break a rule (the message names it).
    """
    mode = _check(x, packed, scales, bias, packing, in_features, group_size, activation_bits)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    m = x2.shape[0]
    if m == 0:
        return mx.zeros((*lead, packed.shape[0]), dtype=x.dtype)
    if kernel is None:
        kernel = "gemv" if m <= MAX_GEMV_TOKENS else "gemm"
    if kernel == "gemv":
        if m > MAX_GEMV_TOKENS:
            raise ValueError(f"the GEMV kernels take at most {MAX_GEMV_TOKENS} tokens, got {m}")
        y = gemv(x2, packed, scales, bias, packing=packing, in_features=in_features,
                 group_size=group_size, mode=mode, activation_bits=activation_bits,
                 decode=decode, backend=backend)
    elif kernel in ("gemm", "gemm_fma"):
        y = gemm(x2, packed, scales, bias, packing=packing, in_features=in_features,
                 group_size=group_size, mode=mode, activation_bits=activation_bits,
                 backend=backend, mma=kernel == "gemm")
    else:
        raise ValueError(f"kernel must be 'gemv', 'gemm', 'gemm_fma' or None, got {kernel!r}")
    return y.reshape(*lead, packed.shape[0])
