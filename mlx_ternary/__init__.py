"""mlx-ternary: ternary (1.58-bit) LLMs on MLX, with mlx-lm's models and tooling."""

from .checkpoint.convert import convert
from .checkpoint.load import load
from .errors import FormatError, TernaryError
from .runtime.layers import TernaryLinear

__version__ = "0.1.0"

__all__ = ["load", "convert", "TernaryLinear", "TernaryError", "FormatError", "__version__"]
