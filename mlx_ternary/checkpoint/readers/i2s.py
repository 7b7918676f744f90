"""bitnet.cpp's I2_S ternary tensors (GGUF type id 36), as microsoft/BitNet writes them.

Layout (bitnet.cpp `quantize_i2_s`, x86 build, the one its published BitNet b1.58 2B4T
GGUF was made with): the matrix is flattened row-major (ne0 = columns fastest) and cut
into blocks of 128 weights, 32 bytes each. Weight j of a block sits in byte j % 32 at
bit shift 6 - 2 * (j // 32); the 2-bit code is 0 for -1, 1 for 0, 2 for +1. After the
n / 4 code bytes comes one float32: the tensor's scale s (its max |w|), then padding to
n / 4 + 32 bytes. w = s * t exactly.

Builds for ARM (128 -> 64-weight blocks of 16 bytes) lay the same codes out
differently, and nothing in the file says which build wrote it; this reads the x86
layout.
"""

import numpy as np

from ...errors import FormatError

BLOCK = 128  # weights per 32-byte block
_SHIFTS = np.array([6, 4, 2, 0], dtype=np.uint8)


def decode(raw: np.ndarray, rows: int, cols: int, name: str):
    """I2_S bytes -> (trits (rows, cols) int8, scale (1, 1) float32)."""
    n = rows * cols
    if n % BLOCK:
        raise FormatError(
            f"{name}: I2_S holds whole blocks of {BLOCK} weights; a ({rows}, "
            f"{cols}) tensor is not {BLOCK}-divisible"
        )
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.size < n // 4 + 4:
        raise FormatError(f"{name}: I2_S data is {raw.size} bytes, needs {n // 4 + 4}")
    codes = raw[: n // 4].reshape(-1, 1, 32) >> _SHIFTS[:, None]  # (blocks, 4 groups, 32)
    codes = (codes & 3).reshape(rows, cols)
    if (codes == 3).any():
        raise FormatError(
            f"{name}: I2_S code 3 is not a trit; the file is corrupt or not "
            "bitnet.cpp's I2_S layout"
        )
    scale = np.ascontiguousarray(raw[n // 4 : n // 4 + 4]).view("<f4").reshape(1, 1)
    if not np.isfinite(scale).all():
        raise FormatError(f"{name}: I2_S scale is {float(scale[0, 0])}; the file is corrupt")
    return codes.astype(np.int8) - 1, scale.astype(np.float32)
