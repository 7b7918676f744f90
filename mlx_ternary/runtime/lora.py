"""LoRA and DoRA adapters on ternary layers; the packed base stays packed and frozen.

The layers follow mlx-lm's (mlx_lm/tuner/lora.py, dora.py) so its trainer, adapter files
and fuse command take them as they are. The base is any TernaryLinear (duck-typed here:
this module sits below nn.py): its forward keeps int8 activation quantization, and its
input gradient is BitNet's straight-through estimator (reference.quantize_activations).
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.afm7 import FusedLoRALinear
from mlx_lm.tuner.lora import LoRALinear

from ..errors import TernaryError
from . import reference

FUSE_REFUSAL = (
    "the base model is ternary: folding a LoRA/DoRA update into weights in {-1, 0, +1} "
    "would lose it; pass --dequantize for a float checkpoint, or keep the adapter and "
    "load it with --adapter-path (mlx-ternary generate/serve, mlx-ternary lm ...)"
)


def _check_dequantize(dequantize: bool) -> None:
    if not dequantize:
        raise TernaryError(FUSE_REFUSAL)


def _fused_linear(weight: mx.array, base) -> nn.Linear:
    out_f, in_f = weight.shape
    linear = nn.Linear(in_f, out_f, bias="bias" in base)
    linear.weight = weight
    if "bias" in base:
        linear.bias = base.bias
    return linear


class TernaryLoRALinear(LoRALinear):
    """y = base(x) + scale * (dropout(x) @ A) @ B over a frozen TernaryLinear base."""

    @staticmethod
    def from_base(linear, r: int = 8, dropout: float = 0.0, scale: float = 20.0):
        lora = TernaryLoRALinear(
            linear.in_features, linear.out_features, r=r, dropout=dropout, scale=scale
        )
        lora.linear = linear
        return lora

    def fuse(self, dequantize: bool = False) -> nn.Linear:
        """A float nn.Linear holding s * t + scale * (A @ B).T; only with dequantize."""
        _check_dequantize(dequantize)
        w = self.linear.dequantize()
        delta = ((self.scale * self.lora_b.T) @ self.lora_a.T).astype(w.dtype)
        return _fused_linear(w + delta, self.linear)


class FusedTernaryLoRALinear(FusedLoRALinear):
    """afm7's per-part LoRA over a split-output FusedTernaryLinear (q, k, v)."""

    @staticmethod
    def from_base(linear, r: int = 8, dropout: float = 0.0, scale: float = 20.0):
        lora = FusedTernaryLoRALinear(
            linear.input_dims, linear.output_dims, r=r, dropout=dropout, scale=scale
        )
        lora.linear = linear
        return lora

    def fuse(self, dequantize: bool = False):
        _check_dequantize(dequantize)
        return super().fuse(dequantize=True)  # reads the base's float `weight`


class TernaryDoRALinear(nn.Module):
    """DoRA (Liu et al. 2024) over a frozen TernaryLinear base, computed on packed weights.

    out = m / ||W + scale * (A @ B).T||_row * (base(x) + scale * (x @ A) @ B) + bias,
    as mlx-lm's DoRALinear, with base(x) the ternary layer (int8 activations kept). The
    row norms come from ||W||^2 (fixed), W @ A (one ternary matmul of r rows) and
    B.T (A.T A) B, so the float weight is never materialised.
    """

    @staticmethod
    def from_base(linear, r: int = 8, dropout: float = 0.0, scale: float = 20.0):
        return TernaryDoRALinear(linear, r=r, dropout=dropout, scale=scale)

    def __init__(self, linear, r: int = 8, dropout: float = 0.0, scale: float = 20.0):
        super().__init__()
        self.linear = linear
        self.dropout = nn.Dropout(p=dropout)
        self.scale = scale
        base = self._ternary()
        k, n = base.in_features, base.out_features
        bound = 1 / k**0.5
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(k, r))
        self.lora_b = mx.zeros(shape=(r, n))
        base_sq = mx.square(base.dequantize(mx.float32)).sum(axis=1)  # (N,)
        mx.eval(base_sq)
        self.__dict__["base_sq"] = base_sq  # a constant, not a parameter
        self.m = mx.sqrt(base_sq)

    def _ternary(self):
        """The TernaryLinear holding the packed weights the row norms are computed from."""
        return self.linear

    def _sum_over_ranks(self, sq: mx.array) -> mx.array:
        """Row sums over the whole K of a term of ||V||^2 (a K-sharded layer all_sums
        its share; `base_sq` is whole on every rank)."""
        return sq

    def _weight_times(self, a: mx.array) -> mx.array:
        """W @ a for a (K, r): the ternary matmul of a.T, without activation quantization."""
        lin = self._ternary()
        return reference.ternary_matmul(
            a.T,
            lin.packed,
            lin.scales,
            packing=lin.packing,
            in_features=lin.in_features,
            group_size=lin.group_size,
        ).T

    def _adapted_norm(self) -> mx.array:
        a = mx.stop_gradient(self.lora_a).astype(mx.float32)
        b = mx.stop_gradient(self.lora_b).astype(mx.float32)
        cross = (self._weight_times(a) * b.T).sum(axis=1)  # <W_n, (A @ B).T_n>
        low = ((a.T @ a) @ b * b).sum(axis=0)  # ||(A @ B).T_n||^2
        sq = self.base_sq + self._sum_over_ranks(2 * self.scale * cross + self.scale**2 * low)
        return mx.sqrt(mx.maximum(sq, 0.0))

    def __call__(self, x: mx.array) -> mx.array:
        bias = self.linear.get("bias")
        y = self.linear(x)
        if bias is not None:
            y = y - bias
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        out = y + (self.scale * z).astype(x.dtype)
        out = (self.m / self._adapted_norm()).astype(x.dtype) * out
        return out if bias is None else out + bias

    def fuse(self, dequantize: bool = False) -> nn.Linear:
        """A float nn.Linear holding m * V / ||V||_row, V = s * t + scale * (A @ B).T."""
        _check_dequantize(dequantize)
        w = self.linear.dequantize()
        w = w + ((self.scale * self.lora_b.T) @ self.lora_a.T).astype(w.dtype)
        w = (self.m / mx.linalg.norm(w, axis=1))[:, None].astype(w.dtype) * w
        return _fused_linear(w, self.linear)
