"""Tensor parallelism for adapted layers: LoRA and DoRA sharded like their base layers.

An adapter adds scale * (x @ A) @ B to its base's output (DoRA then rescales each output
row by m / ||W + scale * (A @ B).T||_row). Sharded with the base:

all-to-sharded (the base holds a block of output rows): A stays whole, B keeps the same
    columns (lora_b is (r, N)), DoRA's m and row norms the same rows; no communication.
sharded-to-all (the base holds a block of input columns K): A keeps the same rows
    (lora_a is (K, r)), B stays whole; each rank's (x_k @ A_k) @ B is added to its share of
    the base output before the one all_sum the base does anyway, so the sum over the ranks
    is the single process's x @ A @ B. DoRA's row norms span K: each rank's share of the
    squared norm is all_summed (one (N,) all_sum per call).

The sharded layers keep the adapters' parameter names (linear, lora_a, lora_b, m).
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as mlx_distributed
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear

from ..errors import TernaryError
from .layers import TernaryLinear
from .lora import TernaryDoRALinear, TernaryLoRALinear
from .shard import ShardedToAllTernaryLinear, TernaryParts, rank_ranges
from .shard import shard_linear as shard_base

ADAPTERS = (LoRALinear, DoRALinear, TernaryDoRALinear)


def _rows(a: mx.array, ranges, axis: int) -> mx.array:
    """The `ranges` of `a` along `axis`, joined: a rank's share of an adapter matrix."""
    take = [a[r0:r1] if axis == 0 else a[:, r0:r1] for r0, r1 in ranges]
    return mx.contiguous(take[0] if len(take) == 1 else mx.concatenate(take, axis=axis))


class AllToShardedLoRALinear(TernaryLoRALinear):
    """LoRA over an all-to-sharded base: lora_b holds the base's output columns."""

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)  # the base sums x's gradient over the ranks itself
        x = mlx_distributed.sum_gradients(self.linear.group)(x)
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        return y + (self.scale * z).astype(x.dtype)


class ShardedToAllLoRALinear(TernaryLoRALinear):
    """LoRA over a sharded-to-all base: lora_a holds the base's input rows, and the
    adapter's share rides in the base's all_sum."""

    def __call__(self, x: mx.array) -> mx.array:
        base = self.linear
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        if isinstance(base, ShardedToAllTernaryLinear):
            y = base.local_output(x) + (self.scale * z).astype(x.dtype)
            y = mx.distributed.all_sum(y, group=base.group)
            return y + base["bias"] if "bias" in base else y
        return base(x) + mx.distributed.all_sum(self.scale * z, group=base.group).astype(x.dtype)


class AllToShardedDoRALinear(TernaryDoRALinear):
    """DoRA over an all-to-sharded base: whole rows, so the row norms are local."""

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(mlx_distributed.sum_gradients(self.linear.group)(x))


class ShardedToAllDoRALinear(TernaryDoRALinear):
    """DoRA over a sharded-to-all ternary base: the row norms and the output are summed
    over the ranks' K-slices."""

    def _ternary(self):
        return self.linear.linear

    def _sum_over_ranks(self, sq: mx.array) -> mx.array:
        return mx.distributed.all_sum(sq, group=self.linear.group)

    def __call__(self, x: mx.array) -> mx.array:
        base = self.linear
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        y = base.local_output(x) + (self.scale * z).astype(x.dtype)
        y = mx.distributed.all_sum(y, group=base.group)
        y = (self.m / self._adapted_norm()).astype(x.dtype) * y
        return y + base["bias"] if "bias" in base else y


def _shares(module: nn.Module, sharding: str, group, segments, name: str):
    """(lora_a, lora_b) of this rank: the rows or columns its base keeps."""
    a, b = module.lora_a, module.lora_b
    world, rank = group.size(), group.rank()
    if sharding == "all-to-sharded":
        ranges = rank_ranges(b.shape[1], world, rank, segments, name=name)
        return a, _rows(b, ranges, 1), ranges
    what = "input columns (K)"
    ranges = rank_ranges(a.shape[0], world, rank, segments, name=name, what=what)
    return _rows(a, ranges, 0), b, ranges


def _sharded_dora(module, base, sharding: str, a, b, ranges, name: str):
    if not isinstance(module, TernaryDoRALinear):
        raise TernaryError(
            f"{name}: DoRA on a float layer (mlx-lm's DoRALinear) is not sharded; tensor "
            "parallelism shards DoRA on ternary layers and LoRA on any"
        )
    cls = AllToShardedDoRALinear if sharding == "all-to-sharded" else ShardedToAllDoRALinear
    out = cls(base, r=a.shape[1], scale=module.scale)
    out.lora_a, out.lora_b, out.dropout = a, b, module.dropout
    whole = sharding == "sharded-to-all"  # rows whole: m and ||W||^2 as they are
    out.m = module.m if whole else _rows(module.m, ranges, 0)
    # ||W||^2 of the single process, so the norms' largest term is its very value
    out.__dict__["base_sq"] = module.base_sq if whole else _rows(module.base_sq, ranges, 0)
    out.train(module.training)
    return out


def shard_adapted(
    module: nn.Module,
    sharding: str,
    *,
    segments=1,
    group: Optional[mx.distributed.Group] = None,
    parts: Optional[TernaryParts] = None,
    name: str = "layer",
) -> nn.Module:
    """A LoRA or DoRA layer sharded with its base (`shard.shard_linear` shards the base)."""
    group = group or mx.distributed.init()
    base = shard_base(
        module.linear, sharding, segments=segments, group=group, parts=parts, name=name
    )
    a, b, ranges = _shares(module, sharding, group, segments, name)
    if isinstance(module, (DoRALinear, TernaryDoRALinear)):
        return _sharded_dora(module, base, sharding, a, b, ranges, name)
    cls = AllToShardedLoRALinear if sharding == "all-to-sharded" else ShardedToAllLoRALinear
    out = cls(1, 1, r=a.shape[1], scale=module.scale)
    out.linear, out.lora_a, out.lora_b, out.dropout = base, a, b, module.dropout
    out.train(module.training)
    return out


def shard_linear(
    module: nn.Module,
    sharding: str,
    *,
    segments=1,
    group: Optional[mx.distributed.Group] = None,
    parts: Optional[TernaryParts] = None,
    name: str = "layer",
):
    """`shard.shard_linear`, with LoRA / DoRA layers sharded like their base layers."""
    if isinstance(module, ADAPTERS):
        return shard_adapted(
            module, sharding, segments=segments, group=group, parts=parts, name=name
        )
    return shard_base(module, sharding, segments=segments, group=group, parts=parts, name=name)


def adapter_base(module: nn.Module) -> Optional[TernaryLinear]:
    """The ternary layer an adapter wraps (None for anything else)."""
    if isinstance(module, ADAPTERS) and isinstance(module.linear, TernaryLinear):
        return module.linear
    return None
