"""Writer for llama.cpp GGUF files (llama, qwen2, qwen3, bitnet architectures).

Ternary weights go in as TQ2_0/TQ1_0, padded TQ or Q8_0 codes (writers/gguf_tensors.py),
listed in `mlx_ternary.ternary`; llama.cpp's d is float16, and where a scale is not a
float16 number the float32 one is kept in `mlx_ternary.scale.<tensor>` so that
mlx-ternary reads every ternary weight back exactly. 1-D tensors are float32 (llama.cpp's
binary ops refuse an F16 norm); llama's Q and K rows go into llama.cpp's rotary order, as
its own converter writes them. The tokenizer's
`tokenizer.ggml.pre` is the llama.cpp pre-tokenizer that splits text exactly as the
tokenizer's own pre-tokenizer does, found by splitting a probe text with each; a
tokenizer none of them matches is refused rather than exported to tokenize differently.
`mlx_ternary.*` keys carry what llama.cpp has no key for (activation_bits, the config).
"""

import json
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import mlx.core as mx

from ...errors import TernaryError
from ...format import AffineTensor, PackedTernary
from ..gguf_tables import (
    ARCHITECTURES,
    META,
    PRE_DETECT_ORDER,
    PRE_TOKENIZERS,
    WRITE_ARCH,
    NameTable,
    hf_pre_tokenizer,
)
from . import gguf_tensors as gt

QTYPES = ("TQ1_0", "TQ2_0")
# Splits every pre-tokenizer in gguf_tables differently from the others.
PROBE = (
    "Hello world! I'll say: What's up? DON'T don't we'd they've I'M it's\n\n"
    "  3 33 333 3333 12345678 1.5e-3\t tab\r\n  \u00dcn\u00efc\u00f6d\u00e9 "
    "cafe\u0301 na\u00efve \U0001f999.cpp \u6211\u60f3\u5728apple\u5de5\u4f5c1314151"
    "\u5929\uff5e $100+<=>^~|` ... --- ((x)) \n \n\n\n   end   "
)


def check_config(config: dict) -> None:
    """Refuse, before anything is written, a model llama.cpp could not run as exported."""
    mt = config.get("model_type")
    if mt not in WRITE_ARCH:
        raise TernaryError(f"--to-gguf writes {', '.join(WRITE_ARCH)} models; this model is {mt!r}")
    arch = ARCHITECTURES[WRITE_ARCH[mt]]
    if arch.always_tied and not config.get("tie_word_embeddings", True):
        raise TernaryError(
            f"--to-gguf: llama.cpp's {arch.gguf} graph multiplies by the token "
            "embedding for its output; this model has a separate lm_head"
        )
    rope = config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default", "linear", "yarn"):
        raise TernaryError(
            f"--to-gguf: rope_scaling type {kind!r} is not exported (supported: none, linear, yarn)"
        )


def _metadata(w, config: dict, activation_bits: Optional[int], ffn: Optional[int]) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    mt = config["model_type"]
    w.add_name(config.get("_name_or_path") or "mlx-ternary model")
    w.add_context_length(config.get("max_position_embeddings") or 2048)
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(ffn or config["intermediate_size"])
    if ffn:  # zero-padded to whole TQ blocks (writers/gguf_tensors.py)
        w.add_uint32(f"{META}.intermediate_size", config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // heads or mt == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(config["vocab_size"])
    rope = config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind in ("linear", "yarn"):
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType[kind.upper()])
        w.add_rope_scaling_factor(float(rope["factor"]))
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if mt == "bitnet":
        w.add_string(f"{WRITE_ARCH[mt]}.hidden_activation", config.get("hidden_act", "relu2"))
    w.add_uint32(f"{META}.activation_bits", int(activation_bits or 0))
    kept = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    w.add_string(f"{META}.config", json.dumps(kept))


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #


def detect_pre(tokenizer_json: str, where: str = "tokenizer.json") -> str:
    """The llama.cpp `tokenizer.ggml.pre` whose splits equal the tokenizer's own."""
    from tokenizers import Tokenizer

    tj = json.loads(tokenizer_json)
    norm = tj.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        raise TernaryError(
            f"{where}: a {norm.get('type')} normalizer; llama.cpp applies none "
            "to BPE text, so the GGUF would tokenize differently"
        )
    tok = Tokenizer.from_str(tokenizer_json)
    if tok.pre_tokenizer is None:
        raise TernaryError(
            f"{where}: no pre-tokenizer; llama.cpp's BPE always pre-splits "
            "text, so the GGUF would tokenize differently"
        )
    own = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(PROBE)]
    for name in PRE_DETECT_ORDER:
        pieces = hf_pre_tokenizer(PRE_TOKENIZERS[name]).pre_tokenize_str(PROBE)
        if [p for p, _ in pieces] == own:
            return name
    raise TernaryError(
        f"{where}: its pre-tokenizer splits text unlike every llama.cpp "
        f"pre-tokenizer mlx-ternary knows ({', '.join(PRE_DETECT_ORDER)}); "
        "llama.cpp would tokenize differently, so no GGUF is written"
    )


def _added_bos_eos(tokenizer_json: str) -> Tuple[bool, bool]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a").ids
    return full[:1] != plain[:1], full[-1:] != plain[-1:]


def _tokenizer(w, tokenizer_json: Optional[str], tokenizer_config: dict, config: dict) -> None:
    if not tokenizer_json:
        return
    tj = json.loads(tokenizer_json)
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise TernaryError(
            "--to-gguf rebuilds byte-level BPE tokenizers; this model's "
            f"tokenizer.json has a {model.get('type')!r} model"
        )
    pre = detect_pre(tokenizer_json)
    vocab = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    flags = {t["content"]: t.get("special", False) for t in tj.get("added_tokens", [])}
    vocab.update(special)
    n = config["vocab_size"]
    if max(vocab.values()) >= n:
        raise TernaryError(
            f"tokenizer.json has token id {max(vocab.values())} but the model's "
            f"embedding has {n} rows; llama.cpp needs one row per token"
        )
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # llama.cpp UNUSED for ids no token holds
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = (3 if flags[tok] else 4) if tok in special and special[tok] == i else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not merges:  # gguf-py cannot write an empty array, and llama.cpp needs the key
        raise TernaryError(
            "--to-gguf: tokenizer.json has no BPE merges; llama.cpp refuses a "
            "GGUF byte-level BPE vocabulary without them"
        )
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    add_bos, add_eos = _added_bos_eos(tokenizer_json)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    for key, add in (
        ("bos_token_id", w.add_bos_token_id),
        ("eos_token_id", w.add_eos_token_id),
        ("pad_token_id", w.add_pad_token_id),
    ):
        v = config.get(key)
        v = v[0] if isinstance(v, list) else v
        if v is not None:
            add(int(v))
    if tokenizer_config.get("chat_template"):
        w.add_chat_template(tokenizer_config["chat_template"])


def _add_tensors(w, items, names, arch_name: str, qtype: str, plan, on_tensor) -> List[str]:
    """Add each item as its GGUF tensor; returns the GGUF names of the ternary ones."""
    ternary_names = []
    for name, item in items:
        hf = name if isinstance(item, mx.array) else f"{name}.weight"
        g = names.gguf(hf)
        if g is None:
            raise TernaryError(
                f"{hf}: no llama.cpp name for this tensor in the {arch_name} "
                "name table (gguf_tables.ARCHITECTURES)"
            )
        if isinstance(item, PackedTernary):
            data, raw, err, exact = gt.ternary(hf, item, qtype, plan)
            ternary_names.append(g)
            if exact is not None:
                w.add_array(f"{META}.scale.{g}", [float(v) for v in exact.ravel()])
            if item.group_size:
                w.add_uint32(f"{META}.group_size", item.group_size)
        elif isinstance(item, AffineTensor):
            data, raw, err = gt.affine(hf, item, plan)
        else:
            data, raw, err = gt.floating(hf, item, plan)
        w.add_tensor(g, data, raw_dtype=raw)
        if on_tensor:
            on_tensor(name, raw.name if raw is not None else str(data.dtype), err)
    return ternary_names


def write(
    out_file: Path,
    config: dict,
    items: Iterator[Tuple[str, object]],
    qtype: str = "TQ2_0",
    tokenizer_json: Optional[str] = None,
    tokenizer_config: Optional[dict] = None,
    on_tensor: Optional[Callable[[str, str, float], None]] = None,
    activation_bits: Optional[int] = None,
) -> None:
    """Stream (name, mx.array | PackedTernary | AffineTensor) items into a GGUF file.

    Args:
        qtype: "TQ2_0" or "TQ1_0" for ternary rows of whole 256-weight blocks.
        activation_bits: recorded as `mlx_ternary.activation_bits` (0 for none).
        on_tensor: called as (name, kind, max round-trip error) after each tensor.

    Raises:
        TernaryError: an architecture, tokenizer or tensor llama.cpp could not run as
            written; nothing is written then (the caller owns the temporary file).
    """
    from gguf import GGUFWriter, LlamaFileType

    check_config(config)
    if qtype not in QTYPES:
        raise TernaryError(f"--gguf-type must be one of {QTYPES}, got {qtype!r}")
    arch = ARCHITECTURES[WRITE_ARCH[config["model_type"]]]
    names = NameTable(arch.names)
    plan = gt.Encoding.make(config, arch.rotary_permuted)
    w = GGUFWriter(str(out_file), arch.gguf, use_temp_file=True)
    _metadata(w, config, activation_bits, plan.ffn)
    w.add_file_type(LlamaFileType[f"MOSTLY_{qtype}"])
    _tokenizer(w, tokenizer_json, tokenizer_config or {}, config)
    ternary_names = _add_tensors(w, items, names, arch.gguf, qtype, plan, on_tensor)
    w.add_array(f"{META}.ternary", ternary_names)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
