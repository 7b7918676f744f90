"""Float weights to trits and scales: BitNet's absmean rule, and the exact read-off of
weights that are already t * s (TriLM-style checkpoints, latent copies of packed ones)."""

from typing import Optional, Tuple

import numpy as np

from .errors import FormatError
from .format import TERNARY_GROUP_SIZES, ceil_div, expand_scales


def ternarize_absmean(w: np.ndarray, eps: float = 1e-5):
    """BitNet b1.58 absmean: s = mean|W| (per tensor), t = clamp(round(W / s), -1, 1).

    Returns (t int8 (N, K), s float32 (1, 1)).
    """
    w = np.asarray(w, dtype=np.float32)
    s = max(float(np.abs(w).mean()), eps)
    t = np.clip(np.rint(w / s), -1, 1).astype(np.int8)
    return t, np.array([[s]], dtype=np.float32)


def ternarize(
    w: np.ndarray, scale: str = "tensor", group_size: Optional[int] = None, eps: float = 1e-5
):
    """Absmean ternarization at any scale granularity.

    Returns (t int8 (N, K), scales float32 of the granularity's shape).
    """
    if scale == "tensor":
        return ternarize_absmean(w, eps)
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if scale == "row":
        s = np.maximum(np.abs(w).mean(axis=1, keepdims=True), eps)
    else:
        g = ceil_div(k, group_size)
        padded = np.zeros((n, g * group_size), np.float32)
        padded[:, :k] = np.abs(w)
        counts = np.minimum(group_size, k - group_size * np.arange(g))
        s = np.maximum(padded.reshape(n, g, group_size).sum(-1) / counts, eps)
    t = np.clip(np.rint(w / expand_scales(s, k, group_size)), -1, 1).astype(np.int8)
    return t, s.astype(np.float32)


def _runs(values: np.ndarray) -> int:
    return int(1 + np.count_nonzero(values[1:] != values[:-1])) if values.size else 0


def read_scales(
    w: np.ndarray, group_size: int, name: str
) -> Tuple[np.ndarray, np.ndarray, Optional[int], str]:
    """Exact (trits, scales, group_size or None, description) of a t*s float weight.

    Tries one scale per tensor, then per row, then per `group_size` columns of a row.

    Raises:
        FormatError: the weight is not ternary-valued at any of those granularities.
    """
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    a = np.abs(w)
    t = np.sign(w).astype(np.int8)
    row = a.max(axis=1)
    if ((a == 0) | (a == row[:, None])).all():
        used = row[row > 0]
        if used.size == 0 or (used == used[0]).all():
            s = used[:1] if used.size else np.ones(1, np.float32)
            return t, s.reshape(1, 1), None, "1 scale"
        filled = np.where(row > 0, row, np.maximum.accumulate(row))  # zero rows: any scale
        return (
            t,
            filled.reshape(n, 1),
            None,
            (f"{len(np.unique(used))} scales in {_runs(filled)} row block(s)"),
        )
    if group_size in TERNARY_GROUP_SIZES:
        g = ceil_div(k, group_size)
        pad = np.zeros((n, g * group_size), np.float32)
        pad[:, :k] = a
        blocks = pad.reshape(n, g, group_size)
        gmax = blocks.max(axis=2)
        if ((blocks == 0) | (blocks == gmax[:, :, None])).all():
            used = np.unique(gmax[gmax > 0])
            return t, gmax, group_size, (f"{len(used)} scales in groups of {group_size} columns")
    r = int(np.argmax(((a != 0) & (a != row[:, None])).any(axis=1)))
    vals = np.unique(w[r])[:6]
    raise FormatError(
        f"{name}: not ternary-valued: row {r} holds {len(np.unique(a[r][a[r] > 0]))} distinct "
        f"magnitudes (e.g. {', '.join(f'{v:.6g}' for v in vals)}), not one scale per "
        f"tensor, row or group of {group_size} columns; convert only takes weights that "
        "already are t*s (it never re-quantizes a float model)"
    )
