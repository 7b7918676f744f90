"""Reader for MLX affine packs (mlx-lm `quantization` block) whose linear weights are ternary.

A stock MLX affine layer stores codes q packed into uint32 (lowest bits first) and, per
group of g input columns, w = scale * q + bias. A layer is ternary exactly when every
code is 0, 1 or 2 and bias == -scale in every group: then t = q - 1 and s = scale, at
any bit width. At 2 bits the codes already are the ternary format's "fast" layout.

Ternary linear layers become PackedTernary; every other quantized layer (the embedding,
a non-ternary lm_head) stays an MLX affine layer, never dequantized: a Ternary-Bonsai
pack's 2-bit embedding and lm_head keep their packed bytes.

Bonsai-2 ships mlx-lm `prism_hadamard_qwen35` packs: the same codes with a signed
blockwise Walsh-Hadamard rotation folded into the input axis. Those keep their rotation
(HadamardTernaryLinear); the rotated embedding and sign vectors stay as stored.
"""

from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

from ...errors import FormatError
from ...format import TERNARY_GROUP_SIZES, AffineTensor, PackedTernary, is_ternary_config, to_numpy
from . import arch
from .common import Source


def detect(path: Path) -> bool:
    """An mlx-lm quantized checkpoint (a `quantization` block with bits), not native."""
    if not path.is_dir():
        return False
    config = arch.read_config(path)
    return not is_ternary_config(config) and "bits" in arch.quant_block(config)


def _reduce_scales(s: np.ndarray, g: int, name: str) -> Tuple[np.ndarray, Optional[int]]:
    """The coarsest exact ternary-format scales for per-group scales s (N, K/g)."""
    if (s == s[:1, :1]).all():
        return s[:1, :1], None
    if (s == s[:, :1]).all():
        return s[:, :1], None
    if g not in TERNARY_GROUP_SIZES:
        raise FormatError(
            f"{name}: its scales change every {g} columns, and the ternary "
            f"format's groups are {TERNARY_GROUP_SIZES}; this pack cannot be "
            "repacked losslessly"
        )
    return s, g


def ternary_layer(path: str, at: AffineTensor, packing: str, where: str) -> Optional[PackedTernary]:
    """The PackedTernary an affine layer holds exactly, or None if it is not ternary."""
    if not arch.is_exact_ternary(at):
        return None
    label = f"{where}: {path}"
    s, gs = _reduce_scales(to_numpy(at.scales), at.group_size, label)
    n, k = at.shape
    if packing == "fast" and at.bits == 2:  # the codes already are the fast layout
        return PackedTernary("fast", at.weight, s, n, k, gs)
    return PackedTernary.from_trit_rows(
        lambda r: arch.affine_trits(at, r), n, k, s, packing, gs, name=label
    )


def _hadamard_sanitize(model):
    """Per-tensor sanitize for prism packs: qwen3_5's renaming."""
    from mlx_lm.models import qwen3_5

    return lambda weights: qwen3_5.Model.sanitize(model, weights)


def _signs_checked(items, where: str):
    for name, item in items():
        if name.endswith(".signs") and mx.any((item != 1) & (item != -1)).item():
            raise FormatError(f"{where}: {name}: Hadamard signs must be -1 or +1")
        yield name, item


def source(path: Path, packing: str = "compact") -> Source:
    """A Source for an MLX affine pack (plain or Hadamard-rotated)."""
    config = arch.read_config(path)
    model = arch.skeleton(config, path)
    targets = arch.ternary_targets(model, config)
    hadamard = arch.is_hadamard(config)
    _, embeddings = arch.hadamard_paths(config)

    def affine(p, at):
        pt = ternary_layer(p, at, packing, path.name)
        if pt is None and hadamard:
            raise FormatError(
                f"{path.name}: {p}: the pack's weights are not exactly ternary "
                "(a code above 2 or a bias that is not -scale); it cannot "
                "become a ternary model"
            )
        return pt

    def linear(p, w, read):  # a float linear layer beside the pack: ternary if exactly t*s
        from ...ternarize import read_scales

        if not mx.issubdtype(w.dtype, mx.floating) or tuple(w.shape) != targets[p][1::-1]:
            return None
        try:
            t, s, gs, _ = read_scales(np.array(w.astype(mx.float32)), 128, p)
        except FormatError:
            return None
        return PackedTernary.from_trits(t, s, packing, gs, name=f"{path.name}: {p}")

    count, items = arch.stream(
        path,
        model,
        targets,
        arch.quant_block(config),
        linear=linear,
        affine=affine,
        raw=embeddings,
        sanitize=_hadamard_sanitize(model) if hadamard else getattr(model, "sanitize", None),
    )
    kind = (
        "MLX prism_hadamard_qwen35 ternary pack (rotation kept)"
        if hadamard
        else "MLX affine ternary pack"
    )
    g = arch.quant_block(config).get("group_size", 64)
    return Source(
        path=path,
        kind=kind,
        config=arch.architecture(config),
        count=count,
        items=lambda: _signs_checked(items, path.name),
        group_size=g if g in TERNARY_GROUP_SIZES else None,
        tokenizer_dir=path,
        model=model,
        targets=targets,
    )
