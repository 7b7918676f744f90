"""load(): a path or hub id -> (mlx-lm model with TernaryLinear layers, tokenizer)."""

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import kernels
from .errors import FormatError, TernaryError
from .format import PACKINGS, scale_kind
from .nn import TernaryLinear, linear_paths, swap_modules, ternary_layers
from .native import layers as native_layers
from .readers import hf_bitnet, mlx_affine, native

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


def _download(repo: str, revision: Optional[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_PATTERNS))
    except GatedRepoError:
        raise TernaryError(f"{repo}: the repository is gated; accept its terms on the Hub "
                           "and log in with `hf auth login`") from None
    except RepositoryNotFoundError:
        raise TernaryError(f"{repo}: no such model directory here and no such repository on the "
                           "Hugging Face Hub (if private, log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise TernaryError(f"{repo}: revision {revision!r} not found on the Hub") from None
    except (LocalEntryNotFoundError, OSError) as e:
        raise TernaryError(f"{repo}: not a local directory, and downloading it from the Hugging "
                           f"Face Hub failed ({type(e).__name__}); check the path, or the "
                           "network, or pass a local copy") from None


def resolve_model_path(path_or_hf_repo: str, revision: Optional[str] = None) -> Path:
    """A local model directory, downloading a hub repo id when it is not a local path."""
    p = Path(path_or_hf_repo).expanduser()
    if p.is_dir():
        return p
    if p.is_file():
        raise TernaryError(f"{p}: is a file, not a model directory; GGUF and single files are "
                           "read by `mlx-ternary convert --hf-path FILE --mlx-path DIR`")
    repo = str(path_or_hf_repo)
    if repo.count("/") != 1 or repo.startswith((".", "/", "~")):
        raise TernaryError(f"{path_or_hf_repo}: no such model directory (and not a Hugging Face "
                           "repo id of the form owner/name)")
    return _download(repo, revision)


def read_config(model_path: Path) -> Dict[str, Any]:
    path = model_path / "config.json"
    if not path.exists():
        raise TernaryError(f"{model_path}: no config.json; a model directory needs config.json, "
                           "its safetensors weights and tokenizer files")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from None
    if "model_type" not in config:
        raise FormatError(f"{path}: no model_type field; cannot tell the architecture")
    return config


def normalize_config(config: dict) -> dict:
    """Config spellings of newer transformers that mlx-lm's ModelArgs do not read."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" not in config:
        config = {**config, "rope_theta": rope.get("rope_theta", 10000.0)}
        if rope.get("rope_type", "default") != "default" and not config.get("rope_scaling"):
            config["rope_scaling"] = rope
    return config


def get_classes(config: dict, model_path: Path):
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)
    except ValueError:
        raise TernaryError(f"{model_path / 'config.json'}: model_type {config['model_type']!r} "
                           "is not an architecture the installed mlx-lm knows; upgrade mlx-lm "
                           "or check the model") from None


def _check_shapes(model: nn.Module, weights: Dict[str, mx.array], model_path: Path):
    expected = dict(tree_flatten(model.parameters()))
    for name, arr in weights.items():
        if name not in expected:
            raise FormatError(f"{model_path}: tensor {name} is not a parameter of the "
                              f"{type(model).__module__.split('.')[-1]} model its config describes")
        if tuple(arr.shape) != tuple(expected[name].shape):
            raise FormatError(f"{model_path}: tensor {name} has shape {tuple(arr.shape)} but "
                              f"config.json implies {tuple(expected[name].shape)}; the config "
                              "and the weights do not belong together")
    missing = sorted(set(expected) - set(weights))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise FormatError(f"{model_path}: missing tensor(s) {', '.join(missing[:3])}{more}; "
                          "is a shard missing or the checkpoint incomplete?")


def default_dtype():
    # Off the GPU, MLX's float16 and bfloat16 matmuls are many times slower than float32.
    return None if mx.default_device() == mx.gpu else mx.float32


def load_model(model_path: Path, *, dtype=None, packing: Optional[str] = None,
               backend: Optional[str] = None, lazy: bool = False) -> Tuple[nn.Module, dict]:
    """Build mlx-lm's model class for the checkpoint with ternary layers swapped in.

    Args:
        model_path: a local model directory.
        dtype: dtype of float parameters (default: float32 off the GPU, as stored on it;
            with the native CPU backend, float16/bfloat16 embeddings and output layers
            stay as stored).
        packing: runtime packing; default keeps the stored one where the Metal or native
            kernels run and uses "fast" (MLX's 2-bit layout, read in place) elsewhere.
        backend: force "metal", "emulate", "native" or "reference" for every ternary layer.
        lazy: leave parameters unevaluated.
    """
    config = normalize_config(read_config(model_path))
    hadamard = mlx_affine.is_hadamard(config)  # prism_hadamard_qwen35: keep the rotation
    is_bitnet = not native.detect(config) and hf_bitnet.detect(config)
    if is_bitnet:
        config = hf_bitnet.model_config(config)
    model_class, args_class = get_classes(config, model_path)
    model = model_class(args_class.from_dict(
        mlx_affine.hadamard_model_config(config) if hadamard else config))
    hf_bitnet.adapt_model(model, config)  # bitnet class, non-relu2 MLP (native or HF)
    linears = linear_paths(model)
    if packing is not None and packing not in PACKINGS:
        raise TernaryError(f"packing must be one of {PACKINGS}, got {packing!r}")
    # The reference path reads the fast layout in place; Metal kernels run either packing.
    runtime = packing or ("fast" if kernels.resolve_backend(backend) == "reference" else None)
    foreign_packing = runtime or "compact"  # what foreign readers pack into

    if native.detect(config):
        weights, quant = native.read(model_path, config)
    elif is_bitnet:
        weights, quant = hf_bitnet.read(model_path, config, linears, foreign_packing,
                                        sanitize=getattr(model, "sanitize", None))
    elif mlx_affine.detect(config):
        if hadamard:
            weights, quant = mlx_affine.read(
                model_path, config, mlx_affine.hadamard_linears(model, config), foreign_packing,
                mlx_affine.hadamard_sanitize(model), mlx_affine.hadamard_paths(config)[1])
        else:
            weights, quant = mlx_affine.read(model_path, config, linears, foreign_packing,
                                             getattr(model, "sanitize", None))
    else:
        raise TernaryError(
            f"{model_path / 'config.json'}: no ternary weights recognised (no mlx-ternary "
            "`quantization` section, no BitNet `quantization_config`); convert the model with "
            "`mlx-ternary convert`, or load float models with mlx_lm.load"
        )

    def make(path, module):
        if f"{path}.packed" not in weights:
            return None
        k, n, has_bias = linears[path]
        scales = weights[f"{path}.scales"]
        kind = scale_kind(tuple(scales.shape), n)
        return TernaryLinear(k, n, has_bias, packing=quant.packing, scale=kind,
                             group_size=quant.group_size, scale_dtype=scales.dtype,
                             activation_bits=quant.activation_bits, backend=backend)

    if hadamard:
        mlx_affine.swap_hadamard(model, weights, config, quant, backend)
    else:
        swap_modules(model, make)
    # Native CPU backend: native attention; embeddings / output layer stay float16/bfloat16.
    keep = (native_layers.adopt(model, weights, dtype)
            if kernels.resolve_backend(backend) == "native" else set())
    dtype = dtype or default_dtype()
    if dtype is not None:
        weights = {k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating)
                       and not k.endswith((".scales", ".biases")) and k not in keep else v)
                   for k, v in weights.items()}
    _check_shapes(model, weights, model_path)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    if runtime:
        for _, layer in ternary_layers(model):
            layer.repack(runtime)
            if not lazy:  # one layer at a time keeps the unpacked trits' peak small
                mx.eval(layer.packed)
    if not lazy:
        mx.eval(model.parameters())
    config["quantization"] = {**quant.to_dict(), "packing": runtime or quant.packing}
    return model, config


def load(path_or_hf_repo: str, *, tokenizer_config: Optional[dict] = None,
         dtype=None, packing: Optional[str] = None, backend: Optional[str] = None,
         lazy: bool = False, revision: Optional[str] = None, return_config: bool = False):
    """Load a ternary model as an mlx-lm model plus mlx-lm's TokenizerWrapper.

    Reads the native format (both packings), Hugging Face BitNet packed checkpoints
    (`bitlinear` and `autobitlinear` scales) and float latent BitNet checkpoints
    (absmean-ternarized at load).

    Args:
        path_or_hf_repo: a local directory or a Hugging Face repo id (downloaded).
        tokenizer_config: extra keyword arguments for the tokenizer.
        dtype, packing, backend, lazy: see `load_model`.
        revision: hub revision (branch, tag or commit).
        return_config: also return the config dict.

    Returns:
        (model, tokenizer) or (model, tokenizer, config).

    Raises:
        TernaryError: a missing directory, config or weights, an unsupported model
            type, or (FormatError) a checkpoint that does not match its config.
    """
    from mlx_lm.utils import load_tokenizer

    model_path = resolve_model_path(path_or_hf_repo, revision)
    model, config = load_model(model_path, dtype=dtype, packing=packing, backend=backend,
                               lazy=lazy)
    try:
        tokenizer = load_tokenizer(model_path, tokenizer_config,
                                   eos_token_ids=config.get("eos_token_id"))
    except (OSError, ValueError) as e:
        raise TernaryError(f"{model_path}: cannot load the tokenizer ({e}); the directory needs "
                           "tokenizer.json or tokenizer.model with tokenizer_config.json") from None
    return (model, tokenizer, config) if return_config else (model, tokenizer)
