"""Float tables -> llama.cpp Q8_0 / Q4_K / Q5_K / Q6_K blocks (numpy), for GGUF files whose
embedding and output layer are quantized as `llama-quantize` leaves them in ternary models.

The layouts are docs/FORMAT.md's ("ggml tables"); the choice of scales here is the plain
one (absmax per sub-block, then one float16 super-scale per block), not llama.cpp's search
for the least squared error: any valid blocks decode the same way everywhere, which is all
the benchmarks and tests need.
"""

import numpy as np

from ...errors import FormatError
from ...format import GGML_TABLES


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(*v.shape, 2)


def _q8_0(w: np.ndarray) -> np.ndarray:
    b = w.reshape(-1, 32)
    d = (np.abs(b).max(axis=1) / 127).astype(np.float16)
    df = d.astype(np.float32)
    q = np.rint(np.divide(b, df[:, None], out=np.zeros_like(b), where=df[:, None] != 0))
    q = np.clip(q, -127, 127).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), q], axis=1)


def _super(scale: np.ndarray, top: int):
    """Sub-block scales (n, nsub) >= 0 -> (float16 d (n,), integer codes (n, nsub) <= top)."""
    d = (scale.max(axis=1) / top).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    code = np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df != 0))
    return d, np.clip(code, 0, top).astype(np.int32)


def _k4_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins (n, 8) -> the 12 bytes of Q4_K / Q5_K."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _k_asym(w: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) / Q5_K (bits 5): w = d sc q - dmin m per 32 columns."""
    top = (1 << bits) - 1
    b = w.reshape(-1, 8, 32)
    lo = np.minimum(b.min(axis=2), 0)
    d, sc = _super((b.max(axis=2) - lo) / top, 63)
    dmin, mn = _super(-lo, 63)
    step = (d.astype(np.float32)[:, None] * sc)[:, :, None]
    off = (dmin.astype(np.float32)[:, None] * mn)[:, :, None]
    q = np.rint(np.divide(b + off, step, out=np.zeros_like(b), where=step != 0))
    q = np.clip(q, 0, top).astype(np.uint8).reshape(-1, 256)
    chunks = q.reshape(-1, 4, 2, 32)  # per 64 columns: low nibbles, then high
    qs = ((chunks[:, :, 0] & 15) | ((chunks[:, :, 1] & 15) << 4)).reshape(-1, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _k4_scale_bytes(sc, mn)]
    if bits == 5:  # bit s of qh[l]: bit 4 of column 32 s + l
        high = (q.reshape(-1, 8, 32) >> 4) & 1
        parts.append((high << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1).astype(np.uint8))
    return np.concatenate(parts + [qs], axis=1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """w = d sc (q - 32) per 16 columns, sc int8."""
    b = w.reshape(-1, 16, 16)
    d, sc = _super(np.abs(b).max(axis=2) / 31, 127)
    step = (d.astype(np.float32)[:, None] * sc)[:, :, None]
    q = np.rint(np.divide(b, step, out=np.zeros_like(b), where=step != 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # (half, part, l)
    ql = np.concatenate(
        [
            (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
            (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4),
        ],
        axis=2,
    ).reshape(-1, 128)
    qh = (q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qh = qh.sum(axis=2).astype(np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


ENCODERS = {
    "Q8_0": _q8_0,
    "Q4_K": lambda w: _k_asym(w, 4),
    "Q5_K": lambda w: _k_asym(w, 5),
    "Q6_K": _q6_k,
}


def encode(w: np.ndarray, type_name: str) -> np.ndarray:
    """A float (N, K) table -> (N, row_bytes) uint8 blocks of `type_name` (GGUF's layout)."""
    if type_name not in ENCODERS:
        raise FormatError(f"no encoder for {type_name!r}; encodes {', '.join(ENCODERS)}")
    t = GGML_TABLES[type_name]
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % t.block:
        raise FormatError(f"{type_name} needs rows of whole {t.block}-column blocks, not {k}")
    return ENCODERS[type_name](w).reshape(n, k // t.block * t.bytes)
