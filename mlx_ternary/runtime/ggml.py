"""llama.cpp's quantized tables (Q8_0, Q4_K, Q5_K, Q6_K) in pure MLX: the reference twin of
the native kernels (runtime/cpu/csrc/kernels/kquants.h), on any backend.

A table is (N, row_bytes) uint8: each row K / block blocks as the GGUF file stores them
(format.GGML_TABLES; docs/FORMAT.md "ggml tables" has the layouts). `dequantize` gives the
float32 weights ggml's dequantize_row_* give; `matmul` multiplies by them with

- float numerics: x @ dequantize(W).T in float32;
- llama numerics (`llama=True`): what llama.cpp's CPU backend computes - x quantized per
  token as Q8_K (256 columns, runtime/q8k.py) for the k-quants, Q8_0 (32 columns,
  `quantize_row_q8_0_ref`: d = amax / 127 rounded to float16, q = round half away(x / d))
  for Q8_0 - and ggml's generic dot products: per block, 8 integer lanes (lane l: columns
  c = l mod 8, times the sub-block scale), `sums[l] += (d_w d_x) * lane`; k-quant mins
  `sumf -= (dmin_w d_x) * sum(bsums * mins)` per block; y = sumf + sums[0] + ... + sums[7].
  Q8_0: `y += float(sum q_w q_x) * (d_w d_x)` per block.
"""

from typing import Tuple

import mlx.core as mx

from ..format import check_ggml_type
from . import q8k


def _f16(lo: mx.array, hi: mx.array) -> mx.array:
    """Two bytes (little-endian) -> their float16 value as float32."""
    h = lo.astype(mx.uint16) | (hi.astype(mx.uint16) << 8)
    return h.view(mx.float16).astype(mx.float32)


def _k4_scales(s: mx.array) -> Tuple[mx.array, mx.array]:
    """Q4_K / Q5_K: 12 bytes (..., 12) -> 6-bit scales and mins (..., 8)."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = mx.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = mx.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(mx.int32), mn.astype(mx.int32)


def _nibbles(qs: mx.array) -> mx.array:
    """(..., 128) bytes -> (..., 256) codes: per 32-byte chunk, low nibbles then high."""
    c = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return mx.concatenate([c & 15, c >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def fields(blocks: mx.array, type_name: str) -> dict:
    """Blocks (..., nb, bytes) uint8 -> q (..., nb, block) int32 codes, sc (..., nb, nsub)
    int32 sub-block scales, d float32 (..., nb); for Q4_K/Q5_K also mn, dmin."""
    b = blocks
    if type_name == "Q8_0":
        return {"q": b[..., 2:].view(mx.int8).astype(mx.int32), "d": _f16(b[..., 0], b[..., 1])}
    if type_name == "Q6_K":
        ql, qh = b[..., 0:128], b[..., 128:192]
        parts = []
        for h in range(2):
            lo, hi, bits = (
                ql[..., 64 * h : 64 * h + 32],
                ql[..., 64 * h + 32 : 64 * h + 64],
                qh[..., 32 * h : 32 * h + 32],
            )
            parts += [
                (lo & 15) | ((bits & 3) << 4),
                (hi & 15) | (((bits >> 2) & 3) << 4),
                (lo >> 4) | (((bits >> 4) & 3) << 4),
                (hi >> 4) | (((bits >> 6) & 3) << 4),
            ]
        q = mx.concatenate(parts, axis=-1).astype(mx.int32) - 32
        sc = b[..., 192:208].view(mx.int8).astype(mx.int32)
        return {"q": q, "sc": sc, "d": _f16(b[..., 208], b[..., 209])}
    sc, mn = _k4_scales(b[..., 4:16])
    q = _nibbles(b[..., -128:]).astype(mx.int32)
    if type_name == "Q5_K":
        qh = b[..., 16:48].astype(mx.int32)  # bit s of qh[l]: bit 4 of column 32 s + l
        high = (qh[..., None, :] >> mx.arange(8, dtype=mx.int32)[:, None]) & 1
        q = q | (high.reshape(q.shape) << 4)
    return {
        "q": q,
        "sc": sc,
        "mn": mn,
        "d": _f16(b[..., 0], b[..., 1]),
        "dmin": _f16(b[..., 2], b[..., 3]),
    }


def _split(blocks: mx.array, type_name: str, k: int) -> mx.array:
    t = check_ggml_type(type_name)
    if blocks.dtype != mx.uint8 or blocks.shape[-1] != k // t.block * t.bytes or k % t.block:
        raise ValueError(
            f"{type_name} blocks of shape {tuple(blocks.shape)} ({blocks.dtype}) are not rows "
            f"of {k} columns"
        )
    return blocks.reshape(*blocks.shape[:-1], k // t.block, t.bytes)


def dequantize(blocks: mx.array, type_name: str, k: int) -> mx.array:
    """(..., row_bytes) uint8 -> (..., k) float32, as ggml's dequantize_row_* compute it:
    Q8_0 q * d; Q4_K / Q5_K (d * sc) * q - (dmin * m); Q6_K (d * sc) * q."""
    f = fields(_split(blocks, type_name, k), type_name)
    q = f["q"].astype(mx.float32)
    if type_name == "Q8_0":
        w = q * f["d"][..., None]
    else:
        nsub = f["sc"].shape[-1]
        q = q.reshape(*q.shape[:-1], nsub, -1)
        dd = (f["d"][..., None] * f["sc"].astype(mx.float32))[..., None]
        w = dd * q
        if "mn" in f:
            w = w - (f["dmin"][..., None] * f["mn"].astype(mx.float32))[..., None]
    return w.reshape(*blocks.shape[:-1], k)


def quantize_q8_0(x: mx.array) -> Tuple[mx.array, mx.array]:
    """ggml's quantize_row_q8_0_ref of x (M, K): q (M, K / 32, 32) integer-valued float32,
    d (M, K / 32) float32 (the float16 it stores, widened)."""
    xb = x.astype(mx.float32).reshape(x.shape[0], -1, 32)
    d = mx.max(mx.abs(xb), axis=-1) / 127.0
    inv = mx.where(d != 0, 1.0 / mx.where(d != 0, d, 1.0), 0.0)
    v = xb * inv[..., None]
    a = mx.abs(v)
    r = mx.floor(a)
    r = mx.where(a - r >= 0.5, r + 1, r)  # roundf: half away from zero
    return mx.where(v < 0, -r, r), d.astype(mx.float16).astype(mx.float32)


def _lanes(q: mx.array, sc: mx.array) -> mx.array:
    """Codes (..., nb, 256) and sub-block scales (..., nb, nsub) -> (..., nb, 8, 32) float32
    of sc * q with column c at lane c mod 8."""
    rep = q.shape[-1] // sc.shape[-1]
    w = q * mx.repeat(sc, rep, axis=-1)
    return w.reshape(*q.shape[:-1], 32, 8).swapaxes(-1, -2).astype(mx.float32)


def _llama_k(x: mx.array, f: dict) -> mx.array:
    """k-quant x Q8_K: (M, K) -> (M, N), ggml's generic vec_dot_q{4,5,6}_K_q8_K."""
    xq, dx = q8k.quantize(x)  # (M, nb, 256), (M, nb)
    wl = _lanes(f["q"], f["sc"])  # (N, nb, 8, 32)
    xl = xq.reshape(*xq.shape[:-1], 32, 8).swapaxes(-1, -2)  # (M, nb, 8, 32)
    # (nb, 8, M, N) integer lane sums, exact in float32 (|partial sums| < 2**24)
    aux = xl.transpose(1, 2, 0, 3) @ wl.transpose(1, 2, 3, 0)
    m, n, nb = x.shape[0], f["q"].shape[0], dx.shape[1]
    sums = [mx.zeros((m, n), dtype=mx.float32) for _ in range(8)]
    sumf = mx.zeros((m, n), dtype=mx.float32)
    if "mn" in f:  # sum over 16 blocks of 16 of bsums * min (exact)
        bsums = xq.reshape(m, nb, 16, 16).sum(-1)
        mins = mx.repeat(f["mn"], 2, axis=-1).astype(mx.float32)  # (N, nb, 16)
        sumi = bsums.transpose(1, 0, 2) @ mins.transpose(1, 2, 0)  # (nb, M, N)
    for b in range(nb):  # in block order, as ggml
        d = f["d"][:, b][None, :] * dx[:, b][:, None]
        sums = [s + d * aux[b, l] for l, s in enumerate(sums)]
        if "mn" in f:
            sumf = sumf - (f["dmin"][:, b][None, :] * dx[:, b][:, None]) * sumi[b]
    for s in sums:
        sumf = sumf + s
    return sumf


def _llama_q8_0(x: mx.array, f: dict) -> mx.array:
    xq, dx = quantize_q8_0(x)  # (M, nb, 32), (M, nb)
    sumi = xq.transpose(1, 0, 2) @ f["q"].astype(mx.float32).transpose(1, 2, 0)  # (nb, M, N)
    y = mx.zeros(sumi.shape[1:], dtype=mx.float32)
    for b in range(sumi.shape[0]):
        y = y + sumi[b] * (f["d"][:, b][None, :] * dx[:, b][:, None])
    return y


def matmul(x: mx.array, blocks: mx.array, type_name: str, k: int, llama: bool = False) -> mx.array:
    """y (..., N) float32 = x (..., k) @ W.T for W (N, row_bytes) blocks; see the module."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(mx.float32)
    if not llama:
        y = x2 @ dequantize(blocks, type_name, k).T
    else:
        f = fields(_split(blocks, type_name, k), type_name)
        y = _llama_q8_0(x2, f) if type_name == "Q8_0" else _llama_k(x2, f)
    return y.reshape(*lead, blocks.shape[0])
