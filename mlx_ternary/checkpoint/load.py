"""load(): a path or hub id -> (mlx-lm model with TernaryLinear layers, tokenizer)."""

from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from ..errors import FormatError
from ..format import (
    Q8K,
    AffineTensor,
    GGMLTensor,
    PackedTernary,
    check_packing,
    layer_activation_bits,
)
from ..runtime import cpu, dispatch, ggml
from ..runtime.cpu import tables as native_tables
from ..runtime.layers import (
    HadamardTernaryLinear,
    QuantizedEmbedding,
    TernaryLinear,
    affine_layer,
    model_quantization,
    replacement,
    ternary_layers,
)
from .hub import model_dir
from .readers import gguf, gguf_quants, open_source
from .readers.arch import Checker, get_classes, hadamard_paths, normalize_config, read_config  # noqa: F401 (re-exported)
from .readers.common import Source


def resolve_model_path(path_or_hf_repo: str, revision: Optional[str] = None) -> Path:
    """A local model directory: the directory itself, a .gguf file's converted copy in the
    cache, or a hub repo id downloaded."""
    p = Path(path_or_hf_repo).expanduser()
    if gguf.detect(p):  # converted once into the cache, then read from there
        from .gguf_cache import ternary_dir

        return ternary_dir(p)
    return model_dir(path_or_hf_repo, revision)


def default_dtype():
    # Off the GPU, MLX's float16 and bfloat16 matmuls are many times slower than float32.
    return None if mx.default_device() == mx.gpu else mx.float32


def runtime_packing(packing: Optional[str], backend: Optional[str]) -> Optional[str]:
    """The packing ternary layers run in: `packing`, else "fast" where the reference path
    runs (it reads MLX's 2-bit layout in place), else None (keep what is stored)."""
    if packing is not None:
        return check_packing(packing)
    return "fast" if dispatch.resolve_backend(backend) == "reference" else None


def read_layers(
    source: Source,
    model: nn.Module,
    *,
    backend: Optional[str] = None,
    activations: Optional[str] = None,
):
    """Consume the source's stream: (float tensors {name: array}, layers {path: module}).

    Ternary items become TernaryLinear (HadamardTernaryLinear where the config rotates),
    affine items nn.QuantizedLinear / nn.QuantizedEmbedding, llama.cpp tables (GGMLTensor)
    the native backend's GGMLEmbedding / GGMLLinear (`_table`); each item is checked
    against the model its config describes as it arrives. Ternary layers run with
    `activations` (format.ACTIVATION_MODES; None: what the source records).
    """
    bits = layer_activation_bits(activations or source.activations, source.activation_bits)
    check = Checker(model, source.targets, source.path)
    modules = dict(model.named_modules())
    blocks, _ = hadamard_paths(source.config)
    weights, layers = {}, {}
    for name, item in source.items():
        check.item(name, item)
        if isinstance(item, PackedTernary):
            kw = dict(block=blocks[name]) if name in blocks else {}
            cls = HadamardTernaryLinear if name in blocks else TernaryLinear
            layers[name] = cls.from_packed(item, activation_bits=bits, backend=backend, **kw)
            if source.targets[name][2]:  # its bias arrives as its own tensor
                layers[name].bias = mx.zeros((item.out_features,))
            layers[name] = replacement(modules[name], layers[name])
        elif isinstance(item, AffineTensor):
            layers[name] = affine_layer(modules[name], item, f"{source.path}: {name}")
        elif isinstance(item, GGMLTensor):
            table = _table(modules[name], item, backend, bits == Q8K, f"{source.path}: {name}")
            if isinstance(table, nn.Module):
                layers[name] = table
            else:
                weights[f"{name}.weight"] = table
        else:
            weights[name] = item
    check.finish()
    return weights, layers


def _table(module: nn.Module, gt: GGMLTensor, backend: Optional[str], llama: bool, name: str):
    """A llama.cpp table: kept as its blocks where the native kernels run (llama.cpp's
    numerics when the model runs q8k), else what runs fast there and is exact - MLX affine
    for Q8_0 / Q4_K / Q5_K, float32 for Q6_K."""
    if dispatch.resolve_backend(backend) == "native":
        return native_tables.ggml_layer(module, gt, llama, name)
    if gt.type in gguf_quants.AFFINE_TYPES:
        n, k = gt.shape
        at = gguf_quants.affine(np.asarray(gt.blocks), gt.type, n, k)
        return affine_layer(module, at, name)
    return ggml.dequantize(mx.array(gt.blocks), gt.type, gt.in_features)


def load_model(
    model_path: Path,
    *,
    dtype=None,
    packing: Optional[str] = None,
    backend: Optional[str] = None,
    lazy: bool = False,
    activations: Optional[str] = None,
) -> Tuple[nn.Module, dict]:
    """Build mlx-lm's model class for the checkpoint with ternary layers swapped in.

    Args:
        model_path: a local model directory.
        dtype: dtype of float parameters (default: float32 off the GPU, as stored on it;
            with the native CPU backend, float16/bfloat16 embeddings and output layers
            stay as stored). Scales of ternary and affine layers keep their stored dtype.
        packing: runtime packing; default keeps the stored one where the Metal or native
            kernels run and uses "fast" (MLX's 2-bit layout, read in place) elsewhere.
        backend: force "metal", "emulate", "native" or "reference" for every ternary layer.
        lazy: leave parameters unevaluated.
        activations: what ternary layers do with their input: "model" (the model's own
            definition: BitNet's per-token int8, or float), "q8k" (llama.cpp's int8 per
            256-column block, ggml's Q8_K) or "float"; None: what the checkpoint records
            ("q8k" for a GGUF file from llama.cpp, else "model").
    """
    runtime = runtime_packing(packing, backend)
    source = open_source(model_path, runtime or "compact")
    model = source.model  # the skeleton: its layers are replaced, its parameters loaded
    weights, layers = read_layers(source, model, backend=backend, activations=activations)
    model.update_modules(tree_unflatten(list(layers.items())))
    # The backend's own rule for float tables: the native one keeps float16 ones as stored.
    keep = native_tables.adopt(model, weights, dtype, backend=dispatch.resolve_backend(backend))
    model.load_weights(list(_cast(model, weights, dtype or default_dtype(), keep)), strict=False)
    model.eval()
    if runtime:
        for _, layer in ternary_layers(model):
            layer.repack(runtime)
            if not lazy:  # one layer at a time keeps the unpacked trits' peak small
                mx.eval(layer.packed)
    _fast_for_q8k(model, dispatch.resolve_backend(backend), lazy)
    if not lazy:
        mx.eval(model.parameters())
    config = dict(source.config)
    quant = model_quantization(model)
    quant.activation_bits = source.activation_bits  # the model's own, whatever runs
    quant.activations = activations or source.activations
    config["quantization"] = quant.to_dict()
    return _shardable(model), config


def _fast_for_q8k(model: nn.Module, backend: str, lazy: bool) -> None:
    """On the native backend, q8k layers the kernel cannot take as stored (compact rows of
    one scale, whose 160-column steps straddle the 256-column blocks) run fast-packed."""
    if backend != "native":
        return
    for _, layer in ternary_layers(model):
        if layer.activation_bits != Q8K or layer.packing != "compact":
            continue
        kw = dict(packing="compact", in_features=layer.in_features, group_size=layer.group_size)
        if not cpu.q8k_supported(layer.scales, **kw):
            layer.repack("fast")
            if not lazy:
                mx.eval(layer.packed)


def _cast(model: nn.Module, weights: dict, dtype, keep: set):
    """(name, array) of the float weights in `dtype` (None: as stored), except scales, biases
    of quantized layers and the names in `keep`."""
    if dtype is None:
        return weights.items()
    for _, m in model.named_modules():  # quantized embeddings give rows in `dtype`
        if isinstance(m, QuantizedEmbedding):
            m.out_dtype = dtype
    floating = (k for k, v in weights.items() if mx.issubdtype(v.dtype, mx.floating))
    cast = {k for k in floating if not k.endswith((".scales", ".biases")) and k not in keep}
    return ((k, v.astype(dtype) if k in cast else v) for k, v in weights.items())


def _shardable(model: nn.Module) -> nn.Module:
    """The model with a `shard(group)` that knows TernaryLinear (runtime/shard_plans.py).
    Imported here: tensor parallelism is the one step of a load only mlx.launch runs use."""
    from ..runtime.shard_plans import make_shardable

    return make_shardable(model)


def load(
    path_or_hf_repo: str,
    *,
    tokenizer_config: Optional[dict] = None,
    dtype=None,
    packing: Optional[str] = None,
    backend: Optional[str] = None,
    lazy: bool = False,
    revision: Optional[str] = None,
    return_config: bool = False,
    adapter_path: Optional[str] = None,
    activations: Optional[str] = None,
):
    """Load a ternary model as an mlx-lm model plus mlx-lm's TokenizerWrapper.

    Reads every format `convert` reads (readers.READERS, in that order): the ternary
    format, Hugging Face BitNet (packed or latent, every published config revision),
    mlx-lm quantized BitNet conversions, MLX affine ternary packs (Ternary-Bonsai,
    Bonsai-2) and TriLM-style float checkpoints. Layers stored MLX affine-quantized
    (embeddings, lm_head) stay quantized. A .gguf file is converted once into the cache
    (gguf_cache.py) and loaded from there.

    Args:
        path_or_hf_repo: a local directory, a .gguf file or a Hugging Face repo id
            (downloaded).
        tokenizer_config: extra keyword arguments for the tokenizer.
        dtype, packing, backend, lazy, activations: see `load_model`.
        revision: hub revision (branch, tag or commit).
        return_config: also return the config dict.
        adapter_path: a directory with mlx-lm LoRA/DoRA adapters (adapters.safetensors,
            adapter_config.json) to attach; the ternary base stays as it is.

    Returns:
        (model, tokenizer) or (model, tokenizer, config).

    Raises:
        TernaryError: a missing directory, config or weights, an unsupported model
            type, or (FormatError) a checkpoint that does not match its config.
    """
    model_path = resolve_model_path(path_or_hf_repo, revision)
    tokenizer, tokenizer_error = _early_tokenizer(model_path, tokenizer_config)
    model, config = load_model(
        model_path,
        dtype=dtype,
        packing=packing,
        backend=backend,
        lazy=lazy,
        activations=activations,
    )
    from ..runtime.adapters import load_adapters, route_dora  # mlx-lm's tuner: only here

    route_dora()  # mlx-lm's linear_to_lora_layers(..., use_dora=True) takes TernaryLinear
    if adapter_path is not None:
        load_adapters(model, adapter_path)
        model.eval()
    if tokenizer_error is not None:  # the weights' own errors, if any, came first
        raise tokenizer_error
    if tokenizer is None:
        tokenizer = read_tokenizer(model_path, tokenizer_config, config)
    return (model, tokenizer, config) if return_config else (model, tokenizer)


def _early_tokenizer(model_path: Path, tokenizer_config: Optional[dict]):
    """(tokenizer, None), (None, its FormatError) or (None, None) where the directory has no
    config.json. Built before the weights: its build's transient memory (~90 MB for a 128k
    vocabulary) is freed before they arrive instead of adding to their peak."""
    if not (model_path / "config.json").is_file():
        return None, None
    try:
        return read_tokenizer(model_path, tokenizer_config, read_config(model_path)), None
    except FormatError as e:
        return None, e


def read_tokenizer(model_path: Path, tokenizer_config: Optional[dict], config: dict):
    """mlx-lm's TokenizerWrapper for the model directory, or a FormatError naming it."""
    from mlx_lm.utils import load_tokenizer

    try:
        return load_tokenizer(
            model_path, tokenizer_config, eos_token_ids=config.get("eos_token_id")
        )
    except Exception as e:  # transformers and tokenizers raise bare Exception on a bad file
        raise FormatError(
            f"{model_path}: cannot load the tokenizer ({type(e).__name__}: {str(e)[:200]}); "
            "the directory needs a valid tokenizer.json or tokenizer.model with "
            "tokenizer_config.json"
        ) from None
