"""Tiny seeded models and tokenizers built by the tests themselves (nothing downloaded)."""

import json
import os
import shlex
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from mlx_ternary.checkpoint.writers.ternary import save_model
from mlx_ternary.runtime.layers import ternarize_model

TESTS = Path(__file__).resolve().parent
FIXTURES = TESTS / "fixtures"
ROOT = TESTS.parent  # the checkout
# How a test starts a second Python: this one, or $MLX_TERNARY_TEST_PYTHON's command where the
# interpreter cannot be exec'ed directly (scripts/ci_aarch64.sh: an arm64 python3.11 under
# qemu-user without binfmt names qemu-aarch64-static -L <sysroot> <python>).
PYTHON = shlex.split(os.environ.get("MLX_TERNARY_TEST_PYTHON", "")) or [sys.executable]

VOCAB = 128

CONFIGS = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=512,
    ),
    "bitnet": dict(
        model_type="bitnet",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=112,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
}


def write_tokenizer(out_dir: Path) -> None:
    """A deterministic byte-level tokenizer with VOCAB entries, saved in Hugging Face form."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    ascii_ = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # + space, newline
    rest = sorted(set(pre_tokenizers.ByteLevel.alphabet()) - set(ascii_))
    alphabet = (ascii_ + rest)[: VOCAB - 2]
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 512,
            }
        )
    )


def float_model(arch: str, seed: int = 0, **overrides):
    """mlx-lm's model class for `arch` (config fields overridable) with seeded float32
    weights and plain Linear layers."""
    from mlx_lm.utils import _get_classes

    config = dict(CONFIGS[arch], bos_token_id=0, eos_token_id=1, **overrides)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if arch == "bitnet":  # its class builds Metal-only BitLinear layers: use plain Linear
        from mlx_ternary.runtime.layers import linear_paths, swap_modules

        dims = linear_paths(model)
        swap_modules(
            model, lambda p, m: nn.Linear(*dims[p][:2], bias=dims[p][2]) if p in dims else None
        )
    rng = np.random.default_rng(seed)
    params = tree_map(
        lambda a: (
            mx.array(rng.normal(0, 0.5, a.shape).astype(np.float32))
            if a.ndim >= 2
            else mx.ones(a.shape) + 0.1 * mx.array(rng.normal(size=a.shape).astype(np.float32))
        ),
        model.parameters(),
    )
    model.update(params)
    mx.eval(model.parameters())
    return model, config


def ternary_checkpoint(
    tmp: Path,
    arch: str,
    packing="compact",
    scale="tensor",
    group_size=None,
    activation_bits=None,
    seed=0,
    **overrides,
):
    """Write a ternary checkpoint of a random ternary `arch` model; returns (dir, float twin).

    The float twin is the same architecture with plain Linear layers holding the
    dequantized weights: the reference the ternary model must match.
    """
    model, config = float_model(arch, seed, **overrides)
    ternarize_model(model, packing, scale, group_size, activation_bits)
    out = tmp / f"{arch}-{packing}-{scale}"
    save_model(model, config, out)
    write_tokenizer(out)
    twin, _ = float_model(arch, seed, **overrides)
    from mlx_ternary.runtime.layers import ternary_layers

    deq = {f"{p}.weight": m.dequantize() for p, m in ternary_layers(model)}
    twin.load_weights(list(deq.items()), strict=False)
    return out, twin


def quantize_act_np(x: np.ndarray) -> np.ndarray:
    """BitNet int8 per-token absmax fake-quantization, in numpy (float64)."""
    x = x.astype(np.float64)
    scale = 127.0 / np.maximum(np.abs(x).max(-1, keepdims=True), 1e-5)
    return np.clip(np.round(x * scale), -128, 127) / scale


class Ranks:
    """A stand-in for mx.distributed.Group: sharding itself only asks size and rank."""

    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank
