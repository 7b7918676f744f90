"""One tensor into llama.cpp's GGUF encoding (writers/gguf.py streams them).

Ternary weights, exact at any width, in the best form llama.cpp runs (measured in
docs/CONVERT.md, "Widths that are not whole TQ blocks"):
- TQ2_0 / TQ1_0 when a row is whole 256-weight blocks and the scale is one number per
  block (d = s). A gated MLP whose intermediate size is not a multiple of 256 (llama,
  qwen) is padded with zero rows in gate/up and zero columns in down_proj: act(0) * 0
  is 0, so the padded model computes the same numbers, and its down_proj becomes TQ
  too (smaller and faster in llama.cpp than a Q8_0 down_proj: docs/CONVERT.md).
- else Q8_0 with codes t in {-1, 0, 1} and d = s per 32 weights;
- else float32.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from ...format import AffineTensor, PackedTernary, ceil_div, expand_scales, to_numpy
from ..gguf_tables import Q_BLOCK, TQ_BLOCK, rotary_heads, rotary_permute

PADDED_FFN = ("llama", "qwen2", "qwen3")  # gated MLP, act(0) = 0, no norm inside


@dataclass
class Encoding:
    """How an mlx-lm tensor changes on its way into llama.cpp's layout."""

    config: dict
    permute: bool  # Q/K rows into llama.cpp's rotary order (llama)
    ffn: Optional[int] = None  # padded intermediate size, when padding

    @classmethod
    def make(cls, config: dict, permute: bool) -> "Encoding":
        n = config["intermediate_size"]
        pad = (
            config["model_type"] in PADDED_FFN
            and n % TQ_BLOCK
            and config["hidden_size"] % TQ_BLOCK == 0
        )
        return cls(config, permute, ceil_div(n, TQ_BLOCK) * TQ_BLOCK if pad else None)

    def apply(self, hf: str, a: np.ndarray, edge: bool = False) -> np.ndarray:
        """Rotary order and FFN padding for a (rows, cols) array (edge: repeat, not zero)."""
        n_head = rotary_heads(hf, self.config) if self.permute else None
        if n_head:
            a = rotary_permute(a, n_head)
        if self.ffn and a.ndim == 2:
            extra = self.ffn - self.config["intermediate_size"]
            if ".mlp.gate_proj." in hf or ".mlp.up_proj." in hf:
                a = np.pad(
                    a,
                    ((0, extra if a.shape[0] > 1 else 0), (0, 0)),
                    mode="edge" if edge else "constant",
                )
            elif ".mlp.down_proj." in hf:
                a = np.pad(a, ((0, 0), (0, extra)), mode="edge" if edge else "constant")
        return np.ascontiguousarray(a)

    def scales(self, hf: str, scales: np.ndarray, group_size: Optional[int]) -> np.ndarray:
        """A ternary-format scales array (1, 1) | (N, 1) | (N, G) laid out as the weight is."""
        if scales.shape == (1, 1):
            return scales
        if ".mlp.down_proj." in hf:  # padded along its columns only: the scale groups
            if scales.shape[1] > 1 and self.ffn:
                groups = ceil_div(self.ffn, group_size)
                return np.pad(scales, ((0, 0), (0, groups - scales.shape[1])), mode="edge")
            return scales
        return self.apply(hf, scales, edge=True)


def q8_0_codes(t: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Trits (N, K) and per-weight scales (N, K) -> Q8_0 bytes: d = s, codes = t."""
    n, k = t.shape
    d = s.reshape(n, k // Q_BLOCK, Q_BLOCK)[:, :, 0].astype(np.float16)
    q = t.reshape(n, k // Q_BLOCK, Q_BLOCK).astype(np.int8)
    blocks = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    return blocks.reshape(n, -1)


def _constant_over(s: np.ndarray, block: int) -> bool:
    n, k = s.shape
    b = s.reshape(n, k // block, block)
    return bool((b == b[:, :, :1]).all())


def ternary(hf: str, pt: PackedTernary, qtype: str, plan: Encoding):
    """One ternary weight -> (data, GGML type or None for float32, max error, exact scales).

    The error is that of the values llama.cpp computes with (its d is float16); when the
    scales are not float16 numbers, `exact scales` (GGUF layout, float32) is what
    `mlx_ternary.scale.<tensor>` keeps so that mlx-ternary reads the weight back exactly.
    """
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    scales = to_numpy(pt.scales).astype(np.float32)
    t = plan.apply(hf, pt.trits())
    s = plan.apply(
        hf,
        np.broadcast_to(
            expand_scales(scales, pt.in_features, pt.group_size), (pt.out_features, pt.in_features)
        ),
        edge=True,
    )
    w = t.astype(np.float32) * s
    k = t.shape[1]
    if k % TQ_BLOCK == 0 and _constant_over(s, TQ_BLOCK):
        q = Q[qtype]
        data = quants.quantize(w, q)
    elif k % Q_BLOCK == 0 and _constant_over(s, Q_BLOCK):
        q = Q.Q8_0
        data = q8_0_codes(t, s)
    else:
        return w, None, 0.0, None
    back = quants.dequantize(data, q).reshape(w.shape)
    if np.array_equal(scales.astype(np.float16).astype(np.float32), scales):
        exact = None
    else:  # kept in the layout the file has (row order, padding)
        exact = plan.scales(hf, scales, pt.group_size)
    return data, q, float(np.abs(back - w).max(initial=0.0)), exact


def _codes(at: AffineTensor) -> np.ndarray:
    """MLX's packed codes -> (N, K) uint8 (a little-endian bit stream per row)."""
    words = np.array(at.weight).astype("<u4")
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    n, k = at.shape
    return np.packbits(
        np.pad(bits.reshape(n, k, at.bits), ((0, 0), (0, 0), (0, 8 - at.bits))),
        axis=2,
        bitorder="little",
    ).reshape(n, k)


def affine(hf: str, at: AffineTensor, plan: Encoding):
    """An MLX affine weight -> (data, GGML type or None for float, max round-trip error).

    4-bit codes with float16 scale and bias per 32 (or a multiple) are Q4_1 exactly; 8-bit
    codes whose bias is -128 * scale are Q8_0; anything else is written as floats.
    """
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    s = np.array(at.scales.astype(mx.float32))
    b = np.array(at.biases.astype(mx.float32))
    # in float32 throughout (AffineTensor.dequantize rounds to the scales' dtype first)
    w = plan.apply(
        hf,
        np.array(
            mx.dequantize(
                at.weight, mx.array(s), mx.array(b), group_size=at.group_size, bits=at.bits
            )
        ),
    )
    exact16 = np.array_equal(s.astype(np.float16).astype(np.float32), s) and np.array_equal(
        b.astype(np.float16).astype(np.float32), b
    )
    fits = (
        exact16
        and at.group_size % 32 == 0
        and w.shape == at.shape
        and (at.bits == 4 or (at.bits == 8 and np.array_equal(b, -128 * s)))
    )
    if not fits:  # includes an MLP padded to whole TQ blocks: zeros have no code
        f16 = w.astype(np.float16)
        return (f16 if np.array_equal(f16.astype(np.float32), w) else w), None, 0.0
    q = plan.apply(hf, _codes(at))
    n, k = q.shape
    per = np.repeat(plan.apply(hf, s, edge=True), at.group_size // 32, axis=1)[..., None]
    if at.bits == 4:
        m = np.repeat(plan.apply(hf, b, edge=True), at.group_size // 32, axis=1)[..., None]
        nib = q.reshape(n, k // 32, 2, 16)
        body = nib[:, :, 0] | (nib[:, :, 1] << 4)
        head = np.concatenate(
            [per.astype(np.float16).view(np.uint8), m.astype(np.float16).view(np.uint8)], axis=-1
        )
        qtype = Q.Q4_1
    else:
        body = (q.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
        body = body.reshape(n, k // Q_BLOCK, Q_BLOCK)
        head, qtype = per.astype(np.float16).view(np.uint8), Q.Q8_0
    data = np.concatenate([head, body], axis=-1).reshape(n, -1)
    back = quants.dequantize(data, qtype).reshape(w.shape)
    return data, qtype, float(np.abs(back - w).max(initial=0.0))


def floating(hf: str, arr: mx.array, plan: Encoding):
    """(data, GGML type or None, 0.0): 1-D as float32, others in their own precision."""
    from gguf import GGMLQuantizationType as Q

    if arr.ndim == 1 or arr.dtype not in (mx.float16, mx.bfloat16):
        return plan.apply(hf, np.array(arr.astype(mx.float32))), None, 0.0
    if arr.dtype == mx.float16:
        return plan.apply(hf, np.array(arr)), None, 0.0
    bits = plan.apply(hf, np.array(arr.view(mx.uint16)))
    return bits.view(np.uint8), Q.BF16, 0.0
