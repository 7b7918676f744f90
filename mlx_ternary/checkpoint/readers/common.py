"""Safetensors files of a checkpoint: find the shards, check them cheaply, load them."""

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ...errors import FormatError
from ..tensors import INDEX_FILE, SAFETENSORS_DTYPES

__all__ = ["INDEX_FILE", "SAFETENSORS_DTYPES"]  # re-exported for the readers


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file; checks the file holds all its data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise FormatError(
                f"{path}: truncated safetensors file ({size} bytes); re-download or re-convert it"
            )
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise FormatError(f"{path}: truncated safetensors header; re-download or re-convert it")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise FormatError(
                f"{path}: corrupt safetensors header; re-download or re-convert it"
            ) from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise FormatError(
            f"{path}: truncated safetensors file: its header needs {8 + n + end} bytes, "
            f"the file has {size}; re-download or re-convert it"
        )
    return header


def shard_files(model_path: Path) -> List[Path]:
    """The weight files of a checkpoint, all present and whole, or a FormatError."""
    index = model_path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError):
            raise FormatError(f"{index}: not a valid safetensors index (no weight_map)") from None
        files = [model_path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FormatError(
                f"{model_path}: shard(s) {', '.join(missing)} listed in {INDEX_FILE} are missing; "
                "re-download the model (all shards) or re-convert it"
            )
    else:
        files = sorted(model_path.glob("model*.safetensors"))
        if not files:
            raise FormatError(
                f"{model_path}: no model*.safetensors weight files; a model directory needs "
                "config.json and its safetensors shards"
            )
    for f in files:
        safetensors_header(f)
    return files


def tensor_shapes(files: List[Path]) -> Dict[str, tuple]:
    """{tensor name: (shape, file)} from the headers alone."""
    out = {}
    for f in files:
        for name, meta in safetensors_header(f).items():
            if name != "__metadata__":
                out[name] = (tuple(meta["shape"]), f)
    return out


# --------------------------------------------------------------------------- #
# Reading one tensor at a time (lazily: convert keeps peak memory near the largest tensor)
# --------------------------------------------------------------------------- #


def tensor_index(files: List[Path]) -> Dict[str, Tuple[Path, dict, int]]:
    """{tensor name: (file, header entry, data start)} from the headers alone."""
    out = {}
    for f in files:
        header = safetensors_header(f)
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (f, meta, 8 + n)
    return out


def tensor_layout(name: str, entry: Tuple[Path, dict, int]) -> Tuple[Any, Any, tuple, int]:
    """(numpy dtype of the raw bytes, MLX dtype, shape, offset of the data in the file) of
    one tensor of `tensor_index`; a dtype not read or a byte count off the shape is refused."""
    path, meta, start = entry
    if meta["dtype"] not in SAFETENSORS_DTYPES:
        raise FormatError(
            f"{path}: tensor {name} has dtype {meta['dtype']}, which mlx-ternary does not read"
        )
    np_dtype, mx_dtype = SAFETENSORS_DTYPES[meta["dtype"]]
    begin, end = meta["data_offsets"]
    shape = tuple(meta["shape"])
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if (end - begin) != count * np.dtype(np_dtype).itemsize:
        raise FormatError(
            f"{path}: tensor {name} has {end - begin} bytes for shape {shape} "
            f"{meta['dtype']}; the file is corrupt: re-download or re-convert it"
        )
    return np_dtype, mx_dtype, shape, start + begin


def read_tensor(name: str, entry: Tuple[Path, dict, int]) -> mx.array:
    """One tensor of its file, lazily: nothing is read until it is evaluated."""
    tensor_layout(name, entry)
    path = entry[0]
    try:  # mx.load maps the header only; each array reads its own bytes when evaluated
        return mx.load(str(path))[name]
    except (RuntimeError, ValueError) as e:
        raise FormatError(
            f"{path}: cannot be read as safetensors ({e}); re-download or re-convert it"
        ) from None


@dataclass
class Source:
    """A checkpoint as a stream of tensors named as the mlx-lm model's parameters.

    `items()` yields, one at a time:
        (module path, PackedTernary)   a ternary layer;
        (module path, AffineTensor)    a layer that stays MLX affine-quantized;
        (parameter name, mx.array)     everything else, as stored.
    `count` is how many items it yields (for progress). `config` is the architecture
    config (no foreign quantization blocks). `model` is the skeleton (mlx-lm's class,
    parameters lazy) and `targets` {path: (in, out, has_bias)} its layers that may be
    ternary; readers that leave them None get them built from `config`.
    """

    path: Path
    kind: str
    config: dict
    count: int
    items: Callable[[], Iterator[Tuple[str, Any]]]
    activation_bits: Optional[int] = None
    activations: str = "model"  # format.ACTIVATION_MODES: what ternary layers run with
    group_size: Optional[int] = None
    tokenizer_dir: Optional[Path] = None
    tokenizer_files: Dict[str, str] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    model: Any = None
    targets: Optional[Dict[str, tuple]] = None


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def sanitized_index(files: List[Path], sanitize=None):
    """(index, {sanitized name: raw name}) from the headers alone.

    `sanitize` sees lazy placeholders of the right shapes: nothing is read or computed.
    """
    index = tensor_index(files)
    renamed = {}
    for raw, (_, meta, _) in index.items():
        names = sanitize({raw: mx.zeros(tuple(meta["shape"]))}) if sanitize else {raw: None}
        for new in names:
            renamed[new] = raw
    return index, renamed


def read_sanitized(name: str, index: dict, renamed: Dict[str, str], sanitize=None) -> mx.array:
    """Read the tensor that sanitizes to `name`."""
    raw = renamed[name]
    arr = read_tensor(raw, index[raw])
    return sanitize({raw: arr})[name] if sanitize else arr
