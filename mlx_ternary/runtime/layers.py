"""TernaryLinear, and swapping it into an mlx-lm model in place of Linear layers."""

from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .. import format as fmt
from ..ternarize import ternarize
from . import dispatch, reference
from .cpu import block as cpu_block
from .linears import linear_dims, linear_paths, split_indices  # noqa: F401 (re-exported)

# Settings a launch plan depends on besides the arrays; assigning one drops the plan.
_PLAN_SETTINGS = (
    "packing",
    "in_features",
    "out_features",
    "group_size",
    "activation_bits",
    "backend",
)


# (x shape, x dtype, call, launch) of a layer's latest inference call, which
# TernaryLinear's call checks first: comparing x's shape and dtype to it costs less than
# hashing the (shape, Dtype) key of the plan's dict (MLX's Dtype hashes and compares through
# nanobind). Where the call is one Metal GEMV launch (launch.py's `run.direct`: kernel, its
# four inputs after x, template, grid, threadgroup, output shapes and dtypes), the call
# launches it itself, without the closure's frame; else the launch is None.
_NO_CALL = (None, None, None, None)


class TernaryLinear(nn.Module):
    """A linear layer whose weight is s * t, t in {-1, 0, +1}, kept packed.

    Parameters (the names a ternary checkpoint stores):
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
        backend: force one of the four backends: "metal" (the Metal kernels, the default
            on the GPU), "emulate" (the same kernels through the CPU emulator), "native"
            (the C++ CPU backend, the default when MLX runs on the CPU and it builds) or
            "reference" (pure MLX, the default where neither runs); None: automatic
            (dispatch.resolve_backend).

    Calls run a launch plan made once per (packed, scales, bias) (dispatch.LayerPlan),
    made again whenever one of them or a setting is replaced. In
    training mode (`train()`, as mlx-lm's trainer sets it) every backend is differentiable
    w.r.t. x with BitNet's straight-through estimator: grad_x = g @ (s * t).
    """

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        bias: bool = False,
        *,
        packing: str = "compact",
        scale: str = "row",
        group_size: Optional[int] = None,
        scale_dtype=mx.float32,
        activation_bits: Optional[int] = None,
        backend: Optional[str] = None,
    ):
        super().__init__()
        self._drop_plan()
        self.in_features = input_dims
        self.out_features = output_dims
        self.packing = fmt.check_packing(packing, "TernaryLinear packing")
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
    def from_packed(
        cls,
        pt: fmt.PackedTernary,
        bias: Optional[mx.array] = None,
        activation_bits: Optional[int] = None,
        backend: Optional[str] = None,
        **kwargs,
    ) -> "TernaryLinear":
        """A layer holding `pt` (its arrays are used as they are: lazy ones stay lazy)."""
        layer = cls(
            pt.in_features,
            pt.out_features,
            bias is not None,
            packing=pt.packing,
            scale=pt.scale,
            group_size=pt.group_size,
            activation_bits=activation_bits,
            backend=backend,
            **kwargs,
        )
        layer.packed = _mx(pt.packed)
        layer.scales = _mx(pt.scales)
        if bias is not None:
            layer.bias = bias
        return layer

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        packing: str = "compact",
        scale: str = "tensor",
        group_size: Optional[int] = None,
        activation_bits: Optional[int] = None,
    ) -> "TernaryLinear":
        """Absmean-ternarize a float nn.Linear (BitNet b1.58 at `scale` granularity)."""
        t, s = ternarize(np.array(linear.weight.astype(mx.float32)), scale, group_size)
        pt = fmt.PackedTernary.from_trits(t, s, packing, group_size)
        return cls.from_packed(pt, linear.get("bias"), activation_bits)

    def to_packed(self) -> fmt.PackedTernary:
        scales = self.scales
        if scales.dtype == mx.bfloat16:
            scales = scales.astype(mx.float32)
        return fmt.PackedTernary(
            self.packing,
            np.array(self.packed),
            np.array(scales),
            self.out_features,
            self.in_features,
            self.group_size,
        )

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
        if fmt.check_packing(packing, "repack packing") == self.packing:
            return
        self.packed = fmt.pack_mx(self.trits(), packing, self.group_size)
        self.packing = packing

    # The plan is dropped whenever a setting or one of its arrays changes: attribute
    # assignment, mlx-lm's load_weights/update and nn.value_and_grad all go through these.
    def __setattr__(self, key, val):
        super().__setattr__(key, val)
        if key in _PLAN_SETTINGS:
            self._drop_plan()

    def __setitem__(self, key, val):
        super().__setitem__(key, val)
        self._drop_plan()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._drop_plan()

    def pop(self, key, *default):
        # nn.Module.__setattr__ pops every non-array attribute it sets, train()/eval()'s
        # `_training` included: those drop the plan and the remembered last call too.
        self._drop_plan()
        return super().pop(key, *default)

    def _drop_plan(self) -> None:
        self.__dict__["_plan"] = None
        self.__dict__["_last"] = _NO_CALL

    def __getstate__(self):
        # copy.deepcopy (and pickle): a copy plans again (a Dtype cannot be copied)
        state = dict(self.__dict__)
        state["_plan"], state["_last"] = None, _NO_CALL
        return state

    def plan(self) -> dispatch.LayerPlan:
        """This layer's launch plan: made on first use, again after any change."""
        plan = self.__dict__.get("_plan")
        if plan is None:
            plan = dispatch.LayerPlan(
                self["packed"],
                self["scales"],
                self.get("bias"),
                packing=self.packing,
                in_features=self.in_features,
                group_size=self.group_size,
                activation_bits=self.activation_bits,
                backend=self.backend,
            )
            # Not kept when the arrays are a trace's placeholders (mlx-lm compiles its
            # training step with the parameters as inputs, and MLX swaps them in and out
            # of the module without __setitem__): a kept plan would outlive the trace.
            if reference.materialize(plan.packed, plan.scales, plan.bias):
                self.__dict__["_plan"] = plan
        return plan

    def reads_affine(self) -> bool:
        """Whether this layer's calls read the reference path's MLX affine arrays: a
        fast-packed layer on the reference backend."""
        return self.packing == "fast" and self.plan().backend == "reference"

    def runtime_arrays(self, dtype) -> list:
        """The arrays this layer's calls read besides its parameters, for activations of
        `dtype`: the reference fast path's affine scales and biases (built on first use,
        shared between layers where equal); none on the Metal and native backends."""
        return list(self.plan().affine(dtype)[:2]) if self.reads_affine() else []

    def kernel_spec(self) -> Optional[tuple]:
        """(packed, scales, bias, packing, in_features, group_size, activation_bits) when a
        call of this layer's class adds nothing to the native kernel on its input (a plain
        TernaryLinear; a sharded layer holding a block of rows: runtime/shard_block.py) -
        on the native backend, not training, its arrays materialized, q8k only where the
        kernel takes it - else None. What the fused CPU block (runtime/cpu/block.py) runs
        the layer with."""
        if self.training:
            return None
        plan = self._plan or self.plan()
        if plan.backend != "native" or self.__dict__.get("_plan") is None:
            return None  # another backend, or arrays of a trace (plan() keeps no plan then)
        if self.activation_bits not in (None, 8, fmt.Q8K):
            return None
        if self.activation_bits == fmt.Q8K and not plan.native_q8k():
            return None
        return (
            plan.packed,
            plan.scales,
            plan.bias,
            self.packing,
            self.in_features,
            self.group_size,
            self.activation_bits,
        )

    def block_projection(self) -> tuple:
        """(kernel_spec(), mapping, key) for the fused CPU block's plan: it holds while
        mapping[key], this layer's launch plan, which every setter that changes the
        arguments drops, is what it is now."""
        return self.kernel_spec(), self.__dict__, "_plan"

    def __call__(self, x: mx.array) -> mx.array:
        # The latest inference call's (decode: every call), its launch unpacked.
        shape, dtype, fn, launch = self._last
        if x.shape == shape and x.dtype == dtype:
            if launch is None:
                return fn(x)
            kern, w, s, b, p, tmpl, grid, tg, out_shapes, odt = launch
            return kern(
                inputs=[x, w, s, b, p],
                template=tmpl,
                grid=grid,
                threadgroup=tg,
                output_shapes=out_shapes,
                output_dtypes=odt,
            )[0]
        plan = self._plan or self.plan()
        training = self._training
        key = (x.shape, x.dtype)
        calls = plan.train_calls if training else plan.calls
        fn = calls.get(key) or plan.plan_call(x, training)
        # Remembered only for a kept plan's kept inference call (not a trace's).
        if not training and calls.get(key) is fn and self.__dict__.get("_plan") is plan:
            self.__dict__["_last"] = (*key, fn, getattr(fn, "direct", None))
        return fn(x)

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.in_features}, output_dims={self.out_features}, "
            f"packing={self.packing}, scale={self.scale}, "
            f"activation_bits={self.activation_bits}, bias={'bias' in self}"
        )


# The fused CPU block runs projections of exactly this class (a subclass transforms x).
cpu_block.register_projection(TernaryLinear, TernaryLinear.block_projection)


class HadamardTernaryLinear(TernaryLinear):
    """TernaryLinear whose input first gets a signed blockwise Walsh-Hadamard rotation
    (mlx-lm's prism_hadamard_qwen35 packs fold the rotation into the weights).

    Parameters: packed, scales (as TernaryLinear) and signs (K,) float32 of +-1.
    """

    def __init__(
        self, input_dims: int, output_dims: int, bias: bool = False, *, block: int = 0, **kwargs
    ):
        super().__init__(input_dims, output_dims, bias, **kwargs)
        self.block = block
        if block:
            self.signs = mx.ones((input_dims,), dtype=mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        if self.block:
            from mlx_lm.models.prism_hadamard_qwen35 import hadamard_rotate

            x = hadamard_rotate(x, self.block, self.signs)
        return super().__call__(x)


def _mx(a) -> mx.array:
    return a if isinstance(a, mx.array) else mx.array(a)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose lookup can return `out_dtype`.

    MLX's lookup dequantizes in the scales' dtype: float16 scales round each row and turn
    a float32 model's residual stream float16 (inexact, and many times slower on the CPU).
    With `out_dtype` the gathered rows' scales and biases are cast first, so rows are exact
    in float32 while the table keeps its stored scales. `as_linear` is already exact:
    quantized_matmul computes in x's dtype.
    """

    out_dtype = None

    def __call__(self, x):
        s, b = self["scales"][x], self["biases"][x]
        if self.out_dtype is not None:
            s, b = s.astype(self.out_dtype), b.astype(self.out_dtype)
        return mx.dequantize(
            self["weight"][x], s, b, group_size=self.group_size, bits=self.bits, mode=self.mode
        )


def affine_layer(module: nn.Module, at: fmt.AffineTensor, name: str = "layer") -> nn.Module:
    """nn.QuantizedLinear / nn.QuantizedEmbedding holding `at` in place of `module`.

    Raises:
        ValueError: `module` is not a Linear or Embedding (nothing to quantize).
    """
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise ValueError(
            f"{name}: a {type(module).__name__} cannot hold an affine-quantized "
            "weight (only Linear and Embedding layers can)"
        )
    n, k = at.shape
    if isinstance(module, nn.Embedding):
        layer = QuantizedEmbedding(n, k, group_size=at.group_size, bits=at.bits)
    else:
        layer = nn.QuantizedLinear(k, n, "bias" in module, group_size=at.group_size, bits=at.bits)
        if "bias" in module:
            layer.bias = module.bias
    layer.weight, layer.scales, layer.biases = at.weight, at.scales, at.biases
    return layer


class FusedTernaryLinear(TernaryLinear):
    """A TernaryLinear whose output is split at `indices`, as afm7's FusedLinear (q, k, v)."""

    @classmethod
    def from_ternary(cls, layer: TernaryLinear, indices) -> "FusedTernaryLinear":
        fused = cls(
            layer.in_features,
            layer.out_features,
            "bias" in layer,
            packing=layer.packing,
            scale=layer.scale,
            group_size=layer.group_size,
            scale_dtype=layer.scales.dtype,
            activation_bits=layer.activation_bits,
            backend=layer.backend,
        )
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


def replacement(module: nn.Module, layer: nn.Module) -> nn.Module:
    """`layer` as it must stand in for `module`: a TernaryLinear replacing a split-output
    layer (afm7's FusedLinear) splits its output too."""
    indices = split_indices(module)
    if indices is not None and type(layer) is TernaryLinear:
        return FusedTernaryLinear.from_ternary(layer, indices)
    return layer


def swap_modules(model: nn.Module, make: Callable[[str, nn.Module], Optional[nn.Module]]):
    """Replace each leaf module for which `make(path, module)` returns a module.

    A TernaryLinear standing in for a split-output layer (afm7's FusedLinear) splits too.
    """
    new = []
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        repl = make(path, m)
        if repl is not None:
            new.append((path, replacement(m, repl)))
    if new:
        model.update_modules(tree_unflatten(new))
    return model


def ternarize_model(
    model: nn.Module,
    packing: str = "compact",
    scale: str = "tensor",
    group_size: Optional[int] = None,
    activation_bits: Optional[int] = None,
    skip=("lm_head",),
) -> nn.Module:
    """Swap the float Linear layers of `linear_paths` (except `skip`) for absmean-ternarized
    TernaryLinear layers; what mlx-lm's quantize_model leaves float stays float."""
    paths = linear_paths(model)

    def make(path, m):
        if (
            path in paths
            and isinstance(m, nn.Linear)
            and not any(path.split(".")[-1] == s for s in skip)
        ):
            return TernaryLinear.from_linear(m, packing, scale, group_size, activation_bits)
        return None

    return swap_modules(model, make)


def ternary_layers(model: nn.Module):
    return [(p, m) for p, m in model.named_modules() if isinstance(m, TernaryLinear)]


def model_quantization(model: nn.Module) -> fmt.QuantizationConfig:
    """The ternary format's `quantization` section describing a model's ternary and affine layers."""
    layers = [m for _, m in ternary_layers(model)]
    if not layers:
        raise ValueError("the model has no TernaryLinear layers to save")
    first = layers[0]
    # A layer narrower than one group has row-shaped scales: take the group from any layer.
    groups = {m.group_size for m in layers if m.group_size}
    group = max(groups) if groups else None
    affine = {
        p: {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
        for p, m in model.named_modules()
        if type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedEmbedding)
    }
    # llama.cpp tables kept as blocks (runtime/cpu/layers.py GGMLEmbedding / GGMLLinear)
    affine.update({p: m.entry for p, m in model.named_modules() if hasattr(m, "ggml_type")})
    # (not mlx-lm's own subclasses)
    q8k = first.activation_bits == fmt.Q8K
    return fmt.QuantizationConfig(
        packing=first.packing,
        scale="group" if group else first.scale,
        group_size=group,
        activation_bits=None if q8k else first.activation_bits,
        activations="q8k" if q8k else "model",
        layers=affine,
    )
