"""llama.cpp facts shared by the GGUF reader and writer (the one home of each).

- ARCHITECTURES: GGUF architecture -> mlx-lm model_type, per-architecture tensor names
  and whether llama.cpp's converter stored Q/K rows in its rotary pair order.
- rotary_permute / rotary_unpermute: that row order (llama only; bitnet and qwen3 use
  NEOX-style rotary in llama.cpp, so their rows stay in Hugging Face order).
- PRE_TOKENIZERS: `tokenizer.ggml.pre` names -> the pre-tokenizer regexes llama.cpp
  splits text with, written as the `tokenizers` library's Split patterns.
"""

import re
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np

TQ_BLOCK = 256  # weights per TQ1_0 / TQ2_0 block
Q_BLOCK = 32  # weights per Q8_0 / Q4_0 / Q4_1 block (and per k-quant sub-block)
META = "mlx_ternary"  # namespace of the keys our writer adds (readers/gguf.py reads them)

# --------------------------------------------------------------------------- #
# Tensor names
# --------------------------------------------------------------------------- #

# llama.cpp tensor name -> mlx-lm parameter name ({i}: the layer), shared by every arch.
COMMON_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
BITNET_NAMES = {
    "blk.{i}.attn_sub_norm.weight": "model.layers.{i}.self_attn.attn_sub_norm.weight",
    "blk.{i}.ffn_sub_norm.weight": "model.layers.{i}.mlp.ffn_sub_norm.weight",
}
QK_NORM_NAMES = {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
QKV_BIAS_NAMES = {
    f"blk.{{i}}.attn_{p}.bias": f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"
}
# llama.cpp's precomputed rotary factors (mlx-lm derives them from rope_scaling).
IGNORED_TENSORS = ("rope_freqs.weight",)


@dataclass(frozen=True)
class Arch:
    """One GGUF architecture as mlx-lm runs it."""

    gguf: str  # general.architecture as llama.cpp writes it
    model_type: str  # mlx-lm's model_type
    rotary_permuted: bool  # Q/K rows in llama.cpp's rotary pair order (NORM rope)
    names: Dict[str, str] = field(default_factory=dict)
    hidden_act: str = "silu"  # when the file does not say
    always_tied: bool = False  # llama.cpp reads token_embd as the output matrix


ARCHITECTURES = {
    "llama": Arch("llama", "llama", True, COMMON_NAMES),
    "qwen2": Arch("qwen2", "qwen2", False, {**COMMON_NAMES, **QKV_BIAS_NAMES}),
    "qwen3": Arch("qwen3", "qwen3", False, {**COMMON_NAMES, **QK_NORM_NAMES}),
    # mainline llama.cpp (convert_hf_to_gguf BitnetModel): silu unless hidden_activation
    "bitnet": Arch("bitnet", "bitnet", False, {**COMMON_NAMES, **BITNET_NAMES}, always_tied=True),
    # bitnet.cpp (microsoft/BitNet's fork): BitNet b1.58 2B4T, relu2 always
    "bitnet-b1.58": Arch(
        "bitnet-b1.58",
        "bitnet",
        False,
        {**COMMON_NAMES, **BITNET_NAMES},
        hidden_act="relu2",
        always_tied=True,
    ),
    "bitnet-25": Arch(
        "bitnet-25",
        "bitnet",
        False,
        {**COMMON_NAMES, **BITNET_NAMES},
        hidden_act="relu2",
        always_tied=True,
    ),
}
# mlx-lm model_type -> the GGUF architecture the writer emits
WRITE_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "bitnet": "bitnet"}


def _pattern(template: str):
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


class NameTable:
    """Both directions of one architecture's llama.cpp <-> mlx-lm tensor names."""

    def __init__(self, names: Dict[str, str]):
        self._to_hf = [(_pattern(g), h) for g, h in names.items()]
        self._to_gguf = [(_pattern(h), g) for g, h in names.items()]

    @staticmethod
    def _map(table, name: str) -> Optional[str]:
        for pat, out in table:
            m = pat.match(name)
            if m:
                return out.format(i=m.group(1)) if m.groups() else out
        return None

    def hf(self, gguf_name: str) -> Optional[str]:
        return self._map(self._to_hf, gguf_name)

    def gguf(self, hf_name: str) -> Optional[str]:
        return self._map(self._to_gguf, hf_name)


def rotary_heads(hf_name: str, config: dict) -> Optional[int]:
    """Heads whose rows llama.cpp interleaves for `hf_name` (None: not a Q/K weight)."""
    if ".self_attn.q_proj." in hf_name:
        return config["num_attention_heads"]
    if ".self_attn.k_proj." in hf_name:
        return config.get("num_key_value_heads") or config["num_attention_heads"]
    return None


def rotary_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face row order -> llama.cpp's (each head's two halves interleaved)."""
    n = w.shape[0]
    return w.reshape(n_head, 2, n // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rotary_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order -> Hugging Face's (the inverse of rotary_permute)."""
    n = w.shape[0]
    return w.reshape(n_head, n // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------- #
# Pre-tokenizers
# --------------------------------------------------------------------------- #

# The split patterns, as Hugging Face tokenizer.json files spell them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp pre-splits text for one `tokenizer.ggml.pre` value."""

    splits: Tuple[str, ...]  # applied in order, each piece split again ("isolated")
    ignore_merges: bool = False  # a whole word found in the vocabulary is one token
    nfc: bool = False  # the Hugging Face original normalizes to NFC first


PRE_TOKENIZERS = {
    "gpt-2": PreTokenizer((_GPT2,)),
    "llama-bpe": PreTokenizer((_LLAMA3,), ignore_merges=True),
    "qwen2": PreTokenizer((_QWEN2,), nfc=True),
    "qwen35": PreTokenizer((_QWEN35,)),
    "smollm": PreTokenizer((r"\p{N}", _GPT2)),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    # llama.cpp's fallback when a converter did not recognise the tokenizer
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
}
# Other names llama.cpp gives the same splitting (its llama-vocab.cpp groups them).
PRE_ALIASES = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), "llama-bpe"
    ),
    **dict.fromkeys(
        (
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "jina-es",
            "jina-de",
            "jina-v2-es",
            "jina-v2-de",
            "jina-v2-code",
        ),
        "gpt-2",
    ),
    **dict.fromkeys(("stablelm2", "hunyuan", "deepseek-r1-qwen", "megrez"), "qwen2"),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), "smollm"
    ),
}
# Order in which the writer tries them against a tokenizer's own pre-tokenizer.
PRE_DETECT_ORDER = ("gpt-2", "llama-bpe", "qwen2", "qwen35", "smollm", "falcon")


def pre_tokenizer(name: str) -> Optional[PreTokenizer]:
    return PRE_TOKENIZERS.get(PRE_ALIASES.get(name, name))


def hf_pre_tokenizer(pre: PreTokenizer):
    """The `tokenizers` pre-tokenizer that splits text as llama.cpp does for `pre`."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
