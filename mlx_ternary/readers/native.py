"""Reader for the native mlx-ternary format (docs/FORMAT.md)."""

from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx

from ..format import QuantizationConfig, is_native_config
from .common import load_tensors, shard_files


def detect(config: dict) -> bool:
    return is_native_config(config)


def read(model_path: Path, config: dict) -> Tuple[Dict[str, mx.array], QuantizationConfig]:
    """Tensors named as the model's parameters (`<module>.packed`, `.scales`, floats)."""
    quant = QuantizationConfig.from_dict(config["quantization"], model_path / "config.json")
    return load_tensors(shard_files(model_path)), quant
