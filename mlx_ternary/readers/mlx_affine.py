"""Reader for MLX 2-bit affine packs whose weights are exactly ternary.

A stock MLX 2-bit affine layer stores codes q in {0..3}, 16 per uint32, lowest bits
first, and per group of g input columns w = scale * q + bias. The pack is ternary
exactly when no code is 3 and bias == -scale in every group: then t = q - 1 and
s = scale. The codes are already the native "fast" layout, so repacking is lossless.

Ternary-Bonsai ships such packs (g128). Bonsai-2 ships mlx-lm `prism_hadamard_qwen35`
packs: the same codes with a signed blockwise Walsh-Hadamard rotation folded into the
input axis. Those keep their rotation: the native model is mlx-lm's class with each
HadamardQuantizedLinear swapped for a HadamardTernaryLinear (rotation, then ternary
matmul); embeddings and sign vectors stay as stored.
"""

from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import FormatError
from ..format import GROUP_SIZES, PackedTernary, QuantizationConfig, unpack_fast
from ..nn import TernaryLinear, swap_modules
from .common import Source, read_sanitized, sanitized_index, shard_files, tensor_index

HADAMARD_MODEL_TYPE = "prism_hadamard_qwen35"
HADAMARD_QUANTIZATION = {"bits": 2, "group_size": 128, "mode": "affine"}


def _quant(config: dict) -> dict:
    q = config.get("quantization") or config.get("quantization_config") or {}
    return q if isinstance(q, dict) else {}


def detect(config: dict) -> bool:
    """An MLX affine pack at 2 bits (not an mlx-ternary native config)."""
    q = _quant(config)
    return (q.get("bits") == 2 and q.get("mode", "affine") == "affine"
            and "format" not in q)


def is_hadamard(config: dict) -> bool:
    return config.get("model_type") == HADAMARD_MODEL_TYPE


def ternary_codes(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                  name: str) -> Optional[np.ndarray]:
    """Trits (N, K) of a 2-bit affine weight if it is exactly ternary, else None.

    weight: (N, K/16) uint32; scales, biases: (N, K/g) float32.
    """
    if not np.array_equal(biases, -scales):
        return None
    t = unpack_fast(weight, weight.shape[1] * 16)  # codes - 1, so code 3 reads as 2
    if (t > 1).any():
        return None
    return t


def _reduce_scales(s: np.ndarray, g: int, name: str) -> Tuple[np.ndarray, Optional[int]]:
    """The coarsest exact native scales for per-group scales s (N, K/g)."""
    if (s == s[:1, :1]).all():
        return s[:1, :1], None
    if (s == s[:, :1]).all():
        return s[:, :1], None
    if g not in GROUP_SIZES:
        raise FormatError(f"{name}: its scales change every {g} columns, and the native "
                          f"format's groups are {GROUP_SIZES}; this pack cannot be "
                          "repacked losslessly")
    return s, g


def _np32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)) if a.dtype == mx.bfloat16 else np.array(a)


def iter_native(model_path: Path, config: dict, linears: Dict[str, tuple], packing: str,
                sanitize=None, embeddings=()) -> Iterator[Tuple[str, object]]:
    """(module path, PackedTernary) for ternary layers, (name, array) for the rest.

    Args:
        linears: {module path: (in, out, has_bias)} that become TernaryLinear.
        sanitize: applied to each raw tensor (as a one-entry dict) first.
        embeddings: module paths kept as stored (Hadamard-rotated packed embeddings).
    """
    index, renamed = sanitized_index(shard_files(model_path), sanitize)
    q = _quant(config)
    for name in sorted(renamed):
        path, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases") and f"{path}.weight" in renamed \
                and path not in embeddings:
            continue  # read with its weight
        arr = read_sanitized(name, index, renamed, sanitize)
        if leaf == "signs" and mx.any((arr != 1) & (arr != -1)).item():
            raise FormatError(f"{model_path.name}: {name}: Hadamard signs must be -1 or +1")
        if leaf != "weight" or f"{path}.scales" not in renamed or path in embeddings:
            yield name, arr
            continue
        scales = read_sanitized(f"{path}.scales", index, renamed, sanitize)
        biases = read_sanitized(f"{path}.biases", index, renamed, sanitize)
        own = q.get(path.removeprefix("language_model."), q.get(path))
        own = own if isinstance(own, dict) else {}
        bits, g = own.get("bits", q.get("bits", 2)), own.get("group_size", q.get("group_size", 64))
        label = f"{model_path.name}: {path}"
        t = None
        if bits == 2 and path in linears:
            s32, b32 = _np32(scales), _np32(biases)
            t = ternary_codes(np.array(arr), s32, b32, label)
        if t is None and embeddings:
            raise FormatError(f"{label}: the pack's weights are not exactly ternary (a code "
                              "is 3 or a bias is not -scale); it cannot become a ternary model")
        if t is None:  # not ternary (or not a linear layer): keep it exactly, as floats
            w = mx.dequantize(arr, scales.astype(mx.float32), biases.astype(mx.float32),
                              group_size=g, bits=bits)
            yield f"{path}.weight", w
            continue
        k, n, _ = linears[path]
        if t.shape != (n, k):
            raise FormatError(f"{label}: packed weight holds ({t.shape[0]}, {t.shape[1]}), "
                              f"the config expects ({n}, {k})")
        s, gs = _reduce_scales(np.array(scales) if scales.dtype != mx.bfloat16 else s32, g, label)
        if packing == "fast":  # the codes already are the fast layout
            pt = PackedTernary("fast", np.array(arr), s, n, k, gs)
        else:
            pt = PackedTernary.from_trits(t, s, packing, gs, name=label)
        yield path, pt


def group_size(config: dict) -> Optional[int]:
    g = _quant(config).get("group_size", 64)
    return g if g in GROUP_SIZES else None


def quantization(packing: str, groups) -> QuantizationConfig:
    """The native quantization section for layers with these group sizes (None: row/tensor)."""
    groups = set(groups) - {None}
    if len(groups) > 1:
        raise FormatError(f"the pack mixes scale group sizes {sorted(groups)}; the native "
                          "format holds one group size per model")
    g = groups.pop() if groups else None
    return QuantizationConfig(packing=packing, scale="group" if g else "row", group_size=g)


def read(model_path: Path, config: dict, linears: Dict[str, tuple], packing: str,
         sanitize=None, embeddings=()) -> Tuple[Dict[str, mx.array], QuantizationConfig]:
    """All tensors in native naming (for load())."""
    weights, groups = {}, set()
    for name, item in iter_native(model_path, config, linears, packing, sanitize, embeddings):
        if isinstance(item, PackedTernary):
            groups.add(item.group_size)
            weights[f"{name}.packed"] = mx.array(item.packed)
            weights[f"{name}.scales"] = mx.array(item.scales)
        else:
            weights[name] = item
    return weights, quantization(packing, groups)


# --------------------------------------------------------------------------- #
# prism_hadamard_qwen35: keep the rotation
# --------------------------------------------------------------------------- #


class HadamardTernaryLinear(TernaryLinear):
    """TernaryLinear whose input gets the pack's signed blockwise Hadamard rotation.

    Parameters: packed, scales (as TernaryLinear) and signs (K,) float32 of +-1.
    """

    def __init__(self, input_dims: int, output_dims: int, block: int, **kwargs):
        super().__init__(input_dims, output_dims, False, **kwargs)
        self.block = block
        if block:
            self.signs = mx.ones((input_dims,), dtype=mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        if self.block:
            from mlx_lm.models.prism_hadamard_qwen35 import hadamard_rotate

            x = hadamard_rotate(x, self.block, self.signs)
        return super().__call__(x)


def hadamard_model_config(config: dict) -> dict:
    """The config mlx-lm's class accepts (its own quantization block restored)."""
    return {**config, "quantization": dict(HADAMARD_QUANTIZATION)}


def hadamard_paths(config: dict) -> Tuple[Dict[str, int], Tuple[str, ...]]:
    """({linear path: block}, embedding paths), both prefixed as the model's parameters."""
    linear, emb = {}, []
    for r in config.get("modules", []):
        path = f"language_model.{r['path']}"
        if r.get("embedding"):
            emb.append(path)
        else:
            linear[path] = r["block"]
    return linear, tuple(emb)


def hadamard_linears(model: nn.Module, config: dict) -> Dict[str, tuple]:
    blocks, _ = hadamard_paths(config)
    mods = dict(model.named_modules())
    out = {}
    for path in blocks:
        w = mods[path].weight
        out[path] = (w.shape[1] * 16, w.shape[0], False)
    return out


def hadamard_sanitize(model: nn.Module):
    """Per-tensor sanitize for the packs: qwen3_5's renaming (signs are checked on read)."""
    from mlx_lm.models import qwen3_5

    return lambda weights: qwen3_5.Model.sanitize(model, weights)


def swap_hadamard(model: nn.Module, weights: Dict[str, mx.array], config: dict,
                  quant: QuantizationConfig, backend=None) -> None:
    """Swap HadamardQuantizedLinear layers that have packed trits for HadamardTernaryLinear."""
    from ..format import scale_kind

    blocks, _ = hadamard_paths(config)
    linears = hadamard_linears(model, config)

    def make(path, module):
        if path not in blocks or f"{path}.packed" not in weights:
            return None
        k, n, _ = linears[path]
        scales = weights[f"{path}.scales"]
        return HadamardTernaryLinear(k, n, blocks[path], packing=quant.packing,
                                     scale=scale_kind(tuple(scales.shape), n),
                                     group_size=quant.group_size, scale_dtype=scales.dtype,
                                     activation_bits=quant.activation_bits, backend=backend)

    swap_modules(model, make)


def source(model_path: Path, config: dict, model: nn.Module, linears: Dict[str, tuple],
           packing: str, sanitize=None) -> Source:
    """A convert Source for an MLX 2-bit affine pack (plain or Hadamard-rotated)."""
    embeddings = ()
    kind = "MLX 2-bit affine ternary pack"
    if is_hadamard(config):
        linears = hadamard_linears(model, config)
        _, embeddings = hadamard_paths(config)
        sanitize = hadamard_sanitize(model)
        kind = "MLX prism_hadamard_qwen35 ternary pack (rotation kept)"
    names = list(tensor_index(shard_files(model_path)))
    n_items = sum(1 for n in names if not (n.endswith((".scales", ".biases"))
                                           and n.rpartition(".")[0] + ".weight" in names))
    arch = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    return Source(
        path=model_path, kind=kind, config=arch, count=n_items,
        items=lambda: iter_native(model_path, config, linears, packing, sanitize, embeddings),
        group_size=group_size(config), tokenizer_dir=model_path,
    )
