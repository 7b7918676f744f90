"""mlx-ternary: ternary (1.58-bit) LLMs on MLX, with mlx-lm's models and tooling."""

import importlib.abc
import importlib.util
import sys

from .checkpoint.convert import convert
from .checkpoint.load import load
from .errors import FormatError, TernaryError
from .runtime.layers import TernaryLinear

__version__ = "0.1.0"

__all__ = ["load", "convert", "TernaryLinear", "TernaryError", "FormatError", "__version__"]

# Import paths of earlier releases keep working: `import mlx_ternary.nn` gets the module that
# now holds what it held, imported only when asked for.
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


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `mlx_ternary.<old name>` and hands back the module at its new place."""

    @staticmethod
    def new_name(fullname: str):
        head, _, rest = fullname.partition(f"{__name__}.")[2].partition(".")
        if head not in MOVED or not fullname.startswith(f"{__name__}."):
            return None
        return f"{__name__}.{MOVED[head]}" + (f".{rest}" if rest else "")

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if self.new_name(fullname) else None

    def create_module(self, spec):
        return importlib.import_module(self.new_name(spec.name))

    def exec_module(self, module):
        pass  # already imported at its new place


sys.meta_path.insert(0, _MovedFinder())  # before the path finder, which would load a copy
