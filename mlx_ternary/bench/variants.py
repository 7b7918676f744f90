"""Building the representations bench compares, each exact and sharing what it can.

compact, fast  the native packings, as `load()` runs them on this device
q2, q4         stock MLX affine quantization, group 64, nn.QuantizedLinear
bf16, f32      the dequantized float weights, nn.Linear (bf16 runs in bfloat16)
"""

from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import format as fmt
from ..checkpoint.load import get_classes, runtime_packing
from ..errors import TernaryError
from ..memory import available_memory
from ..runtime import dispatch
from ..runtime.cpu.tables import HalfEmbedding, adopt
from ..runtime.layers import TernaryLinear, swap_modules, ternary_layers
from . import ceiling
from .report import FormatResult

FORMATS = ("compact", "fast", "q2", "q4", "bf16", "f32")
DEFAULT_FORMATS = ("compact", "fast", "q2", "q4", "bf16")
Q_GROUP_SIZE = ceiling.Q_GROUP_SIZE


def held_packing(stored: str, backend: Optional[str] = None) -> str:
    """The packing `load()` holds in memory for a checkpoint stored in `stored` (no packing
    asked for): load's own rule, `checkpoint.load.runtime_packing`."""
    return runtime_packing(None, backend) or stored


def _group_scales(
    scales: mx.array, out_features: int, in_features: int, group_size: Optional[int]
) -> mx.array:
    """Ternary scales of any granularity -> one per (row, group of Q_GROUP_SIZE)."""
    groups = in_features // Q_GROUP_SIZE
    if scales.shape[1] != 1:
        scales = mx.repeat(scales, group_size // Q_GROUP_SIZE, axis=1)[:, :groups]
    return mx.contiguous(mx.broadcast_to(scales, (out_features, groups)))


def fast_to_q4(packed: mx.array) -> mx.array:
    """2-bit codes (N, K/16) uint32 -> the same codes in 4-bit fields (N, K/8) uint32.

    Each half word holds 8 codes; spreading 2-bit fields to 4-bit ones is three
    shift-or-mask steps (8 codes in 16 bits -> 8 codes in 32 bits).
    """

    def spread(x):
        x = (x | (x << 8)) & 0x00FF00FF
        x = (x | (x << 4)) & 0x0F0F0F0F
        return (x | (x << 2)) & 0x33333333

    lo, hi = spread(packed & 0xFFFF), spread(packed >> 16)
    return mx.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1).astype(mx.uint32)


def make_layer(layer: TernaryLinear, name: str, backend=None) -> nn.Module:
    """The `name` representation of a ternary layer, exact; shares arrays where it can."""
    n, k = layer.out_features, layer.in_features
    bias = layer.get("bias")
    fast = layer.packed if layer.packing == "fast" else None
    if name in ("compact", "fast"):
        packing = held_packing(name, backend)
        new = TernaryLinear(
            k,
            n,
            bias is not None,
            packing=packing,
            scale=layer.scale,
            group_size=layer.group_size,
            scale_dtype=layer.scales.dtype,
            activation_bits=layer.activation_bits,
            backend=backend,
        )
        new.packed = (
            layer.packed
            if packing == layer.packing
            else fmt.pack_mx(layer.trits(), packing, layer.group_size)
        )
        new.scales = layer.scales
    elif name in ("q2", "q4"):
        bits = ceiling.Q_BITS[name]
        new = nn.QuantizedLinear(k, n, bias is not None, group_size=Q_GROUP_SIZE, bits=bits)
        # The fast packing is bit for bit MLX's 2-bit layout (k % 64 == 0: no padding).
        codes = fast if fast is not None else fmt.pack_fast_mx(layer.trits())
        new.weight = codes if bits == 2 else fast_to_q4(codes)
        new.scales = _group_scales(layer.scales, n, k, layer.group_size)
        new.biases = -new.scales
    else:
        dtype = mx.bfloat16 if name == "bf16" else mx.float32
        new = nn.Linear(k, n, bias is not None)
        new.weight = layer.dequantize(mx.float32).astype(dtype)
    if bias is not None:
        new.bias = bias if name != "bf16" else bias.astype(mx.bfloat16)
    return new


def check_format(name: str, layers) -> str:
    """Why `name` cannot represent these layers, or "" when it can."""
    if name in ("q2", "q4"):
        for path, m in layers:
            if m.in_features % Q_GROUP_SIZE:
                return (
                    f"{path}: in_features {m.in_features} is not a multiple of MLX's "
                    f"group size {Q_GROUP_SIZE}"
                )
    return ""


def _unique_bytes(arrays) -> int:
    seen = {}
    for a in arrays:
        seen[id(a)] = a.nbytes
    return sum(seen.values())


def _layer_arrays(m: nn.Module, dtype) -> list:
    """The arrays a layer holds: parameters, plus the reference fast path's unit scale/bias
    arrays (the native and Metal kernels need none)."""
    arrays = [a for _, a in tree_flatten(m.parameters())]
    return arrays + (m.runtime_arrays(dtype) if isinstance(m, TernaryLinear) else [])


def _embedding_overcount(model: nn.Module, paths) -> int:
    """Bytes of untied embedding tables a decode step does not read (it reads one row)."""
    leaves = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    tied = not any(p.split(".")[-1] == "lm_head" for p, _ in leaves)
    if tied:
        return 0
    return sum(
        m.weight.nbytes - m.weight.nbytes // m.weight.shape[0]
        for _, m in leaves
        if isinstance(m, (nn.Embedding, HalfEmbedding))
    )


def build_variants(
    base: nn.Module,
    config: dict,
    model_path: Path,
    formats: List[str],
    backend=None,
    progress: Callable[[str], None] = lambda s: None,
):
    """{format: (model or None, FormatResult)} sharing the base's non-ternary arrays."""
    model_class, args_class = get_classes(config, model_path)
    layers = ternary_layers(base)
    if not layers:
        raise TernaryError(f"{model_path}: the model has no ternary layers to compare")
    paths = {p for p, _ in layers}
    rest = [(k, v) for k, v in tree_flatten(base.parameters()) if k.rsplit(".", 1)[0] not in paths]
    float_dtype = next(
        (v.dtype for _, v in rest if mx.issubdtype(v.dtype, mx.floating) and v.ndim == 1),
        mx.float32,
    )  # the norms' (tables may stay float16)
    out = {}
    for name in formats:
        res = FormatResult(name, loads=False)
        out[name] = (None, res)
        res.reason = check_format(name, layers)
        estimate = sum(ceiling.linear_bytes(linear_shape(m), name) for _, m in layers)
        free, _ = available_memory(free=True)
        if not res.reason and estimate > free:
            res.reason = (
                f"needs about {estimate / 1e9:.1f} GB for its linear layers, "
                f"{free / 1e9:.1f} GB available"
            )
        if res.reason:
            continue
        progress(f"building {name}")
        dtype = mx.bfloat16 if name == "bf16" else float_dtype
        try:
            model, new = _assemble(
                model_class(args_class.from_dict(config)), layers, rest, name, dtype, backend
            )
        except (MemoryError, RuntimeError, ValueError) as e:  # e.g. an allocation refused
            res.reason = f"building it failed: {str(e).splitlines()[0]}"
            continue
        res.loads = True
        res.dtype = str(dtype).split(".")[-1]
        res.runs_as = _runs_as(name, new, backend)
        # The fast path's unit scale/bias arrays are load-time work: built here, counted.
        lin = [a for m in new.values() for a in _layer_arrays(m, dtype)]
        mx.eval(lin)
        res.linear_bytes = _unique_bytes(lin)
        res.linear_weights = sum(m.in_features * m.out_features for _, m in layers)
        res.weight_bytes = _unique_bytes([a for _, a in tree_flatten(model.parameters())] + lin)
        res.read_bytes = res.weight_bytes - _embedding_overcount(model, paths)
        out[name] = (model, res)
    return out


def _assemble(model: nn.Module, layers, rest, name: str, dtype, backend):
    """Swap `name` layers into a fresh (lazy) model and give it the shared float arrays."""
    new = {}
    for path, m in layers:
        new[path] = make_layer(m, name, backend)
        mx.eval(new[path].parameters())
    swap_modules(model, lambda p, _m: new.get(p))
    # As load() builds them: on the native backend, native attention and float16 tables.
    native = name in ("compact", "fast") and dispatch.resolve_backend(backend) == "native"
    keep = adopt(model, dict(rest)) if native else set()
    model.load_weights(
        [
            (
                k,
                v.astype(dtype)
                if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype and k not in keep
                else v,
            )
            for k, v in rest
        ],
        strict=False,
    )
    mx.eval(model.parameters())
    model.eval()
    return model, new


def linear_shape(m: TernaryLinear) -> ceiling.LinearShape:
    return ceiling.LinearShape(
        m.out_features, m.in_features, tuple(m.scales.shape), m.scales.dtype.size, m.group_size
    )


def _runs_as(name: str, new: Dict[str, nn.Module], backend) -> str:
    m = next(iter(new.values()))
    if isinstance(m, TernaryLinear):
        how = f"{m.packing} packing, {dispatch.resolve_backend(backend)} backend"
        return how + (", repacked at load" if m.packing != name else "")
    if isinstance(m, nn.QuantizedLinear):
        return f"mx.quantized_matmul {m.bits}-bit g{m.group_size}"
    return f"nn.Linear {m.weight.dtype}".replace("mlx.core.", "")


def model_shapes(base: nn.Module):
    """(ternary layer shapes, float parameter elements a decode step reads) of `base`."""
    layers = ternary_layers(base)
    paths = {p for p, _ in layers}
    rest = [v for k, v in tree_flatten(base.parameters()) if k.rsplit(".", 1)[0] not in paths]
    unread = _embedding_overcount(base, paths) // _float_size(rest)
    return [linear_shape(m) for _, m in layers], sum(v.size for v in rest) - unread


def _float_size(arrays) -> int:
    return next((a.dtype.size for a in arrays if mx.issubdtype(a.dtype, mx.floating)), 4)
