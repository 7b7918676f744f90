"""Reader for unpacked ternary checkpoints (SpectraSuite TriLM `*_Unpacked` style).

The linear weights are stored as floats already equal to t * s, t in {-1, 0, +1},
with a few distinct scales per tensor (blocks of rows, or blocks along the input).
The scales are read off exactly; a weight that is not ternary-valued is refused by
name, never re-quantized.
"""

from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import FormatError
from ..format import GROUP_SIZES, PackedTernary
from .common import Source, count_sanitized, iter_sanitized, shard_files

FLOAT_SKIP = ("lm_head",)


def _runs(values: np.ndarray) -> int:
    return int(1 + np.count_nonzero(values[1:] != values[:-1])) if values.size else 0


def read_scales(w: np.ndarray, group_size: int, name: str) -> Tuple[np.ndarray, np.ndarray,
                                                                       Optional[int], str]:
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
        return t, filled.reshape(n, 1), None, (f"{len(np.unique(used))} scales in "
                                               f"{_runs(filled)} row block(s)")
    if group_size in GROUP_SIZES:
        g = -(-k // group_size)
        pad = np.zeros((n, g * group_size), np.float32)
        pad[:, :k] = a
        blocks = pad.reshape(n, g, group_size)
        gmax = blocks.max(axis=2)
        if ((blocks == 0) | (blocks == gmax[:, :, None])).all():
            used = np.unique(gmax[gmax > 0])
            return t, gmax, group_size, (f"{len(used)} scales in groups of {group_size} "
                                         "columns")
    r = int(np.argmax(((a != 0) & (a != row[:, None])).any(axis=1)))
    vals = np.unique(w[r])[:6]
    raise FormatError(
        f"{name}: not ternary-valued: row {r} holds {len(np.unique(a[r][a[r] > 0]))} distinct "
        f"magnitudes (e.g. {', '.join(f'{v:.6g}' for v in vals)}), not one scale per "
        f"tensor, row or group of {group_size} columns; convert only takes weights that "
        "already are t*s (it never re-quantizes a float model)"
    )


def iter_native(model_path: Path, linears: Dict[str, tuple], packing: str, group_size: int,
                sanitize=None, skip=FLOAT_SKIP) -> Iterator[Tuple[str, object]]:
    for name, arr in iter_sanitized(shard_files(model_path), sanitize):
        path = name.rpartition(".")[0]
        if (not name.endswith(".weight") or path not in linears
                or path.split(".")[-1] in skip):
            yield name, arr
            continue
        k, n, _ = linears[path]
        label = f"{model_path.name}: {name}"
        if tuple(arr.shape) != (n, k):
            raise FormatError(f"{label}: shape {tuple(arr.shape)}, the config expects ({n}, {k})")
        t, s, gs, desc = read_scales(np.array(arr.astype(mx.float32)), group_size, label)
        pt = PackedTernary.from_trits(t, s, packing, gs, name=label)
        pt.note = desc
        yield path, pt


def source(model_path: Path, config: dict, linears: Dict[str, tuple], packing: str,
           group_size: int = 128, sanitize=None) -> Source:
    """A convert Source for a float checkpoint whose linear weights are t * s."""
    files = shard_files(model_path)
    return Source(
        path=model_path, kind="unpacked ternary floats (TriLM style)", config=dict(config),
        count=count_sanitized(files, sanitize),
        items=lambda: iter_native(model_path, linears, packing, group_size, sanitize),
        group_size=group_size, tokenizer_dir=model_path,
    )
