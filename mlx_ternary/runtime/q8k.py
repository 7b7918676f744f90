"""llama.cpp's activation numerics for ternary layers, in pure MLX: the reference twin of the
native kernel's q8k mode (activation_bits = format.Q8K).

ggml's TQ1_0 / TQ2_0 dot products never see float activations: each 256-column block of a
token (ggml's QK_K) is quantized as Q8_K (`quantize_row_q8_K_ref`, ggml-quants.c):

    amax = max |x_j|, top = the signed x_j of the first j reaching it
    amax == 0: d = 0, q = 0;  else iscale = -127 / top, q_j = min(127, round(iscale x_j)),
    d = 1 / iscale  (float32 throughout; round half to even; d < 0 when top > 0)

and a layer's output is an integer dot product per block, scaled and summed over the blocks
in order (`ggml_vec_dot_tq2_0_q8_K`, generic):

    y = sum_b float(sum_j q_j t_j) * (d_b * s_b)

With scales per group of 64 or 128 columns (not a layout llama.cpp has) each block is cut
at the groups, and the segments are summed in column order. K not a multiple of 256 is
zero-padded: what llama.cpp computes on the padded file our exporter writes.
"""

from typing import Optional, Tuple

import mlx.core as mx

from ..format import Q8K_BLOCK, ceil_div, unpack_mx

Q8K_QMAX = 127


def quantize(x: mx.array) -> Tuple[mx.array, mx.array]:
    """ggml's Q8_K of x (..., K): (q (..., nb, 256) integer-valued float32, d (..., nb)).

    Gradients pass the rounding unchanged (straight-through, as quantize_activations).
    """
    x = x.astype(mx.float32)
    k = x.shape[-1]
    nb = ceil_div(k, Q8K_BLOCK)
    if nb * Q8K_BLOCK != k:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * Q8K_BLOCK - k)])
    xb = x.reshape(*x.shape[:-1], nb, Q8K_BLOCK)
    first = mx.argmax(mx.abs(xb), axis=-1, keepdims=True)  # the first largest |x|
    top = mx.stop_gradient(mx.take_along_axis(xb, first, axis=-1))
    zero = top == 0
    iscale = -float(Q8K_QMAX) / mx.where(zero, 1.0, top)
    xs = xb * iscale
    q = mx.minimum(mx.round(xs), Q8K_QMAX)
    q = mx.where(zero, 0.0, xs + mx.stop_gradient(q - xs))
    d = mx.where(zero, 0.0, 1.0 / iscale)
    return q, d[..., 0]


def segment_length(group_size: Optional[int], scales: mx.array) -> int:
    """Columns of one segment: a Q8_K block, or a scale group where groups are smaller."""
    if scales.shape[1] == 1 or not group_size:
        return Q8K_BLOCK
    return min(Q8K_BLOCK, group_size)


def matmul(
    x: mx.array,
    packed: mx.array,
    scales: mx.array,
    bias: Optional[mx.array] = None,
    *,
    packing: str,
    in_features: int,
    group_size: Optional[int] = None,
) -> mx.array:
    """y = x @ (s * t).T + bias with x quantized as ggml's Q8_K, summed as ggml does.

    Args:
        x: (..., in_features) activations, any float dtype.
        packed, scales, packing, in_features, group_size: the layer (format.py).
        bias: optional (N,).

    Returns:
        (..., N) in x's dtype; float32 arithmetic throughout.
    """
    lead, k, n = x.shape[:-1], in_features, packed.shape[0]
    q, d = quantize(x.reshape(-1, k))  # (M, nb, 256), (M, nb)
    m, nb = d.shape
    seg = segment_length(group_size, scales)
    per_block, nseg = Q8K_BLOCK // seg, nb * (Q8K_BLOCK // seg)
    t = unpack_mx(packed, packing, k, group_size).astype(mx.float32)
    t = mx.pad(t, [(0, 0), (0, nb * Q8K_BLOCK - k)]).reshape(n, nseg, seg)
    # (nseg, M, N): each segment's integer dot products, exact in float32 (|sum| < 2**15)
    sumi = q.reshape(m, nseg, seg).transpose(1, 0, 2) @ t.transpose(1, 2, 0)
    s = scales.astype(mx.float32)
    if s.shape[1] > 1:  # group scales: the group of each segment's first column
        s = s[:, (mx.arange(nseg) * seg) // group_size]
    s = s.T[:, None, :]  # (1 or nseg, 1, N)
    dseg = mx.repeat(d, per_block, axis=1).T[:, :, None]  # (nseg, M, 1)
    y = mx.zeros((m, n), dtype=mx.float32)
    for j in range(nseg):  # in column order, as ggml's sum over blocks
        y = y + sumi[j] * (dseg[j] * s[j if s.shape[0] > 1 else 0])
    if bias is not None:
        y = y + bias.astype(mx.float32)
    return y.reshape(*lead, n).astype(x.dtype)
