"""mlx-ternary: ternary (1.58-bit) LLMs on MLX, with mlx-lm's models and tooling."""

import importlib
import sys

from .checkpoint.convert import convert
from .checkpoint.load import load
from .errors import FormatError, TernaryError
from .runtime.layers import TernaryLinear

__version__ = "0.1.0"

__all__ = ["load", "convert", "TernaryLinear", "TernaryError", "FormatError", "__version__"]

# Import paths of earlier releases, kept working: `import mlx_ternary.nn` gets the module
# that now holds what it held.
MOVED = {
    "nn": "runtime.layers",
    "kernels": "runtime.dispatch",
    "reference": "runtime.reference",
    "lora": "runtime.lora",
    "adapters": "runtime.adapters",
    "native": "runtime.cpu",
    "readers": "checkpoint.readers",
    "writers": "checkpoint.writers",
    "plan": "memory",
    "distributed": "parallel",
}
for _old, _new in MOVED.items():
    sys.modules[f"{__name__}.{_old}"] = importlib.import_module(f".{_new}", __name__)
del _old, _new
