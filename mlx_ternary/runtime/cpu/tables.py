"""Float tables kept in the dtype the checkpoint stores, off the GPU.

On the CPU, `load()` used to widen every float parameter to float32 (MLX's CPU float16 and
bfloat16 matmuls are many times slower): for a 32000 x 2048 embedding plus output layer that
is 524 MB where the file (and llama.cpp) holds 262 MB. With the native backend the tables stay
float16/bfloat16 - exact, they are what the file stores - and run through the native dense
kernel; activations stay float32:

    HalfEmbedding  an nn.Embedding: rows gathered then widened to float32; `as_linear`
                   (tied output layer) is the native x @ W.T
    HalfLinear     an nn.Linear (the untied output layer, other float linears) the same way
    GGMLEmbedding, GGMLLinear  llama.cpp's Q8_0 / Q4_K / Q5_K / Q6_K tables kept as their
                   GGUF blocks, run by the native kernels (runtime/ggml.py the twin)

Both are subclasses of the stock classes, so mlx-lm's isinstance checks, `quantize_model`,
LoRA/DoRA and `save_model` treat them as the layers they replace.

`adopt(model, weights, dtype)` is what `load()` does on the native backend: these tables, the
native attention (attention.py) and SwiGLU (activation.py).
"""

from typing import Dict, Optional, Set

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ...format import GGML_MODE, GGMLTensor, check_ggml_type
from .. import ggml
from . import activation, attention, block, dense_matmul, ggml_dequantize, ggml_matmul
from . import available as native_available

HALF = (mx.float16, mx.bfloat16)


def _stock(cls, weight: mx.array, **kw) -> nn.Module:
    """A stock `cls` (nn.Embedding / nn.Linear) holding `weight`, without a random init."""
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    m.weight = weight
    m.update(kw)
    return m


class HalfEmbedding(nn.Embedding):
    """An nn.Embedding whose table stays float16/bfloat16; lookups and `as_linear` give
    float32 (the native dense kernel).

    To mlx-lm it is an nn.Embedding: the parameter is `weight`, LoRA/DoRA wrap it, and
    `to_quantized` (mlx-lm's quantize_model) quantizes the float32 widening of the table,
    which is exactly what the reference backend holds, so both backends get the same
    QuantizedEmbedding (scales in float32, the dtype activations run in).
    """

    def __init__(self, num_embeddings: int, dims: int, dtype=mx.float16):
        nn.Module.__init__(self)
        self.weight = mx.zeros((num_embeddings, dims), dtype=dtype)  # (vocab, dims)

    def __call__(self, x: mx.array) -> mx.array:
        return self.weight[x].astype(mx.float32)

    def as_linear(self, x: mx.array) -> mx.array:
        return dense_matmul(x, self.weight)

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        wide = _stock(nn.Embedding, self.weight.astype(mx.float32))
        return wide.to_quantized(group_size, bits, mode=mode, quantize_input=quantize_input)


class HalfLinear(nn.Linear):
    """An nn.Linear whose weight stays float16/bfloat16 (bias in float32), run through the
    native dense kernel; `to_quantized` as HalfEmbedding's (the float32 widening)."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool, dtype=mx.float16):
        nn.Module.__init__(self)
        self.weight = mx.zeros((output_dims, input_dims), dtype=dtype)  # (out, in)
        if bias:
            self.bias = mx.zeros((output_dims,))

    def __call__(self, x: mx.array) -> mx.array:
        y = dense_matmul(x, self.weight)
        return y + self.bias if "bias" in self else y

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        extra = {"bias": self.bias} if "bias" in self else {}
        wide = _stock(nn.Linear, self.weight.astype(mx.float32), **extra)
        return wide.to_quantized(group_size, bits, mode=mode, quantize_input=quantize_input)


def keep_half_tables(model: nn.Module, weights: Dict[str, mx.array]) -> Set[str]:
    """Swap each nn.Embedding / float nn.Linear whose stored weight is float16/bfloat16 for
    its Half twin; returns the weight names that must keep their stored dtype."""
    kept, new = set(), []
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        w: Optional[mx.array] = weights.get(f"{path}.weight")
        if type(m) not in (nn.Embedding, nn.Linear) or w is None or w.dtype not in HALF:
            continue
        if isinstance(m, nn.Embedding):
            new.append((path, HalfEmbedding(*w.shape, dtype=w.dtype)))
        else:
            new.append((path, HalfLinear(w.shape[1], w.shape[0], "bias" in m, dtype=w.dtype)))
        kept.add(f"{path}.weight")
    if new:
        model.update_modules(tree_unflatten(new))
    return kept


def adopt(
    model: nn.Module, weights: Dict[str, mx.array], dtype=None, backend: str = "native"
) -> Set[str]:
    """Prepare a freshly built model for `backend` (resolved): on the native one, native
    attention, SwiGLU and fused decoder blocks, and (unless the caller asked for a float dtype) its float16/bfloat16 tables as
    stored; other backends change nothing. Returns the weight names that keep their stored
    dtype."""
    if backend != "native":
        return set()
    attention.install(model)
    activation.install(model)
    block.install(model)
    return keep_half_tables(model, weights) if dtype is None else set()


# --------------------------------------------------------------------------- #
# llama.cpp's quantized tables, kept as their GGUF blocks
# --------------------------------------------------------------------------- #


def _dequantize(blocks: mx.array, type_name: str, k: int) -> mx.array:
    if native_available():
        return ggml_dequantize(blocks, type_name, k)
    return ggml.dequantize(blocks, type_name, k)


def _matmul(x: mx.array, blocks: mx.array, type_name: str, k: int, llama: bool) -> mx.array:
    if native_available():
        return ggml_matmul(x, blocks, type_name, k, llama=llama)
    return ggml.matmul(x, blocks, type_name, k, llama)


class _GGMLTable:
    """What GGMLEmbedding and GGMLLinear share: `weight` holds the blocks (N, row_bytes)
    uint8 exactly as the GGUF file stores them (format.GGMLTensor); `ggml_type` names the
    block type, `llama` picks llama.cpp's numerics for the matvec (its activation
    quantization and integer dot products) over float ones."""

    def _init_table(self, n: int, k: int, type_name: str, llama: bool):
        t = check_ggml_type(type_name)
        self.weight = mx.zeros((n, k // t.block * t.bytes), dtype=mx.uint8)
        self.ggml_type, self.in_features, self.llama = type_name, k, llama

    @property
    def entry(self) -> dict:
        return {"mode": GGML_MODE, "type": self.ggml_type}

    def dequantize(self) -> mx.array:
        """The (N, K) float32 weight, exactly what the blocks encode."""
        return _dequantize(self.weight, self.ggml_type, self.in_features)

    def _product(self, x: mx.array) -> mx.array:
        return _matmul(x, self.weight, self.ggml_type, self.in_features, self.llama)


class GGMLEmbedding(_GGMLTable, nn.Embedding):
    """An nn.Embedding over llama.cpp blocks: a lookup dequantizes the gathered rows (float32,
    exact); `as_linear` (a tied output layer) multiplies by the blocks as stored."""

    def __init__(self, num_embeddings: int, dims: int, type_name: str, llama: bool = True):
        nn.Module.__init__(self)
        self._init_table(num_embeddings, dims, type_name, llama)

    def __call__(self, x: mx.array) -> mx.array:
        return _dequantize(self.weight[x], self.ggml_type, self.in_features)

    def as_linear(self, x: mx.array) -> mx.array:
        return self._product(x)

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        wide = _stock(nn.Embedding, self.dequantize())
        return wide.to_quantized(group_size, bits, mode=mode, quantize_input=quantize_input)


class GGMLLinear(_GGMLTable, nn.Linear):
    """An nn.Linear (an untied output layer) over llama.cpp blocks kept as stored."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool, type_name: str, llama=True):
        nn.Module.__init__(self)
        self._init_table(output_dims, input_dims, type_name, llama)
        if bias:
            self.bias = mx.zeros((output_dims,))

    def __call__(self, x: mx.array) -> mx.array:
        y = self._product(x)
        return y + self.bias if "bias" in self else y

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        extra = {"bias": self.bias} if "bias" in self else {}
        wide = _stock(nn.Linear, self.dequantize(), **extra)
        return wide.to_quantized(group_size, bits, mode=mode, quantize_input=quantize_input)


def ggml_layer(module: nn.Module, gt: GGMLTensor, llama: bool, name: str = "layer") -> nn.Module:
    """GGMLEmbedding / GGMLLinear holding `gt` in place of `module` (an Embedding / Linear).

    Raises:
        ValueError: `module` is neither.
    """
    n, k = gt.shape
    if isinstance(module, nn.Embedding):
        layer = GGMLEmbedding(n, k, gt.type, llama)
    elif isinstance(module, nn.Linear):
        layer = GGMLLinear(k, n, "bias" in module, gt.type, llama)
        if "bias" in module:
            layer.bias = module.bias
    else:
        raise ValueError(
            f"{name}: a {type(module).__name__} cannot hold a {gt.type} table (only Linear "
            "and Embedding layers can)"
        )
    layer.weight = gt.blocks if isinstance(gt.blocks, mx.array) else mx.array(gt.blocks)
    return layer
