"""Reader for unpacked ternary checkpoints (SpectraSuite TriLM `*_Unpacked` style).

The linear weights are stored as floats already equal to t * s, t in {-1, 0, +1},
with a few distinct scales per tensor (blocks of rows, or blocks along the input).
The scales are read off exactly; a weight that is not ternary-valued is refused by
name, never re-quantized, unless the config marks a BitNet-trained model
(`is_bitnet_config`, as onebitllms writes it): then it is a latent weight, ternarized
with absmean as onebitllms' BitNetLinear does.
"""

from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ...errors import FormatError
from ...format import PackedTernary
from ...ternarize import read_scales, ternarize_absmean
from . import arch
from .common import Source

FLOAT_SKIP = ("lm_head",)


def detect(path: Path) -> bool:
    """Any other checkpoint directory: its linear weights must be t * s floats."""
    return path.is_dir() and (path / "config.json").is_file()


def activation_bits(config: dict) -> Optional[int]:
    """8 for configs that mark a BitNet-trained model (onebitllms' `is_bitnet_config`,
    1bitLLM's `input_bits`): such floats are dequantized BitNet weights (Falcon-E's
    bfloat16 revision) and the model ran with int8 activations. Else None."""
    if config.get("is_bitnet_config") or config.get("input_bits") == 8:
        return 8
    return None


def source(path: Path, packing: str = "compact", group_size: int = 128) -> Source:
    """A Source for a float checkpoint whose linear weights are t * s.

    Args:
        group_size: the column group scales are read at when one per row does not fit.
    """
    config = arch.read_config(path)
    model = arch.skeleton(config, path)
    targets = {
        p: d
        for p, d in arch.ternary_targets(model, config).items()
        if p.split(".")[-1] not in FLOAT_SKIP
    }

    def linear(p, w, read):
        k, n, _ = targets[p]
        label = f"{path.name}: {p}.weight"
        if tuple(w.shape) != (n, k):
            raise FormatError(f"{label}: shape {tuple(w.shape)}, the config expects ({n}, {k})")
        if not mx.issubdtype(w.dtype, mx.floating):
            raise FormatError(f"{label}: dtype {w.dtype}; expected float weights equal to t*s")
        w32 = np.array(w.astype(mx.float32))
        try:
            t, s, gs, desc = read_scales(w32, group_size, label)
        except FormatError:
            if not config.get("is_bitnet_config"):
                raise
            # onebitllms' "prequantized" latent weights: its BitNetLinear ternarizes them
            # with absmean per tensor in every forward.
            (t, s), gs, desc = ternarize_absmean(w32), None, "latent: absmean per tensor"
        pt = PackedTernary.from_trits(t, s, packing, gs, name=label)
        pt.note = desc
        return pt

    count, items = arch.stream(
        path,
        model,
        targets,
        arch.quant_block(config),
        linear=linear,
        sanitize=getattr(model, "sanitize", None),
    )
    return Source(
        path=path,
        kind="unpacked ternary floats (TriLM style)",
        config=arch.architecture(config),
        count=count,
        items=items,
        activation_bits=activation_bits(config),
        group_size=group_size,
        tokenizer_dir=path,
        model=model,
        targets=targets,
    )
