"""Safetensors files of a checkpoint: find the shards, check them cheaply, load them."""

import json
import struct
from pathlib import Path
from typing import Dict, List

import mlx.core as mx

from ..errors import FormatError

INDEX_FILE = "model.safetensors.index.json"


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file; checks the file holds all its data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise FormatError(f"{path}: truncated safetensors file ({size} bytes); "
                              "re-download or re-convert it")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise FormatError(f"{path}: truncated safetensors header; re-download or re-convert it")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise FormatError(f"{path}: corrupt safetensors header; re-download or re-convert it") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
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


def load_tensors(files: List[Path]) -> Dict[str, mx.array]:
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            raise FormatError(f"{f}: cannot be read as safetensors ({e}); re-download or re-convert it") from None
    return weights
