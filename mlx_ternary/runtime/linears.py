"""Which leaves of an mlx-lm model are linear layers ternary weights can stand in for.

Imports nothing of the package: readers (to check a checkpoint against its model) and the
runtime (to swap layers in) share these rules.
"""

from typing import Dict, List, Optional

import mlx.nn as nn
from mlx.utils import tree_flatten

# MLX quantizes whole groups of K (32 at the least): mlx-lm never quantizes a narrower layer.
MIN_QUANT_GROUP = 32


def split_indices(module: nn.Module) -> Optional[List[int]]:
    # afm7's FusedLinear: an nn.Linear subclass whose output is split at `indices`.
    indices = getattr(module, "indices", None) if isinstance(module, nn.Linear) else None
    return list(indices) if isinstance(indices, (list, tuple)) else None


def linear_dims(module: nn.Module):
    """(in, out, has_bias) of a Linear-like layer ternary weights can stand in for, else None.

    nn.Linear, afm7's split-output FusedLinear and mlx-lm's BitLinear. Other nn.Linear
    subclasses change what the layer computes in ways a TernaryLinear cannot know: None.
    """
    if type(module) is nn.Linear or split_indices(module) is not None:
        out_f, in_f = module.weight.shape
        return in_f, out_f, "bias" in module
    if type(module).__name__ == "BitLinear" and hasattr(module, "in_features"):
        return module.in_features, module.out_features, module.get("bias") is not None
    return None


def linear_paths(model: nn.Module) -> Dict[str, tuple]:
    """{module path: (in, out, has_bias)} of the Linear-like leaves to hold ternary weights.

    The layers mlx-lm's `quantize_model` would quantize: it skips those the model's
    `quant_predicate` refuses (kimi_k3's residual projections) and those whose K is not a
    whole number of groups. Ternary packings pad K, so of the latter only layers narrower
    than MLX's smallest group stay float: gemma3n's AltUp coefficient layers (K = 4),
    whose weights the model clips and reads itself.
    """
    predicate = getattr(model, "quant_predicate", None)
    out = {}
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        dims = linear_dims(m)
        if dims is None or dims[0] < MIN_QUANT_GROUP:
            continue
        if predicate is not None and not predicate(path, m):
            continue
        out[path] = dims
    return out
