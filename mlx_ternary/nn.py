"""TernaryLinear, and swapping it into an mlx-lm model in place of Linear layers."""

from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import format as fmt
from . import kernels, reference


class TernaryLinear(nn.Module):
    """A linear layer whose weight is s * t, t in {-1, 0, +1}, kept packed.

    Parameters (the names a native checkpoint stores):
        packed: (N, row_bytes) uint8 (compact) or (N, Kp/16) uint32 (fast).
        scales: (1, 1) | (N, 1) | (N, ceil(K / group_size)).
        bias:   (N,), optional.

    Args:
        input_dims: K.
        output_dims: N.
        bias: whether the layer has a bias.
        packing: "compact" (base-3, 1.6 bits) or "fast" (2-bit codes).
        scale: "tensor", "row" or "group".
        group_size: 64, 128 or 256 for group scales.
        scale_dtype: dtype of `scales`.
        activation_bits: 8 for BitNet int8 per-token activation quantization.
        backend: force "metal", "emulate" or "reference" (default: automatic).
    """

    def __init__(self, input_dims: int, output_dims: int, bias: bool = False, *,
                 packing: str = "compact", scale: str = "row",
                 group_size: Optional[int] = None, scale_dtype=mx.float32,
                 activation_bits: Optional[int] = None, backend: Optional[str] = None):
        super().__init__()
        self.in_features = input_dims
        self.out_features = output_dims
        self.packing = packing
        self.group_size = group_size if scale == "group" else None
        self.activation_bits = activation_bits
        self.backend = backend
        shape = fmt.packed_shape(packing, output_dims, input_dims, self.group_size)
        self.packed = mx.zeros(shape, dtype=mx.array(fmt.packed_dtype(packing)(0)).dtype)
        self.scales = mx.zeros(
            fmt.scales_shape(scale, output_dims, input_dims, self.group_size), dtype=scale_dtype
        )
        if bias:
            self.bias = mx.zeros((output_dims,))

    @classmethod
    def from_packed(cls, pt: fmt.PackedTernary, bias: Optional[mx.array] = None,
                    activation_bits: Optional[int] = None,
                    backend: Optional[str] = None) -> "TernaryLinear":
        layer = cls(pt.in_features, pt.out_features, bias is not None, packing=pt.packing,
                    scale=pt.scale, group_size=pt.group_size,
                    activation_bits=activation_bits, backend=backend)
        layer.packed = mx.array(pt.packed)
        layer.scales = mx.array(pt.scales)
        if bias is not None:
            layer.bias = bias
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Module, packing: str = "compact", scale: str = "tensor",
                    group_size: Optional[int] = None,
                    activation_bits: Optional[int] = None) -> "TernaryLinear":
        """Absmean-ternarize a float nn.Linear (BitNet b1.58 at `scale` granularity)."""
        t, s = fmt.ternarize(np.array(linear.weight.astype(mx.float32)), scale, group_size)
        pt = fmt.PackedTernary.from_trits(t, s, packing, group_size)
        return cls.from_packed(pt, linear.get("bias"), activation_bits)

    def to_packed(self) -> fmt.PackedTernary:
        scales = self.scales
        if scales.dtype == mx.bfloat16:
            scales = scales.astype(mx.float32)
        return fmt.PackedTernary(self.packing, np.array(self.packed), np.array(scales),
                                 self.out_features, self.in_features, self.group_size)

    @property
    def scale(self) -> str:
        return fmt.scale_kind(tuple(self.scales.shape), self.out_features)

    @property
    def weight(self) -> mx.array:
        """The float weight s * t (N, K), built lazily: nothing is computed unless used.

        Lets code written for nn.Linear (mlx-lm's counters, LoRA fusing) read the layer;
        assigning it is refused, since the parameters are `packed` and `scales`.
        """
        return self.dequantize()

    @property
    def bits(self) -> int:
        # mlx-lm counts a leaf with `bits` as weight.size * 32 // bits parameters.
        return 32

    def to_lora(self, r: int = 8, dropout: float = 0.0, scale: float = 20.0):
        """mlx-lm's LoRA hook (`linear_to_lora_layers`): the base stays packed and frozen."""
        from .lora import TernaryLoRALinear  # mlx-lm's tuner imports transformers: only now

        return TernaryLoRALinear.from_base(self, r=r, dropout=dropout, scale=scale)

    def trits(self) -> mx.array:
        return fmt.unpack_mx(self.packed, self.packing, self.in_features, self.group_size)

    def dequantize(self, dtype=mx.float32) -> mx.array:
        """The float weight (N, K) this layer represents."""
        s = fmt.expand_scales(self.scales.astype(dtype), self.in_features, self.group_size)
        return self.trits().astype(dtype) * s

    def repack(self, packing: str) -> None:
        """Switch the packed layout in place; lossless."""
        if packing == self.packing:
            return
        self.packed = fmt.pack_mx(self.trits(), packing, self.group_size)
        self.packing = packing
        self.__dict__.pop("_affine", None)

    def _fast_affine(self, dtype):
        # Load-time work for the reference fast path, cached per scales array and dtype.
        cached = self.__dict__.get("_affine")
        if cached is None or cached[0] is not self.scales or cached[1] != str(dtype):
            kp = self.packed.shape[1] * fmt.CODES_PER_WORD
            affine = reference.qmm_affine(self.scales, self.out_features, kp,
                                          self.group_size, dtype)
            self.__dict__["_affine"] = cached = (self.scales, str(dtype), affine)
        return cached[2]

    def _backend(self) -> str:
        # Resolved once per layer (keyword, environment, hardware): not on every token.
        cached = self.__dict__.get("_resolved")
        if cached is None or cached[0] != self.backend:
            self.__dict__["_resolved"] = cached = (self.backend,
                                                   kernels.resolve_backend(self.backend))
        return cached[1]

    def __call__(self, x: mx.array) -> mx.array:
        return kernels.ternary_matmul(
            x, self.packed, self.scales, self.get("bias"), packing=self.packing,
            in_features=self.in_features, group_size=self.group_size,
            activation_bits=self.activation_bits, backend=self._backend(),
            affine=self._fast_affine,
        )

    def _extra_repr(self) -> str:
        return (f"input_dims={self.in_features}, output_dims={self.out_features}, "
                f"packing={self.packing}, scale={self.scale}, "
                f"activation_bits={self.activation_bits}, bias={'bias' in self}")


class FusedTernaryLinear(TernaryLinear):
    """A TernaryLinear whose output is split at `indices`, as afm7's FusedLinear (q, k, v)."""

    @classmethod
    def from_ternary(cls, layer: TernaryLinear, indices) -> "FusedTernaryLinear":
        fused = cls(layer.in_features, layer.out_features, "bias" in layer,
                    packing=layer.packing, scale=layer.scale, group_size=layer.group_size,
                    scale_dtype=layer.scales.dtype, activation_bits=layer.activation_bits,
                    backend=layer.backend)
        fused.packed, fused.scales = layer.packed, layer.scales
        if "bias" in layer:
            fused.bias = layer.bias
        fused.__dict__["indices"] = list(indices)  # ints, not parameters
        return fused

    @property
    def input_dims(self) -> int:
        return self.in_features

    @property
    def output_dims(self) -> List[int]:
        ends = self.indices + [self.out_features]
        return [b - a for a, b in zip([0] + self.indices, ends)]

    def __call__(self, x: mx.array):
        return super().__call__(x).split(self.indices, axis=-1)

    def to_lora(self, r: int = 8, dropout: float = 0.0, scale: float = 20.0):
        from .lora import FusedTernaryLoRALinear

        return FusedTernaryLoRALinear.from_base(self, r=r, dropout=dropout, scale=scale)


# MLX quantizes whole groups of K (32 at the least): mlx-lm never quantizes a narrower layer.
MIN_QUANT_GROUP = 32


def _split_indices(module: nn.Module) -> Optional[List[int]]:
    # afm7's FusedLinear: an nn.Linear subclass whose output is split at `indices`.
    indices = getattr(module, "indices", None) if isinstance(module, nn.Linear) else None
    return list(indices) if isinstance(indices, (list, tuple)) else None


def linear_dims(module: nn.Module):
    """(in, out, has_bias) of a Linear-like layer ternary weights can stand in for, else None.

    nn.Linear, afm7's split-output FusedLinear and mlx-lm's BitLinear. Other nn.Linear
    subclasses change what the layer computes in ways a TernaryLinear cannot know: None.
    """
    if type(module) is nn.Linear or _split_indices(module) is not None:
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


def swap_modules(model: nn.Module, make: Callable[[str, nn.Module], Optional[nn.Module]]):
    """Replace each leaf module for which `make(path, module)` returns a module.

    A TernaryLinear standing in for a split-output layer (afm7's FusedLinear) splits too.
    """
    new = []
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        repl = make(path, m)
        if repl is None:
            continue
        indices = _split_indices(m)
        if indices is not None and type(repl) is TernaryLinear:
            repl = FusedTernaryLinear.from_ternary(repl, indices)
        new.append((path, repl))
    if new:
        model.update_modules(tree_unflatten(new))
    return model


def ternarize_model(model: nn.Module, packing: str = "compact", scale: str = "tensor",
                    group_size: Optional[int] = None, activation_bits: Optional[int] = None,
                    skip=("lm_head",)) -> nn.Module:
    """Swap the float Linear layers of `linear_paths` (except `skip`) for absmean-ternarized
    TernaryLinear layers; what mlx-lm's quantize_model leaves float stays float."""
    paths = linear_paths(model)

    def make(path, m):
        if (path in paths and isinstance(m, nn.Linear)
                and not any(path.split(".")[-1] == s for s in skip)):
            return TernaryLinear.from_linear(m, packing, scale, group_size, activation_bits)
        return None

    return swap_modules(model, make)


def ternary_layers(model: nn.Module):
    return [(p, m) for p, m in model.named_modules() if isinstance(m, TernaryLinear)]
