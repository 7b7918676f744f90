"""`model.shard(group)` for mlx-lm's classes with ternary layers: the per-model plans.

mlx's `shard_linear` treats every layer that is not an nn.Linear as an affine quantized one,
and mlx-lm's models call it by the name they imported. `shard_model` therefore rebinds that
name to `shard.shard_linear` only while the model's own `shard` runs, in the modules that
imported mlx's, and puts mlx's back afterwards; nothing of mlx or mlx-lm is changed outside
the call. BitNet's class has no `shard` (and its sub-norms span the sharded features), so
its plan lives here.
"""

from contextlib import contextmanager
from functools import partial
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as mlx_distributed

from ..errors import TernaryError
from . import patches, samehost, shard_block
from .layers import TernaryLinear
from .shard import ShardedRMSNorm, TernaryParts
from .shard_head import shard_output
from .shard_lora import shard_linear


def _named_modules(model: nn.Module) -> Dict[int, str]:
    return {id(m): path for path, m in model.named_modules()}


def _check_heads(model: nn.Module, world: int) -> None:
    # mlx-lm's shard divides the head counts with //; a remainder would cut a head in two.
    for i, layer in enumerate(getattr(model, "layers", None) or []):
        attn = getattr(layer, "self_attn", None)
        for attr, what in (("n_heads", "attention"), ("n_kv_heads", "key/value")):
            n = getattr(attn, attr, None)
            if isinstance(n, int) and n % world:
                raise TernaryError(
                    f"layers.{i}.self_attn: its {n} {what} heads do not split across {world} "
                    "ranks; tensor parallelism keeps whole heads on each rank, so run on a "
                    f"number of ranks that divides {n}"
                )


@contextmanager
def ternary_aware(fn_globals: dict, names: Dict[int, str], sources: Dict[str, TernaryParts]):
    """Within the block, the model modules that imported mlx's shard_linear /
    shard_inplace see versions that also know TernaryLinear; restored on exit."""
    mlx_linear, mlx_inplace = mlx_distributed.shard_linear, mlx_distributed.shard_inplace

    def linear(module, sharding, *, segments=1, group=None):
        name = names.get(id(module), type(module).__name__)
        return shard_linear(
            module, sharding, segments=segments, group=group, parts=sources.get(name), name=name
        )

    def inplace(module, sharding, *, segments=1, group=None):
        for path, m in module.named_modules():
            if isinstance(m, TernaryLinear):
                where = names.get(id(module), type(module).__name__)
                raise TernaryError(
                    f"{where}.{path}: the model's shard() shards this ternary layer in place "
                    "(shard_inplace), which cannot agree on activation scales across ranks; "
                    "tensor parallelism of this architecture is not supported for ternary "
                    "layers"
                )
        return mlx_inplace(module, sharding, segments=segments, group=group)

    with patches.swapped({mlx_linear: linear, mlx_inplace: inplace}, extra=[fn_globals]):
        yield


def _shard_bitnet(model: nn.Module, group, shard) -> None:
    """mlx-lm's bitnet class has no shard(): Megatron-style split, sharded sub-norms."""
    w = group.size()
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for proj in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, proj, shard(getattr(attn, proj), "all-to-sharded", group=group))
        attn.o_proj = shard(attn.o_proj, "sharded-to-all", group=group)
        attn.attn_sub_norm = ShardedRMSNorm.from_norm(
            attn.attn_sub_norm, group, name=f"model.layers.{i}.self_attn.attn_sub_norm"
        )
        attn.n_heads //= w
        attn.n_kv_heads //= w
        mlp.gate_proj = shard(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard(mlp.down_proj, "sharded-to-all", group=group)
        mlp.ffn_sub_norm = ShardedRMSNorm.from_norm(
            mlp.ffn_sub_norm, group, name=f"model.layers.{i}.mlp.ffn_sub_norm"
        )


# Architectures whose mlx-lm class has no usable shard() for ternary layers.
PLANS = {"bitnet": _shard_bitnet}


def model_type(model: nn.Module) -> Optional[str]:
    return getattr(model, "model_type", None) or getattr(
        getattr(model, "args", None), "model_type", None
    )


def shard_model(
    model: nn.Module,
    group: Optional[mx.distributed.Group] = None,
    *,
    sources: Optional[Dict[str, TernaryParts]] = None,
) -> nn.Module:
    """Shard `model` in place across `group` for tensor parallelism, as mlx-lm's
    `model.shard(group)` does, with TernaryLinear layers split by this module, the output
    layer by vocabulary (shard_head.py), and ranks that share this machine tuned for it
    (samehost.py).

    Args:
        model: an mlx-lm model (as `mlx_ternary.load` returns it).
        group: the ranks (default: the global group).
        sources: {layer path: TernaryParts} to read ternary weights from instead of the
            layers (a checkpoint read slice by slice).

    Raises:
        TernaryError: no sharding plan for the architecture, head counts or dimensions
            that do not divide, or a layer the model shards in place.
    """
    group = group or mx.distributed.init()
    shard_block.register()  # its blocks run fused where the sharded layers allow
    samehost.share_host(group)  # ranks sharing this machine: no polling, a core block each
    names, sources = _named_modules(model), sources or {}
    _check_heads(getattr(model, "model", model), group.size())
    plan = PLANS.get(model_type(model))
    if plan is not None:

        def shard(module, sharding, *, group):
            name = names.get(id(module), type(module).__name__)
            return shard_linear(module, sharding, group=group, parts=sources.get(name), name=name)

        plan(model, group, shard)
        shard_output(model, group)
        return model
    method = getattr(type(model), "shard", None)
    if method is None:
        raise TernaryError(
            f"the {model_type(model)!r} architecture has no tensor-parallel "
            "plan in mlx-lm (its model class has no shard method)"
        )
    with ternary_aware(method.__globals__, names, sources):
        method(model, group)
    shard_output(model, group)
    return model


def make_shardable(model: nn.Module) -> nn.Module:
    """Give this model instance a `shard(group)` that handles its ternary layers.

    The instance attribute shadows the class's method for this object only, so
    `model.shard(group)` (and mlx-lm's sharded_load, which calls it) works on ternary
    models without changing mlx-lm's classes.
    """
    object.__setattr__(model, "shard", partial(shard_model, model))
    return model
