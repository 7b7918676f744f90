"""ggml tensor bytes -> what the model keeps: ternary trits, MLX affine codes, or floats.

Blocks run along a row (ggml's ne0 = the input columns). Layouts, per block:
  TQ2_0  256 weights: qs[64] (2-bit t+1; in each 32-byte half, shift 2k holds weights
         32k..32k+31 of its 128) + fp16 d.           w = d * t
  TQ1_0  256 weights: qs[48] + qh[4] base-3 digits + fp16 d (gguf-py decodes these).
  Q8_0   32 weights: fp16 d + int8 q[32].            w = d * q
  Q4_0   32 weights: fp16 d + 16 bytes; weight j<16 in the low nibble of byte j,
         weight j+16 in its high nibble.             w = d * q - 8 d
  Q4_1   32 weights: fp16 d + fp16 m + nibbles as Q4_0.   w = d * q + m
  Q4_K   256 weights: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128
         bytes of nibbles (each 32 bytes: low nibbles = sub-block 2c, high = 2c+1).
                                                     w = d*sc * q - dmin*m per 32
  Q5_K   as Q4_K plus qh[32] before the nibbles: bit s of qh[l] is bit 4 of weight l of
         sub-block s.
Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K map exactly onto MLX's affine layout (w = scale * q +
bias per group of 32, q packed LSB-first into uint32): they stay quantized. Every other
type gguf-py dequantizes becomes float16.
"""

from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

from ...errors import FormatError
from ...format import TERNARY_GROUP_SIZES, AffineTensor, ceil_div, row_blocks
from ..gguf_tables import Q_BLOCK, TQ_BLOCK

AFFINE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K")


def _blocks(raw: np.ndarray, rows: int, cols: int, block: int, block_bytes: int) -> np.ndarray:
    """(rows, cols / block, block_bytes) uint8 view of a quantized matrix."""
    return np.ascontiguousarray(raw).reshape(rows, cols // block, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry on the last axis -> float16 (..., )."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


# --------------------------------------------------------------------------- #
# Ternary
# --------------------------------------------------------------------------- #


def tq_trits(raw: np.ndarray, qtype, rows: int, cols: int, name: str):
    """TQ1_0 / TQ2_0 bytes -> (trits (rows, cols) int8, d (rows, cols/256) float16)."""
    from gguf import GGML_QUANT_SIZES, quants

    _, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = _blocks(raw, rows, cols, TQ_BLOCK, block_bytes)
    d = _f16(blocks[:, :, -2:])
    t = np.empty((rows, cols), np.int8)
    for r in row_blocks(rows, cols):  # float scratch of one block of rows at a time
        n = len(range(*r.indices(rows)))
        w = quants.dequantize(blocks[r].reshape(n, -1), qtype).reshape(n, cols)
        dd = np.repeat(d[r].astype(np.float32), TQ_BLOCK, axis=1)
        part = np.rint(np.divide(w, dd, out=np.zeros_like(w), where=dd != 0)).astype(np.int8)
        if (np.abs(part) > 1).any() or not np.array_equal(part.astype(np.float32) * dd, w):
            raise FormatError(
                f"{name}: {qtype.name} blocks do not decode to d * t; the file is "
                "corrupt: re-download it"
            )
        t[r] = part
    return t, d


def q8_0_trits(raw: np.ndarray, rows: int, cols: int):
    """Q8_0 whose codes are all in {-1, 0, 1} -> (trits, d (rows, cols/32)); else None."""
    blocks = _blocks(raw, rows, cols, Q_BLOCK, 34)
    q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8)
    if (np.abs(q.astype(np.int16)) > 1).any():
        return None
    return q.reshape(rows, cols), _f16(blocks[:, :, :2])


def float_trits(w: np.ndarray):
    """A float matrix that is exactly s * t with one s per row -> (trits, s (rows, 1))."""
    w = np.asarray(w, dtype=np.float32)
    s = np.abs(w).max(axis=1, keepdims=True)
    t = np.rint(np.divide(w, s, out=np.zeros_like(w), where=s != 0))
    if not np.array_equal(t * s, w):
        return None
    return t.astype(np.int8), s


def reduce_scales(d: np.ndarray, block: int) -> Optional[Tuple[np.ndarray, Optional[int]]]:
    """Per-block scales (rows, n_blocks) -> the coarsest ternary-format form, or None.

    Returns (scales, group_size): (1, 1) per tensor, (rows, 1) per row, or
    (rows, ceil(cols / g)) per group of g in TERNARY_GROUP_SIZES (g a multiple of `block`).
    """
    if (d == d.flat[0]).all():
        return d[:1, :1], None
    if (d == d[:, :1]).all():
        return d[:, :1], None
    for g in sorted(TERNARY_GROUP_SIZES, reverse=True):
        if g % block:
            continue
        reps = g // block
        n = ceil_div(d.shape[1], reps)
        padded = np.pad(d, ((0, 0), (0, n * reps - d.shape[1])), mode="edge")
        grouped = padded.reshape(d.shape[0], n, reps)
        if (grouped == grouped[:, :, :1]).all():
            return np.ascontiguousarray(grouped[:, :, 0]), g
    return None


# --------------------------------------------------------------------------- #
# Affine (stays quantized)
# --------------------------------------------------------------------------- #


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes (rows, cols) < 2**bits -> MLX's packing: a little-endian bit stream, uint32."""
    rows, cols = q.shape
    bitplanes = (q.astype(np.uint8)[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    packed = np.packbits(bitplanes.reshape(rows, cols * bits), axis=1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4")


def _k_scales(sc12: np.ndarray):
    """Q4_K/Q5_K: 12 bytes per block -> (scales, mins) 6-bit each, (..., 8)."""
    a, b, c = sc12[..., 0:4], sc12[..., 4:8], sc12[..., 8:12]
    scale = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scale, mins


def _nibbles(qs: np.ndarray, halves: int) -> np.ndarray:
    """(..., halves * 32 // 2 ... ) bytes -> codes: per 32-byte chunk, low then high nibbles."""
    chunks = qs.reshape(*qs.shape[:-1], halves, -1)
    return np.concatenate([chunks & 15, chunks >> 4], axis=-1).reshape(*qs.shape[:-1], -1)


def _finite16(scales: np.ndarray, biases: np.ndarray):
    """float16 when both are exact there, else float32."""
    s16, b16 = scales.astype(np.float16), biases.astype(np.float16)
    exact = np.array_equal(s16.astype(np.float32), scales) and np.array_equal(
        b16.astype(np.float32), biases
    )
    return (s16, b16) if exact else (scales, biases)


def affine(raw: np.ndarray, type_name: str, rows: int, cols: int) -> AffineTensor:
    """Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K bytes -> the same numbers as an MLX AffineTensor."""
    if type_name == "Q8_0":
        b = _blocks(raw, rows, cols, Q_BLOCK, 34)
        d = _f16(b[:, :, :2]).astype(np.float32)
        q = np.ascontiguousarray(b[:, :, 2:]).view(np.int8).astype(np.int16) + 128
        scales, biases, bits = d, -128 * d, 8
    elif type_name in ("Q4_0", "Q4_1"):
        size = 18 if type_name == "Q4_0" else 20
        b = _blocks(raw, rows, cols, Q_BLOCK, size)
        d = _f16(b[:, :, :2]).astype(np.float32)
        q = _nibbles(b[:, :, size - 16 :], 1)
        m = -8 * d if type_name == "Q4_0" else _f16(b[:, :, 2:4]).astype(np.float32)
        scales, biases, bits = d, m, 4
    elif type_name in ("Q4_K", "Q5_K"):
        size = 144 if type_name == "Q4_K" else 176
        b = _blocks(raw, rows, cols, TQ_BLOCK, size)
        d, dmin = _f16(b[:, :, 0:2]).astype(np.float32), _f16(b[:, :, 2:4]).astype(np.float32)
        sc, mn = _k_scales(b[:, :, 4:16])
        q = _nibbles(b[:, :, size - 128 :], 4)
        if type_name == "Q5_K":
            qh = b[:, :, 16:48]  # (rows, nb, 32)
            high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
            q = q | (high.reshape(q.shape) << 4)
        scales = d[..., None] * sc.astype(np.float32)  # exact in float32: 11 + 6 bits
        biases = -(dmin[..., None] * mn.astype(np.float32))
        bits = 4 if type_name == "Q4_K" else 5
        scales, biases = scales.reshape(rows, -1), biases.reshape(rows, -1)
    else:
        raise FormatError(f"GGUF {type_name} has no exact MLX affine form")
    scales, biases = _finite16(scales.reshape(rows, -1), biases.reshape(rows, -1))
    q = q.reshape(rows, cols).astype(np.uint8)
    return AffineTensor(
        mx.array(pack_codes(q, bits)), mx.array(scales), mx.array(biases), bits, Q_BLOCK
    )


def dequantize(raw: np.ndarray, qtype, shape: tuple) -> np.ndarray:
    """Any type gguf-py implements -> floats: float32 for the AFFINE_TYPES (exact there),
    float16 for the rest (the lossy fallback for Q6_K, Q2_K, Q3_K, IQ*, ...)."""
    from gguf import quants

    rows = shape[0] if len(shape) > 1 else 1
    w = quants.dequantize(np.ascontiguousarray(raw).reshape(rows, -1), qtype).reshape(shape)
    return w.astype(np.float32 if qtype.name in AFFINE_TYPES else np.float16)
