"""Readers translate foreign checkpoint layouts into the ternary format's terms.

Each reader module exposes `detect(path) -> bool` and `source(path, packing) -> Source`
(readers/common.py): one stream of (name, item) that load() and convert() both consume.
`READERS` is the one detection order; the first reader whose `detect` says yes reads it.
"""

from pathlib import Path

from ...errors import TernaryError
from . import gguf, hf_bitnet, mlx_affine, ternary, trilm
from .arch import read_config, skeleton, ternary_targets
from .common import Source

# First match wins. Ternary-format and BitNet configs also carry quantization blocks, so they
# come before the MLX affine packs; trilm takes any other checkpoint directory.
READERS = (ternary, hf_bitnet, mlx_affine, gguf, trilm)


def open_source(path: Path, packing: str = "compact", group_size: int = 128) -> Source:
    """The Source of a local checkpoint directory or single file.

    Args:
        packing: what foreign ternary layers are packed into (ternary-format ones keep theirs).
        group_size: the column group TriLM-style float weights are read at when one
            scale per row does not fit.

    Raises:
        TernaryError: no reader recognises the path, or (FormatError) the reader refuses it.
    """
    path = Path(path)
    if path.is_dir():
        read_config(path)  # a clear error for a directory without a usable config.json
    for reader in READERS:
        if reader.detect(path):
            return with_model(
                trilm.source(path, packing, group_size)
                if reader is trilm
                else reader.source(path, packing)
            )
    raise TernaryError(
        f"{path}: not a checkpoint mlx-ternary reads (a model directory with "
        "config.json and safetensors shards, or a .gguf file)"
    )


def with_model(source: Source) -> Source:
    """Fill in the skeleton and its ternary targets for readers that leave them out."""
    if source.model is None:
        source.model = skeleton(source.config, source.path)
    if source.targets is None:
        source.targets = ternary_targets(source.model, source.config)
    return source
