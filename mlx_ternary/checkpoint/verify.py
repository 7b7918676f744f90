"""verify(): check a converted checkpoint's manifest, shards and tensor shapes."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, NamedTuple

import mlx.nn as nn

from ..errors import TernaryError
from ..format import is_ternary_config
from .load import get_classes, load_model, read_config
from .readers.arch import Checker, build_model
from .readers.common import shard_files, tensor_shapes
from .writers.ternary import MANIFEST_FILE, MANIFEST_FORMAT, sha256_file


@dataclass
class VerifyReport:
    """Files hashed, tensors checked, and every problem found (empty: the checkpoint is whole)."""

    path: Path
    files: int = 0
    tensors: int = 0
    manifest: bool = False
    problems: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class _Shape(NamedTuple):
    shape: tuple


def _manifest_entry(name: str, meta) -> bool:
    """Whether a manifest entry names a file inside the checkpoint with size and sha256."""
    parts = Path(name).parts
    return (
        bool(parts)
        and not Path(name).is_absolute()
        and ".." not in parts
        and isinstance(meta, dict)
        and isinstance(meta.get("size"), int)
        and isinstance(meta.get("sha256"), str)
    )


def _check_manifest(path: Path, report: VerifyReport) -> None:
    mf = path / MANIFEST_FILE
    if not mf.exists():
        return
    try:
        manifest = json.loads(mf.read_text())
        files = manifest["files"] if manifest.get("format") == MANIFEST_FORMAT else None
    except (ValueError, KeyError, AttributeError):
        files = None
    if not isinstance(files, dict):
        report.problems.append(f"{mf}: not an mlx-ternary manifest; re-convert the model")
        return
    report.manifest = True
    for name, meta in files.items():
        f = path / name
        if not _manifest_entry(name, meta):
            report.problems.append(
                f"{mf}: entry {name!r} is not a file of the checkpoint with its size and "
                "sha256; re-convert the model"
            )
        elif not f.is_file():
            report.problems.append(f"{f}: listed in {MANIFEST_FILE} but missing")
        elif f.stat().st_size != meta["size"]:
            report.problems.append(
                f"{f}: {f.stat().st_size} bytes, the manifest says "
                f"{meta['size']}; re-download or re-convert it"
            )
        elif sha256_file(f) != meta["sha256"]:
            report.problems.append(
                f"{f}: sha256 differs from the manifest; the file is "
                "corrupt: re-download or re-convert it"
            )
        report.files += 1


def _stock_model(path: Path, config: dict, names) -> nn.Module:
    model_class, args_class = get_classes(config, path)
    model = build_model(model_class, args_class, config, path)
    q = config.get("quantization")
    if q:  # as mlx-lm's load does: a layer's own entry wins over the global one
        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", "affine"),
            class_predicate=lambda p, m: (
                hasattr(m, "to_quantized") and f"{p}.scales" in names and q.get(p, True)
            ),
        )
    return model


def verify(path) -> VerifyReport:
    """Check manifest (sizes, sha256), shard presence and size, tensor shapes vs config.

    Args:
        path: a checkpoint directory written by `convert` (ternary format or stock MLX).

    Returns:
        A VerifyReport; `report.ok` is True when nothing is wrong.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise TernaryError(f"{path}: no such checkpoint directory")
    report = VerifyReport(path)
    _check_manifest(path, report)
    try:
        files = shard_files(path)
        shapes = {k: _Shape(v[0]) for k, v in tensor_shapes(files).items()}
        report.tensors = len(shapes)
        config = read_config(path)
        if is_ternary_config(config):
            load_model(path, lazy=True)  # lazy: nothing is read beyond the headers
        else:
            model = _stock_model(path, config, shapes)
            if hasattr(model, "sanitize"):
                shapes = model.sanitize(shapes)
            check = Checker(model, {}, path)
            for name, arr in shapes.items():
                check.tensor(name, arr)
            check.finish(require_ternary=False)
    except TernaryError as e:
        report.problems.append(str(e))
    return report
