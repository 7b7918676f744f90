"""The model a checkpoint's config describes, and the checks that hold a tensor stream to it.

Every reader builds the same thing from config.json: mlx-lm's architecture class with
lazy (never evaluated) parameters, the "skeleton". Its Linear-like layers are where
ternary weights may go; its parameter shapes are what each streamed item must match.
`Checker` is the one place those shapes are checked, for load and convert alike.

mlx-lm's own `quantization` block (global {group_size, bits, mode} plus per-layer
entries keyed by module path) decides which stored weights are MLX affine-quantized;
`affine_tensor` reads one, `stream` groups a checkpoint's tensors into items.
"""

from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ...errors import FormatError, TernaryError, read_json
from ...format import AffineTensor, GGMLTensor, PackedTernary, affine_entry, row_blocks
from ...runtime.linears import linear_paths
from .common import read_sanitized, sanitized_index, shard_files
from .config_check import check_args, check_scale

HADAMARD_MODEL_TYPE = "prism_hadamard_qwen35"
HADAMARD_QUANTIZATION = {"bits": 2, "group_size": 128, "mode": "affine"}
QUANT_KEYS = ("quantization", "quantization_config")
ACTIVATIONS = {"relu2": nn.relu2, "silu": nn.silu, "gelu": nn.gelu, "relu": nn.relu}


# --------------------------------------------------------------------------- #
# config.json
# --------------------------------------------------------------------------- #


def read_config(model_path: Path) -> dict:
    path = model_path / "config.json"
    if not path.exists():
        raise TernaryError(
            f"{model_path}: no config.json; a model directory needs config.json, "
            "its safetensors weights and tokenizer files"
        )
    config = read_json(path)
    if not isinstance(config, dict):
        raise FormatError(f"{path}: not a JSON object; config.json maps field names to values")
    if not isinstance(config.get("model_type"), str):
        raise FormatError(
            f"{path}: model_type is {config.get('model_type')!r}; it names the architecture "
            "(a string such as 'llama')"
        )
    return normalize_config(config)


def normalize_config(config: dict) -> dict:
    """Config spellings of newer transformers that mlx-lm's ModelArgs do not read."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" not in config:
        config = {**config, "rope_theta": rope.get("rope_theta", 10000.0)}
        if rope.get("rope_type", "default") != "default" and not config.get("rope_scaling"):
            config["rope_scaling"] = rope
    return config


def architecture(config: dict) -> dict:
    """The config without foreign quantization blocks (what a converted checkpoint keeps)."""
    return {k: v for k, v in config.items() if k not in QUANT_KEYS}


def config_file(model_path: Path) -> Path:
    """Where a checkpoint's config comes from: config.json, or a single file's metadata."""
    return model_path / "config.json" if model_path.is_dir() else model_path


def weight_bytes(model_path: Path) -> int:
    """Bytes of a checkpoint's weight files (the file itself for a single-file one)."""
    if model_path.is_file():
        return model_path.stat().st_size
    return sum(f.stat().st_size for f in model_path.glob("*.safetensors") if f.is_file())


def get_classes(config: dict, model_path: Path):
    """mlx-lm's (Model, ModelArgs) for the config, its fields checked against ModelArgs."""
    # mlx-lm's private: no public (Model, ModelArgs) lookup with its model_type remapping
    from mlx_lm.utils import _get_classes

    try:
        classes = _get_classes(config)
    except ValueError:
        raise FormatError(
            f"{config_file(model_path)}: model_type {config['model_type']!r} "
            "is not an architecture the installed mlx-lm knows; upgrade mlx-lm "
            "or check the model"
        ) from None
    check_args(config, classes[1], config_file(model_path))
    return classes


# What a model class raises on a config it cannot build (after check_args, the fields'
# combinations it does not model). TernaryError is a ValueError and passes through.
_BUILD_ERRORS = (ValueError, TypeError, AssertionError, ArithmeticError, KeyError, IndexError)


def build_model(model_class, args_class, cfg: dict, model_path: Path) -> nn.Module:
    """`model_class(args_class.from_dict(cfg))`, or one FormatError naming the config."""
    try:
        return model_class(args_class.from_dict(cfg))
    except TernaryError:
        raise
    except _BUILD_ERRORS as e:
        raise FormatError(
            f"{config_file(model_path)}: mlx-lm cannot build a {cfg.get('model_type')} "
            f"model from this config ({type(e).__name__}: {e}); fix the config"
        ) from None


def is_hadamard(config: dict) -> bool:
    return config.get("model_type") == HADAMARD_MODEL_TYPE


def hadamard_paths(config: dict) -> Tuple[Dict[str, int], Tuple[str, ...]]:
    """prism_hadamard_qwen35: ({linear path: rotation block}, embedding paths)."""
    if not is_hadamard(config):
        return {}, ()
    linear, emb = {}, []
    for r in config.get("modules", []):
        path = f"language_model.{r['path']}"
        if r.get("embedding"):
            emb.append(path)
        else:
            linear[path] = r["block"]
    return linear, tuple(emb)


# --------------------------------------------------------------------------- #
# The skeleton: mlx-lm's class, parameters lazy
# --------------------------------------------------------------------------- #


class GatedMLP(nn.Module):
    """mlx-lm bitnet's MLP with the activation the checkpoint names (its class fixes relu2)."""

    def __init__(self, mlp: nn.Module, act):
        super().__init__()
        self.gate_proj, self.up_proj = mlp.gate_proj, mlp.up_proj
        self.down_proj, self.ffn_sub_norm = mlp.down_proj, mlp.ffn_sub_norm
        self._act = act

    def __call__(self, x):
        return self.down_proj(self.ffn_sub_norm(self._act(self.gate_proj(x)) * self.up_proj(x)))


def skeleton(config: dict, model_path: Path) -> nn.Module:
    """mlx-lm's model for `config`; nothing is allocated until a parameter is evaluated."""
    cfg = (
        {**config, "quantization": dict(HADAMARD_QUANTIZATION)}
        if is_hadamard(config)
        else architecture(config)
    )
    model_class, args_class = get_classes(cfg, model_path)
    check_scale(cfg, config_file(model_path), weight_bytes(model_path))
    model = build_model(model_class, args_class, cfg, model_path)
    act = config.get("hidden_act", "relu2")
    if config.get("model_type") == "bitnet" and act != "relu2":  # 1bitLLM: silu
        if act not in ACTIVATIONS:
            raise FormatError(
                f"{model_path / 'config.json'}: hidden_act {act!r} is not "
                f"supported for BitNet models (supported: {', '.join(ACTIVATIONS)})"
            )
        for layer in model.layers:
            layer.mlp = GatedMLP(layer.mlp, ACTIVATIONS[act])
    return model


def ternary_targets(model: nn.Module, config: dict) -> Dict[str, tuple]:
    """{module path: (in, out, has_bias)} of the layers that may hold ternary weights."""
    blocks, _ = hadamard_paths(config)
    if not blocks:
        return linear_paths(model)
    mods = dict(model.named_modules())
    return {p: (mods[p].weight.shape[1] * 16, mods[p].weight.shape[0], False) for p in blocks}


# --------------------------------------------------------------------------- #
# mlx-lm's quantization block
# --------------------------------------------------------------------------- #


def quant_block(config: dict) -> dict:
    """mlx-lm's `quantization` block (its HF mirror `quantization_config` if only that has
    bits), or {} when the checkpoint has none."""
    for key in QUANT_KEYS:
        q = config.get(key)
        if isinstance(q, dict) and ("bits" in q or any(isinstance(v, dict) for v in q.values())):
            return q
    return {}


def affine_tensor(
    path: str,
    weight: mx.array,
    scales: mx.array,
    biases: Optional[mx.array],
    in_features: int,
    block: dict,
    where: str,
) -> AffineTensor:
    """One stored MLX affine triple as an AffineTensor, checked against its layer.

    The layer's own entry in the block wins; otherwise bits and group size are read off
    the shapes (as mlx-lm does: the global default can be wrong for some layers).
    """
    name = f"{where}: {path}.weight"
    entry = block.get(path, block.get(path.removeprefix("language_model.")))
    mode = (entry if isinstance(entry, dict) else block).get("mode", "affine")
    if mode != "affine" or scales.dtype == mx.uint8:
        raise FormatError(
            f"{name}: quantized in mode {mode!r} (scales {scales.dtype}); "
            "mlx-ternary keeps MLX affine layers only; dequantize that layer "
            "first (mlx_lm.convert -d)"
        )
    if biases is None:
        raise FormatError(
            f"{name}: has {path}.scales but no {path}.biases; not an MLX affine "
            "layer (a truncated or foreign checkpoint?)"
        )
    k = in_features
    if weight.dtype != mx.uint32 or weight.ndim != 2 or scales.ndim != 2 or not scales.shape[1]:
        raise FormatError(
            f"{name}: dtype {weight.dtype}, shape {tuple(weight.shape)}; an MLX "
            "affine weight is 2-D uint32"
        )
    inferred = {"group_size": k // scales.shape[1], "bits": weight.shape[1] * 32 // k}
    want = affine_entry(
        entry if isinstance(entry, dict) else inferred, f"{where}: quantization.{path}"
    )
    g, bits = want["group_size"], want["bits"]
    if (
        weight.shape[1] * 32 != k * bits
        or tuple(scales.shape) != (weight.shape[0], k // g)
        or tuple(biases.shape) != tuple(scales.shape)
    ):
        raise FormatError(
            f"{name}: shape {tuple(weight.shape)} with scales "
            f"{tuple(scales.shape)} does not hold a ({weight.shape[0]}, {k}) "
            f"weight at {bits} bits, group size {g}"
        )
    return AffineTensor(weight, scales, biases, bits, g)


def _codes(at: AffineTensor, rows: slice) -> mx.array:
    ones = mx.ones(at.scales[rows].shape, dtype=mx.float32)
    return mx.dequantize(
        at.weight[rows], ones, mx.zeros_like(ones), group_size=at.group_size, bits=at.bits
    )


def is_exact_ternary(at: AffineTensor) -> bool:
    """Every group holds codes t + 1 (0, 1 or 2) with bias == -scale: w = scale * t.

    Checked a block of rows at a time (format.row_blocks): the scratch stays small."""
    if not mx.array_equal(at.biases, -at.scales).item():
        return False
    blocks = row_blocks(*at.shape)
    if at.bits == 2:  # a code 3 has both bits of its field set
        w = at.weight
        return not any(mx.any((w[r] & (w[r] >> 1)) & 0x55555555).item() for r in blocks)
    return not any(mx.any(_codes(at, r) > 2).item() for r in blocks)


def affine_trits(at: AffineTensor, rows: Optional[slice] = None) -> np.ndarray:
    """Trits (rows, K) int8 of an exactly ternary affine layer (all rows by default),
    decoded a block of rows at a time."""
    n, k = at.shape
    rows = rows or slice(0, n)
    start, stop, _ = rows.indices(n)
    out = np.empty((stop - start, k), np.int8)
    for r in row_blocks(stop - start, k):
        part = slice(start + r.start, start + r.stop)
        out[r] = np.array(_codes(at, part).astype(mx.int8)) - 1
    return out


# --------------------------------------------------------------------------- #
# The stream
# --------------------------------------------------------------------------- #

# A reader's rule for a stored weight of a ternary target layer that is not an MLX affine
# triple: (module path, stored array, read(name) -> array) -> PackedTernary, or None to keep
# it as a plain tensor.
LinearRule = Callable[[str, mx.array, Callable[[str], mx.array]], Optional[PackedTernary]]
# ... and for an affine triple of a ternary target: (path, AffineTensor) -> PackedTernary or None.
AffineRule = Callable[[str, AffineTensor], Optional[PackedTernary]]


def affine_triples(names) -> Tuple[Dict[str, str], set]:
    """({weight name: module path} of affine triples, names read with their weight)."""
    triples, companions = {}, set()
    for name in names:
        path, _, leaf = name.rpartition(".")
        if leaf == "weight" and f"{path}.scales" in names:
            triples[name] = path
            companions.update(n for n in (f"{path}.scales", f"{path}.biases") if n in names)
    return triples, companions


def _item(name, read, names, triples, dims, targets, block, where, linear, affine):
    """One (name, item) of `stream`: an affine triple, a target layer's weight, or as stored."""
    path = name.rpartition(".")[0]
    if name in triples:
        if path not in dims:
            raise FormatError(
                f"{where}: {name} is MLX affine-quantized but {path} is "
                "not a Linear or Embedding layer of the model"
            )
        biases = read(f"{path}.biases") if f"{path}.biases" in names else None
        at = affine_tensor(
            path, read(name), read(f"{path}.scales"), biases, dims[path], block, where
        )
        pt = affine(path, at) if affine and path in targets else None
        return (path, pt) if pt is not None else (path, at)
    if linear and name.endswith(".weight") and path in targets:
        arr = read(name)
        pt = linear(path, arr, read)
        return (path, pt) if pt is not None else (name, arr)
    return name, read(name)


def stream(
    model_path: Path,
    model: nn.Module,
    targets: Dict[str, tuple],
    block: dict,
    linear: Optional[LinearRule] = None,
    affine: Optional[AffineRule] = None,
    sanitize=None,
    raw: Tuple[str, ...] = (),
    companions: Tuple[str, ...] = (),
) -> Tuple[int, Callable[[], Iterator[Tuple[str, object]]]]:
    """(item count, items()) of a safetensors checkpoint named as the model's parameters.

    Each `P.weight` with `P.scales` is an MLX affine triple: `affine(P, at)` may make it
    ternary, else it stays an AffineTensor. Any other `P.weight` of a target layer goes
    through `linear`. Modules in `raw` and everything else are yielded as stored.

    Args:
        sanitize: the model class's per-tensor `sanitize` (applied to each tensor alone).
        companions: leaf names the `linear` rule reads itself (e.g. "weight_scale").
    """
    index, renamed = sanitized_index(shard_files(model_path), sanitize)
    names = set(renamed)
    triples, read_with = affine_triples(names)
    triples = {n: p for n, p in triples.items() if p not in raw}
    read_with = {n for n in read_with if n.rpartition(".")[0] not in raw}
    read_with |= {
        n
        for n in names
        if n.rpartition(".")[2] in companions and f"{n.rpartition('.')[0]}.weight" in names
    }
    order = sorted(n for n in names if n not in read_with)
    dims = {
        p: m.weight.shape[-1]
        for p, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding))
    }
    dims.update({p: d[0] for p, d in targets.items()})
    where = model_path.name

    def read(name):
        return read_sanitized(name, index, renamed, sanitize)

    def items():
        for name in order:
            yield _item(name, read, names, triples, dims, targets, block, where, linear, affine)

    return len(order), items


class Checker:
    """Holds a stream to the model its config describes; names the tensor at fault.

    Args:
        model: the skeleton (float layers, as config.json builds it).
        targets: {path: (in, out, has_bias)} of layers that may be ternary.
    """

    def __init__(self, model: nn.Module, targets: Dict[str, tuple], where: Path):
        self.where = where
        self.shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
        self.modules = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
        self.targets = targets
        self.seen = set()
        self.ternary_count = 0

    def _own(self, path: str) -> None:
        # The layer's stored parameters (weight, weight_scale, ...): its bias comes on its own.
        self.seen.update(
            k for k in self.shapes if k.rpartition(".")[0] == path and not k.endswith(".bias")
        )

    def ternary(self, path: str, pt: PackedTernary) -> None:
        if path not in self.targets:
            raise FormatError(
                f"{self.where}: ternary tensor {path} is not a linear layer of "
                "the model its config describes"
            )
        k, n, _ = self.targets[path]
        if (pt.out_features, pt.in_features) != (n, k):
            raise FormatError(
                f"{self.where}: {path} holds a ({pt.out_features}, "
                f"{pt.in_features}) weight but the config implies ({n}, {k}); "
                "the config and the weights do not belong together"
            )
        self._own(path)
        self.ternary_count += 1

    def affine(self, path: str, at: AffineTensor) -> None:
        module = self.modules.get(path)
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise FormatError(
                f"{self.where}: quantized tensor {path}.weight is not a "
                "Linear or Embedding layer of the model its config describes"
            )
        if tuple(at.shape) != tuple(module.weight.shape):
            raise FormatError(
                f"{self.where}: {path}.weight holds a {tuple(at.shape)} weight "
                f"but config.json implies {tuple(module.weight.shape)}; the "
                "config and the weights do not belong together"
            )
        self._own(path)

    def tensor(self, name: str, arr: mx.array) -> None:
        if name not in self.shapes:
            raise FormatError(
                f"{self.where}: tensor {name} is not a parameter of the model its config describes"
            )
        if tuple(arr.shape) != self.shapes[name]:
            raise FormatError(
                f"{self.where}: tensor {name} has shape {tuple(arr.shape)} but "
                f"config.json implies {self.shapes[name]}; the config and the "
                "weights do not belong together"
            )
        self.seen.add(name)

    def item(self, name: str, item) -> None:
        if isinstance(item, PackedTernary):
            self.ternary(name, item)
        elif isinstance(item, (AffineTensor, GGMLTensor)):
            self.affine(name, item)
        else:
            self.tensor(name, item)

    def finish(self, require_ternary: bool = True) -> None:
        missing = sorted(set(self.shapes) - self.seen)
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise FormatError(
                f"{self.where}: missing tensor(s) {', '.join(missing[:3])}{more}; "
                "is a shard missing or the checkpoint incomplete?"
            )
        if require_ternary and not self.ternary_count:
            raise FormatError(
                f"{self.where}: no layer holds ternary weights; mlx-ternary runs "
                "ternary checkpoints (load float or affine models with "
                "mlx_lm.load)"
            )
