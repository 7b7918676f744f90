"""Pure-MLX twins of the ternary kernels: exact on every backend (CPU, CUDA, Metal).

They define what every Metal kernel must compute. `matmul_fast` is also the
production path off Metal: the fast packing is bit-for-bit MLX's 2-bit affine
layout, so `mx.quantized_matmul` consumes it in place with scale 1, bias -1
(both exact in any float dtype) and the real scale applied to the output.
"""

from functools import lru_cache, partial
from typing import Optional, Tuple

import mlx.core as mx

from ..format import CODES_PER_WORD, Q8K, expand_scales, unpack_mx

ACT_QMAX = 127
ACT_QMIN = -128
ACT_EPS = 1e-5
_QMM_GROUPS = (128, 64, 32)
# Unit scale/bias arrays shared by every layer of one shape: 1 and -1 are exact in
# any dtype, and sharing keeps their memory out of the per-weight budget.
_UNIT_AFFINE = {}


@partial(mx.compile, shapeless=True)  # one fused elementwise pass instead of eight launches
def quantize_activations(x: mx.array) -> Tuple[mx.array, mx.array]:
    """BitNet per-token absmax int8: returns (integer-valued xq, 1 / scale).

    scale = 127 / max(|x|, 1e-5) per token; xq = clamp(round(x * scale), -128, 127).
    The matmul of xq is exact in float32 (|sum| <= 128 K < 2**24 for K < 131072).

    Gradients follow BitNet's straight-through estimator: the fake-quantized input
    xq / scale passes the gradient to x unchanged, so a layer's input gradient is g @ W
    (see `input_grad`). xq is written as xs + stop_gradient(xq - xs), which is bit-for-bit
    xq (xq - xs is exact by Sterbenz's lemma: round(xs) lies within a factor 2 of xs, or is
    0), and the scale is a constant to autodiff. Where xs is not finite (a float16 scale
    overflows on rows below ~2e-3) xq is returned as it is.
    """
    amax = mx.stop_gradient(mx.maximum(mx.abs(x).max(axis=-1, keepdims=True), ACT_EPS))
    scale = ACT_QMAX / amax
    xs = x * scale
    xq = mx.clip(mx.round(xs), ACT_QMIN, ACT_QMAX)
    return mx.where(mx.isfinite(xs), xs + mx.stop_gradient(xq - xs), xq), 1.0 / scale


def materialize(*arrays) -> bool:
    """Evaluate arrays a layer keeps between calls, now, in this thread; False if they are
    traced (inside mx.compile / mx.grad with them as inputs) and so cannot be kept at all.

    MLX ties an unevaluated array's graph to the stream of the thread that made it; used
    from another thread (serve's engine) it fails with "There is no Stream(cpu, 0) in
    current thread" -- through a compiled function that closes over it, even after a
    first call was evaluated.
    """
    try:
        mx.eval(*[a for a in arrays if isinstance(a, mx.array)])
    except ValueError:  # "[eval] ... during function transformations"
        return False
    except RuntimeError as e:  # a compile input's placeholder has no primitive
        if "without a primitive" not in str(e):
            raise
        return False
    return True


def qmm_group(padded_k: int, group_size: Optional[int]) -> int:
    """The MLX quantized-matmul group size used to run a fast-packed weight."""
    for g in _QMM_GROUPS:
        if padded_k % g == 0 and (group_size is None or group_size % g == 0):
            return g
    raise AssertionError("padded K is always a multiple of 32")


def qmm_affine(
    scales: mx.array, out_features: int, padded_k: int, group_size: Optional[int], dtype
) -> Tuple[mx.array, mx.array, int]:
    """Per-group (scales, biases, g) that make MLX's 2-bit affine decode trits.

    Tensor/row scales become unit groups (scale 1, bias -1) and are applied to the
    output; group scales are expanded to the qmm group with bias = -scale.
    """
    g = qmm_group(padded_k, group_size)
    if scales.shape[1] == 1:
        key = (out_features, padded_k // g, dtype)
        if key not in _UNIT_AFFINE:
            ones = mx.ones(key[:2], dtype=dtype)
            _UNIT_AFFINE[key] = (ones, -ones)
            materialize(*_UNIT_AFFINE[key])
        return (*_UNIT_AFFINE[key], g)
    s = scales.astype(dtype)
    if g != group_size:
        s = mx.repeat(s, group_size // g, axis=1)
    s = s[:, : padded_k // g]
    return s, -s, g


def _trits_matmul_fast(x, packed, scales, in_features, group_size, affine):
    """x @ W.T without tensor/row scales (group scales are inside the affine arrays)."""
    n, kp = packed.shape[0], packed.shape[1] * CODES_PER_WORD
    if affine is None:
        affine = qmm_affine(scales, n, kp, group_size, x.dtype)
    qs, qb, g = affine
    if kp != in_features:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, kp - in_features)])
    return mx.quantized_matmul(x, packed, qs, qb, transpose=True, group_size=g, bits=2)


def _trits_matmul_compact(x, packed, scales, in_features, group_size):
    """x @ W.T without tensor/row scales, unpacking the base-3 bytes."""
    t = unpack_mx(packed, "compact", in_features, group_size).astype(x.dtype)
    if scales.shape[1] != 1:
        t = t * expand_scales(scales.astype(x.dtype), in_features, group_size)
    return x @ t.T


def _row_scale(scales: mx.array) -> Optional[mx.array]:
    return scales.reshape(-1) if scales.shape[1] == 1 else None


def matmul_fast(
    x: mx.array,
    packed: mx.array,
    scales: mx.array,
    in_features: int,
    group_size: Optional[int] = None,
    affine: Optional[Tuple[mx.array, mx.array, int]] = None,
) -> mx.array:
    """x (..., K) @ W.T for a fast-packed W: (N, Kp/16) uint32, scales as in format.py.

    `affine` is `qmm_affine(...)` precomputed at load; built here when absent.
    """
    y = _trits_matmul_fast(x, packed, scales, in_features, group_size, affine)
    s = _row_scale(scales)
    return y if s is None else y * s.astype(y.dtype)


def matmul_compact(
    x: mx.array,
    packed: mx.array,
    scales: mx.array,
    in_features: int,
    group_size: Optional[int] = None,
) -> mx.array:
    """x (..., K) @ W.T for a compact-packed W: (N, row_bytes) uint8 base-3."""
    y = _trits_matmul_compact(x, packed, scales, in_features, group_size)
    s = _row_scale(scales)
    return y if s is None else y * s.astype(y.dtype)


def input_grad(
    cotangent: mx.array,
    packed: mx.array,
    scales: mx.array,
    *,
    packing: str,
    in_features: int,
    group_size: Optional[int] = None,
    affine: Optional[Tuple[mx.array, mx.array, int]] = None,
) -> mx.array:
    """The gradient of a ternary linear layer with respect to its input: g @ W, W = s * t.

    This is the rule for every backend, with or without activation quantization (BitNet's
    straight-through estimator lets the gradient pass the int8 rounding unchanged). Metal
    and native kernels have no autodiff of their own: their custom VJPs return this.

    Args:
        cotangent: g, (..., out_features).
        packed, scales, packing, in_features, group_size: the layer, as in `ternary_matmul`.
        affine: `qmm_affine(...)` of a fast-packed layer in g's dtype, if precomputed.

    Returns:
        (..., in_features) in g's dtype.
    """
    s = _row_scale(scales)
    g = cotangent if s is None else cotangent * s.astype(cotangent.dtype)
    if packing == "fast":
        n, kp = packed.shape[0], packed.shape[1] * CODES_PER_WORD
        qs, qb, gs = affine or qmm_affine(scales, n, kp, group_size, g.dtype)
        x = mx.quantized_matmul(g, packed, qs, qb, transpose=False, group_size=gs, bits=2)
        return x[..., :in_features] if kp != in_features else x
    t = unpack_mx(packed, "compact", in_features, group_size).astype(g.dtype)
    if s is None:
        t = t * expand_scales(scales.astype(g.dtype), in_features, group_size)
    return g @ t


# The epilogue ((y * s) * (1 / scale)) + bias, every operation rounded to float32 as written:
# the native kernels and Metal compute exactly this. Two compiled passes, never one: MLX's CPU
# JIT compiles a fused elementwise kernel with the platform compiler's defaults, which on
# aarch64 contract a product feeding an add into one fmadd (one rounding, not two). A product
# that leaves a compiled function is materialized in float32, and the bias add runs as an op of
# its own. Not inside an outer mx.compile either (it would fuse them again): `prepare` and
# `ternary_matmul` keep the bias add outside every compiled function.
@partial(mx.compile, shapeless=True)
def _scale(y: mx.array, row_scale: mx.array, x_scale: mx.array):
    return y * row_scale * x_scale


def _add_bias(p: mx.array, bias: mx.array, dtype: mx.Dtype):
    return (p + bias).astype(dtype)


def _epilogue(y: mx.array, row_scale: mx.array, x_scale: mx.array, bias: mx.array):
    return _add_bias(_scale(y, row_scale, x_scale), bias, y.dtype)


_ONE = mx.array([1.0])
_ZERO = mx.array([0.0])


def _fast_layer(group: int, act: bool):
    """act_quant -> mx.quantized_matmul -> the epilogue's product, in float32 (the bias is
    added after it, outside: see _scale)."""

    def layer(x, packed, qs, qb, row_scale):
        x_scale = _ONE
        if act:
            x, x_scale = quantize_activations(x)
        y = mx.quantized_matmul(x, packed, qs, qb, transpose=True, group_size=group, bits=2)
        return y * row_scale * x_scale

    return layer


@lru_cache(maxsize=None)
def _fast_layer_compiled(group: int, act: bool):
    return mx.compile(_fast_layer(group, act), shapeless=True)


def prepare(
    packed: mx.array,
    scales: mx.array,
    bias: Optional[mx.array] = None,
    *,
    packing: str,
    in_features: int,
    group_size: Optional[int] = None,
    activation_bits: Optional[int] = None,
    dtype=mx.float32,
    affine: Optional[Tuple[mx.array, mx.array, int]] = None,
):
    """`ternary_matmul` for x of `dtype` with everything but x decided: x -> y.

    The fast packing runs one mx.quantized_matmul (times the row scale, in x's dtype) when
    there is no bias and no activation quantization, else one function compiled for this
    layer, its arrays held as constants (traced again per input shape).
    """
    kw = dict(
        packing=packing,
        in_features=in_features,
        group_size=group_size,
        activation_bits=activation_bits,
    )
    n, kp = packed.shape[0], packed.shape[1] * CODES_PER_WORD
    if packing != "fast" or kp != in_features or activation_bits == Q8K:
        return lambda x: ternary_matmul(x, packed, scales, bias, **kw, affine=affine)
    qs, qb, g = affine if affine is not None else qmm_affine(scales, n, kp, group_size, dtype)
    row = _row_scale(scales)
    if row is not None and not activation_bits and bias is None:
        row = row.astype(dtype)
    materialize(qs, qb, row, bias)  # the closures below keep them
    if not activation_bits and bias is None:
        if row is None:
            return lambda x: mx.quantized_matmul(
                x, packed, qs, qb, transpose=True, group_size=g, bits=2
            )
        return lambda x: (
            mx.quantized_matmul(x, packed, qs, qb, transpose=True, group_size=g, bits=2) * row
        )
    layer = _fast_layer(g, bool(activation_bits))
    row = _ONE if row is None else row
    bias = _ZERO if bias is None else bias
    head = mx.compile(lambda x: layer(x, packed, qs, qb, row))
    return lambda x: _add_bias(head(x), bias, x.dtype)


def ternary_matmul(
    x: mx.array,
    packed: mx.array,
    scales: mx.array,
    bias: Optional[mx.array] = None,
    *,
    packing: str,
    in_features: int,
    group_size: Optional[int] = None,
    activation_bits: Optional[int] = None,
    affine=None,
) -> mx.array:
    """The reference ternary linear layer: y = act_quant(x) @ (s * t).T + bias.

    Row scale, activation scale and bias are applied in one fused epilogue. With
    activation_bits = format.Q8K, llama.cpp's block int8 numerics (q8k.py).
    """
    if activation_bits == Q8K:
        kw = dict(packing=packing, in_features=in_features, group_size=group_size)
        from . import q8k  # llama.cpp's block numerics: q8k layers only

        return q8k.matmul(x, packed, scales, bias, **kw)
    n, kp = packed.shape[0], packed.shape[1] * CODES_PER_WORD
    if packing == "fast" and kp == in_features:
        qs, qb, g = affine if affine is not None else qmm_affine(scales, n, kp, group_size, x.dtype)
        row = _row_scale(scales)
        if not activation_bits and bias is None:
            y = mx.quantized_matmul(x, packed, qs, qb, transpose=True, group_size=g, bits=2)
            return y if row is None else y * row.astype(x.dtype)
        p = _fast_layer_compiled(g, bool(activation_bits))(
            x, packed, qs, qb, _ONE if row is None else row
        )
        return _add_bias(p, _ZERO if bias is None else bias, x.dtype)
    x_scale = None
    if activation_bits:
        x, x_scale = quantize_activations(x)
    if packing == "fast":
        y = _trits_matmul_fast(x, packed, scales, in_features, group_size, affine)
    else:
        y = _trits_matmul_compact(x, packed, scales, in_features, group_size)
    row_scale = _row_scale(scales)
    if x_scale is None and row_scale is None and bias is None:
        return y
    return _epilogue(
        y,
        _ONE if row_scale is None else row_scale,
        _ONE if x_scale is None else x_scale,
        _ZERO if bias is None else bias,
    )
