"""mlx-ternary: ternary (1.58-bit) LLMs on MLX, with mlx-lm's models and tooling."""

from .errors import FormatError, TernaryError
from .load import load
from .convert import convert
from .nn import TernaryLinear

__version__ = "0.1.0"

__all__ = ["load", "TernaryLinear", "TernaryError", "FormatError", "__version__"]
