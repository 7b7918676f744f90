"""Reader for Hugging Face BitNet checkpoints, packed or float latent, and mlx-lm's
quantized BitNet conversions.

Packed ("offline"): uint8 (ceil(N/4), K); 2-bit field i of packed row r holds output
row r + i * ceil(N/4) as t + 1, with one `weight_scale` per tensor. Latent ("online",
1bitLLM's `weight_bits: 1`): float weights ternarized at load, s = mean|W| per tensor.
What `weight_scale` means depends on the config revision: see `semantics` and the table
in docs/FORMAT.md. Embeddings that `mlx_lm.convert -q` quantized stay affine-quantized.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ...errors import FormatError
from ...format import PackedTernary, ceil_div, is_ternary_config
from ...ternarize import read_scales, ternarize_absmean
from . import arch
from .common import Source, shard_files, tensor_index

# 1bitLLM/bitnet_b1_58-* checkpoints: model_type "llama", architecture BitnetForCausalLM,
# with the BitNet sub-norms under their own names and a configurable activation.
ONEBIT_ARCH = "BitnetForCausalLM"
ONEBIT_RENAMES = {
    ".self_attn.inner_attn_ln.": ".self_attn.attn_sub_norm.",
    ".mlp.ffn_layernorm.": ".mlp.ffn_sub_norm.",
}


@dataclass(frozen=True)
class Semantics:
    """How a BitNet checkpoint's weights and activations are to be read."""

    rule: str  # which config revision decided it (docs/FORMAT.md table)
    invert: bool  # weight_scale holds 1/s (output divided by it), else s
    activation_bits: Optional[int]
    exact_floats: bool = False  # float weights that are t * s are read exactly (else absmean)


def _bitnet_block(config: dict) -> dict:
    """The BitNet quantization block: HF's quantization_config, or the copy an older
    `mlx_lm.convert -q` merged into its `quantization` block."""
    for key in ("quantization_config", "quantization"):
        q = config.get(key)
        if isinstance(q, dict) and q.get("quant_method") == "bitnet":
            return q
    return {}


def semantics(config: dict, where="config.json") -> Semantics:
    """Scale meaning and activation quantization of a BitNet config, as the transformers
    (or mlx-lm) code that read that config revision applied them."""
    q = _bitnet_block(config)
    act = 8 if config.get("input_bits", 8) else None
    if q.get("use_rms_norm"):
        raise FormatError(
            f"{where}: quantization_config.use_rms_norm is true (an RMSNorm "
            "inside every BitLinear); mlx-ternary does not run that variant"
        )
    if "linear_class" in q:
        if q["linear_class"] not in ("bitlinear", "autobitlinear"):
            raise FormatError(
                f"{where}: quantization_config.linear_class "
                f"{q['linear_class']!r}; expected bitlinear or autobitlinear"
            )
        return Semantics(
            f"linear_class: {q['linear_class']}", q["linear_class"] == "bitlinear", act
        )
    if q.get("offline_quantization") or q.get("online_quantization"):
        # transformers PR #37503 as first published with microsoft/bitnet-b1.58-2B-4T:
        # both flags built AutoBitLinear, which multiplies by weight_scale.
        return Semantics("offline_quantization/online_quantization (AutoBitLinear)", False, act)
    if q:
        return Semantics("quant_method bitnet, no linear_class (BitLinear)", True, act)
    if config.get("weight_bits") == 1:
        return Semantics("1bitLLM weight_bits: 1 (latent)", False, act)
    # mlx-lm's convert -q replaced quantization_config by its affine block; its bitnet
    # class (the only one such checkpoints load into) multiplies by weight_scale.
    return Semantics(
        "model_type bitnet, no BitNet block (mlx-lm BitLinear)", False, act, exact_floats=True
    )


def detect(path: Path) -> bool:
    if not path.is_dir():
        return False
    config = arch.read_config(path)
    if is_ternary_config(config):
        return False
    return (
        bool(_bitnet_block(config))
        or config.get("weight_bits") == 1
        or config.get("model_type") == "bitnet"
    )


def model_config(config: dict) -> dict:
    """The architecture config mlx-lm's classes need for a BitNet checkpoint."""
    config = arch.architecture(config)
    if ONEBIT_ARCH in (config.get("architectures") or []):
        config = {
            **config,
            "model_type": "bitnet",
            "tie_word_embeddings": config.get("tie_word_embeddings", False),
        }
    return config


def unpack_hf(packed: np.ndarray, out_features: int) -> np.ndarray:
    """HF BitNet packed uint8 (ceil(N/4), K) -> trits (N, K) int8."""
    fields = [((packed >> (2 * i)) & 3) for i in range(4)]
    return np.concatenate(fields, axis=0)[:out_features].astype(np.int8) - 1


def _exact(w: np.ndarray, label: str):
    """(t, s, group size) of floats that already are t * s, else None (latent weights)."""
    try:
        t, s, gs, _ = read_scales(w, 128, label)
    except FormatError:
        return None
    return t, s, gs


def _excluded(path: str, skip) -> bool:
    return any(path == s or path.endswith("." + s) or path.startswith(s + ".") for s in skip)


def _sanitizer(model):
    """1bitLLM sub-norm names, then the model class's own sanitize rules."""
    model_sanitize = getattr(model, "sanitize", None)

    def sanitize(weights):
        renamed = {}
        for k, v in weights.items():
            for old, new in ONEBIT_RENAMES.items():
                k = k.replace(old, new)
            renamed[k] = v
        return model_sanitize(renamed) if model_sanitize else renamed

    return sanitize


def _packed_trits(label: str, p: str, w, read, n: int, k: int, invert: bool):
    """(trits, scale) of a packed uint8 weight and its one `weight_scale`."""
    try:
        ws = read(f"{p}.weight_scale")
    except KeyError:
        raise FormatError(f"{label} is packed (uint8) but {p}.weight_scale is missing") from None
    ws = np.array(ws.astype(mx.float32)).reshape(-1)
    if ws.size != 1:
        raise FormatError(f"{label}_scale: expected one value per tensor, got {ws.size}")
    if tuple(w.shape) != (ceil_div(n, 4), k):
        raise FormatError(
            f"{label}: packed shape {tuple(w.shape)} does not match the "
            f"config's ({n}, {k}) layer (expected ({ceil_div(n, 4)}, {k}))"
        )
    s = (np.float32(1.0) / ws if invert else ws).reshape(1, 1).astype(np.float32)
    return unpack_hf(np.array(w), n), s


def _linear_rule(where: str, targets: dict, sem, packing: str):
    """The `linear` rule of `arch.stream`: a packed or float latent weight to PackedTernary."""

    def linear(p, w, read):
        k, n, _ = targets[p]
        label = f"{where}: {p}.weight"
        if w.dtype == mx.uint8:
            t, s = _packed_trits(label, p, w, read, n, k, sem.invert)
            return PackedTernary.from_trits(t, s, packing, name=label)
        if not mx.issubdtype(w.dtype, mx.floating):
            raise FormatError(
                f"{label}: dtype {w.dtype}; a BitNet weight is packed uint8 or float latent"
            )
        if tuple(w.shape) != (n, k):
            raise FormatError(f"{label}: shape {tuple(w.shape)}, the config expects ({n}, {k})")
        w32 = np.array(w.astype(mx.float32))
        exact = _exact(w32, label) if sem.exact_floats else None
        t, s, gs = exact if exact else (*ternarize_absmean(w32), None)
        return PackedTernary.from_trits(t, s, packing, gs, name=label)

    return linear


def source(path: Path, packing: str = "compact") -> Source:
    """A Source for a BitNet checkpoint; ternary layers packed in `packing`."""
    raw = arch.read_config(path)
    sem = semantics(raw, path / "config.json")
    config = model_config(raw)
    model = arch.skeleton(config, path)
    skip = set(_bitnet_block(raw).get("modules_to_not_convert") or []) | {"lm_head"}
    targets = {
        p: d for p, d in arch.ternary_targets(model, config).items() if not _excluded(p, skip)
    }
    linear = _linear_rule(path.name, targets, sem, packing)
    sanitize = _sanitizer(model)

    count, items = arch.stream(
        path,
        model,
        targets,
        arch.quant_block(raw),
        linear=linear,
        sanitize=sanitize,
        companions=("weight_scale",),
    )
    packed = any(meta["dtype"] == "U8" for _, meta, _ in tensor_index(shard_files(path)).values())
    kind = (
        f"Hugging Face BitNet {'packed' if packed else 'float latent (absmean)'}; "
        f"scales: {sem.rule}"
    )
    return Source(
        path=path,
        kind=kind,
        config=config,
        count=count,
        items=items,
        activation_bits=sem.activation_bits,
        tokenizer_dir=path,
        model=model,
        targets=targets,
    )
