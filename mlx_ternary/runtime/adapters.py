"""mlx-lm adapters on ternary models: attach (LoRA or DoRA), load, and dequantize for fusing.

mlx-lm's `linear_to_lora_layers` already converts TernaryLinear for LoRA through the
layer's `to_lora` hook; it asks no hook for DoRA, so `linear_to_lora_layers` here converts
the ternary layers itself, by mlx-lm's key rules, and leaves the rest to mlx-lm.
`route_dora` (called by `load()`) puts it in the place of mlx-lm's own (patches.py says how).
"""

from pathlib import Path
from typing import Dict, Set

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.tuner import utils as tuner
from mlx_lm.utils import dequantize_model as mlx_dequantize_model

from ..errors import FormatError, TernaryError, read_json
from . import patches
from .layers import FusedTernaryLinear, TernaryLinear, ternary_layers

ADAPTER_LEAVES = ("lora_a", "lora_b", "m")
# mlx-lm's own functions, held here: `mlx-ternary lm` puts the ones below in their place.
mlx_linear_to_lora_layers = tuner.linear_to_lora_layers


def _default_keys(model: nn.Module) -> Set[str]:
    """The block-relative paths mlx-lm's converter picks when the config names no keys."""
    kinds = (
        nn.Linear,
        nn.QuantizedLinear,
        SwitchLinear,
        QuantizedSwitchLinear,
        nn.Embedding,
        nn.QuantizedEmbedding,
    )
    keys = set()
    for block in model.layers:
        for path, m in block.named_modules():
            if hasattr(m, "to_lora") or isinstance(m, kinds):
                keys.add(path)
    return keys


def _ternary_dora(model: nn.Module, num_layers: int, keys: Set[str], config: dict) -> Set[str]:
    """Swap the ternary layers at `keys` for DoRA layers; returns the keys it used."""
    from .lora import TernaryDoRALinear

    def convert(path, m):
        if isinstance(m, FusedTernaryLinear):
            raise ValueError(
                f"{path}: a split-output (fused) layer does not support DoRA; use LoRA"
            )
        return TernaryDoRALinear.from_base(
            m, r=config["rank"], scale=config["scale"], dropout=config["dropout"]
        )

    used = set()
    for block in model.layers[-max(num_layers, 0) :]:
        new = [
            (k, convert(k, m))
            for k, m in block.named_modules()
            if k in keys and isinstance(m, TernaryLinear)
        ]
        used.update(k for k, _ in new)
        if new:
            block.update_modules(tree_unflatten(new))
    new = [
        (k, convert(k, m))
        for k, m in model.named_modules()
        if k in keys and isinstance(m, TernaryLinear)
    ]
    used.update(k for k, _ in new)
    if new:
        model.update_modules(tree_unflatten(new))
    return used


def linear_to_lora_layers(
    model: nn.Module, num_layers: int, config: Dict, use_dora: bool = False
) -> None:
    """mlx-lm's `linear_to_lora_layers`, with DoRA on ternary layers as well.

    Same arguments, key rules and result as mlx_lm.tuner.utils.linear_to_lora_layers;
    a model without ternary layers goes to it unchanged.
    """
    if not use_dora or not ternary_layers(model) or "scale" not in config:
        return mlx_linear_to_lora_layers(model, num_layers, config, use_dora=use_dora)
    keys = config.get("keys")
    keys = set(keys) if keys is not None else _default_keys(model)
    used = _ternary_dora(model, num_layers, keys, config)
    rest = {**config, "keys": sorted(keys - used)}
    return mlx_linear_to_lora_layers(model, num_layers, rest, use_dora=True)


def route_dora() -> None:
    """For the life of the process, mlx-lm's `linear_to_lora_layers` is this module's, so
    mlx-lm's own Python API (and its `load_adapters`, its lora trainer) wraps TernaryLinear
    for DoRA too; models without ternary layers still go to mlx-lm's function unchanged."""
    patches.rebind_for_life({mlx_linear_to_lora_layers: linear_to_lora_layers})


def load_adapters(model: nn.Module, adapter_path) -> nn.Module:
    """Attach the adapters mlx-lm's `lora` saved in `adapter_path` and load their weights.

    Reads adapter_config.json (fine_tune_type lora or dora, num_layers, lora_parameters)
    and adapters.safetensors; full fine-tunes are refused (the ternary base is frozen).

    Raises:
        TernaryError: a missing directory or file, a full fine-tune, or (FormatError)
            tensors that are not adapter parameters of this model or have other shapes.
    """
    path = Path(adapter_path)
    config_file, weights_file = path / "adapter_config.json", path / "adapters.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise TernaryError(
                f"{f}: not found; --adapter-path takes the directory "
                "`mlx_lm.lora` (or `mlx-ternary lm lora`) saved the adapter in"
            )
    config = read_json(config_file)
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise TernaryError(
            f"{config_file}: fine_tune_type {kind!r}; a ternary base loads "
            "LoRA or DoRA adapters (its packed weights are not trained)"
        )
    for field in ("num_layers", "lora_parameters"):
        if field not in config:
            raise FormatError(f"{config_file}: no {field} field; is it mlx-lm's adapter config?")
    linear_to_lora_layers(
        model, config["num_layers"], config["lora_parameters"], use_dora=kind == "dora"
    )
    weights = mx.load(str(weights_file))
    params = dict(tree_flatten(model.parameters()))
    for name, w in weights.items():
        if name.rsplit(".", 1)[-1] not in ADAPTER_LEAVES or name not in params:
            raise FormatError(
                f"{weights_file}: tensor {name} is not an adapter parameter of "
                "this model; was the adapter trained on another model?"
            )
        if tuple(w.shape) != tuple(params[name].shape):
            raise FormatError(
                f"{weights_file}: tensor {name} has shape {tuple(w.shape)}, the "
                f"model's is {tuple(params[name].shape)}; was the adapter "
                "trained on another model?"
            )
    model.load_weights(list(weights.items()), strict=False)
    return model


def dequantize_model(model: nn.Module) -> nn.Module:
    """mlx-lm's `dequantize_model`, with ternary layers becoming float nn.Linear (s * t).

    Activation quantization goes with them: the float model runs on unquantized inputs.
    """
    new = []
    for path, m in ternary_layers(model):
        if isinstance(m, FusedTernaryLinear):
            from mlx_lm.models.afm7 import FusedLinear

            linear = FusedLinear(m.input_dims, m.output_dims)
        else:
            linear = nn.Linear(m.in_features, m.out_features, bias="bias" in m)
        linear.weight = m.dequantize()
        if "bias" in m:
            linear.bias = m.bias
        new.append((path, linear))
    if new:
        model.update_modules(tree_unflatten(new))
    return mlx_dequantize_model(model)
