"""Writer for the ternary format (mlx-ternary's own): config.json + safetensors shards + index."""

import hashlib
import json
import shutil
import struct
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ...format import QuantizationConfig
from ...runtime.layers import model_quantization, ternary_layers
from ..tensors import INDEX_FILE, SAFETENSORS_NAMES, SAFETENSORS_NUMPY_NAMES, shard_name

MAX_SHARD_BYTES = 5 << 30
FOREIGN_QUANT_KEYS = ("quantization", "quantization_config")


def write_shards(
    out_dir: Path, tensors: Iterable[Tuple[str, mx.array]], max_shard_bytes: int = MAX_SHARD_BYTES
) -> Dict[str, str]:
    """Stream tensors into model-0000i-of-0000n.safetensors shards; returns the weight map."""
    writer = ShardWriter(out_dir, max_shard_bytes)
    for name, arr in tensors:
        writer.add(name, arr)
    return writer.close()


def ternary_config(config: dict, quant: QuantizationConfig) -> dict:
    out = {k: v for k, v in config.items() if k not in FOREIGN_QUANT_KEYS}
    out["quantization"] = quant.to_dict()
    return out


def save_model(
    model: nn.Module, config: dict, out_dir, tokenizer=None, packing: Optional[str] = None
) -> Path:
    """Save a model with TernaryLinear layers in the ternary format.

    Args:
        model: an mlx-lm model whose ternary layers are TernaryLinear.
        config: its config dict (foreign quantization sections are dropped).
        out_dir: the directory to write (created).
        tokenizer: a TokenizerWrapper or HF tokenizer to save beside the weights.
        packing: repack every ternary layer to this packing first.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if packing:
        for _, layer in ternary_layers(model):
            layer.repack(packing)
    quant = model_quantization(model)
    write_shards(out_dir, tree_flatten(model.parameters()))
    (out_dir / "config.json").write_text(json.dumps(ternary_config(config, quant), indent=2))
    if tokenizer is not None:
        getattr(tokenizer, "_tokenizer", tokenizer).save_pretrained(str(out_dir))
    return out_dir


# --------------------------------------------------------------------------- #
# Streaming shards and the sha256 manifest (used by convert)
# --------------------------------------------------------------------------- #

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "mlx-ternary-manifest"
_COPY_CHUNK = 64 << 20


def _dtype_name(name: str, arr) -> str:
    """The safetensors dtype of an MLX or numpy array, or a ValueError naming the tensor."""
    names = SAFETENSORS_NUMPY_NAMES if isinstance(arr, np.ndarray) else SAFETENSORS_NAMES
    if arr.dtype not in names:
        raise ValueError(f"{name}: dtype {arr.dtype} cannot be written to safetensors")
    return names[arr.dtype]


def _tensor_bytes(arr) -> memoryview:
    """The array's bytes in C order, without a copy where it already is (an evaluated MLX
    array's buffer is read in place)."""
    if isinstance(arr, mx.array) and arr.dtype == mx.bfloat16:  # numpy has no bfloat16
        arr = arr.view(mx.uint16)
    return memoryview(np.ascontiguousarray(np.asarray(arr)).reshape(-1)).cast("B")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_COPY_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


class ShardWriter:
    """Write tensors one at a time into safetensors shards of at most `max_shard_bytes`.

    Each shard's data goes to a scratch file as it arrives; closing a shard writes the
    header and copies the data behind it, so memory holds one tensor, never a shard.
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.shards: List[Tuple[Path, dict]] = []  # (data scratch file, header)
        self._open = None  # (scratch path, file object, header, size)
        self.total = 0

    def _new_shard(self):
        path = self.out_dir / f".shard-{len(self.shards) + 1}.data"
        self._open = (path, open(path, "wb"), {}, 0)

    def _close_shard(self):
        path, fh, header, _ = self._open
        fh.close()
        self.shards.append((path, header))
        self._open = None

    def add(self, name: str, arr) -> None:
        """Append one tensor, an MLX or numpy array (any dtype safetensors knows)."""
        dtype = _dtype_name(name, arr)
        data = _tensor_bytes(arr)
        if self._open is None:
            self._new_shard()
        elif self._open[3] and self._open[3] + len(data) > self.max_shard_bytes:
            self._close_shard()
            self._new_shard()
        path, fh, header, size = self._open
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [size, size + len(data)],
        }
        fh.write(data)
        self._open = (path, fh, header, size + len(data))
        self.total += len(data)

    def close(self) -> Dict[str, str]:
        """Finish every shard and the index; returns the weight map {tensor: file}."""
        if self._open is not None:
            self._close_shard()
        n = len(self.shards)
        weight_map = {}
        for i, (data_path, header) in enumerate(self.shards):
            fname = shard_name(i, n)
            raw = json.dumps(
                {"__metadata__": {"format": "mlx"}, **header}, separators=(",", ":")
            ).encode()
            raw += b" " * (-(8 + len(raw)) % 8)  # the spec allows space padding; align data
            with open(self.out_dir / fname, "wb") as out, open(data_path, "rb") as src:
                out.write(struct.pack("<Q", len(raw)))
                out.write(raw)
                shutil.copyfileobj(src, out, _COPY_CHUNK)
            data_path.unlink()
            weight_map.update({k: fname for k in header})
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return weight_map


def write_manifest(out_dir: Path) -> dict:
    """Record size and sha256 of every file in `out_dir` in manifest.json."""
    out_dir = Path(out_dir)
    files = {}
    for p in sorted(out_dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST_FILE:
            rel = p.relative_to(out_dir).as_posix()
            files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "files": files}
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return manifest
