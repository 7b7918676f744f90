"""Writer for llama.cpp GGUF files with TQ1_0 / TQ2_0 ternary tensors (llama architecture).

Each ternary weight becomes TQ blocks of 256 weights along a row with d = the block's
scale, exact when the scale is constant over each block (tensor, row or 256-column
group scales) and representable in float16; the round trip is checked per tensor.
Q and K rows are permuted into llama.cpp's rotary layout, as its own HF converter does.
Weights whose rows are not a multiple of 256 and float tensors stay F32/F16/BF16.
"""

import json
from pathlib import Path
from typing import Callable, Iterator, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import TernaryError
from ..format import PackedTernary
from ..readers.gguf import BLOCK, gguf_name, rotary_permute

QTYPES = ("TQ1_0", "TQ2_0")
ARCHITECTURES = ("llama",)


def check_config(config: dict) -> None:
    if config.get("model_type") not in ARCHITECTURES:
        raise TernaryError(f"--to-gguf writes the llama architecture; this model is "
                           f"{config.get('model_type')!r}")


def _metadata(w, config: dict) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_name(config.get("_name_or_path") or "mlx-ternary model")
    w.add_context_length(config.get("max_position_embeddings", 2048))
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config.get("num_key_value_heads", heads))
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(config["vocab_size"])


def _tokenizer(w, tokenizer_json: Optional[str], tokenizer_config: dict, config: dict) -> None:
    if not tokenizer_json:
        return
    tj = json.loads(tokenizer_json)
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise TernaryError("--to-gguf rebuilds BPE (byte-level) tokenizers; this model's "
                           f"tokenizer.json has a {model.get('type')!r} model")
    vocab = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    vocab.update(special)
    n = max(config["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # llama.cpp UNUSED for holes
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = 3 if tok in special and i == special[tok] else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        v = config.get(key)
        v = v[0] if isinstance(v, list) else v
        if v is not None:
            add(int(v))
    if tokenizer_config.get("chat_template"):
        w.add_chat_template(tokenizer_config["chat_template"])


def _float_tensor(arr: mx.array) -> Tuple[np.ndarray, object]:
    from gguf import GGMLQuantizationType as Q

    if arr.dtype == mx.float16:
        return np.array(arr), None
    if arr.dtype == mx.bfloat16:
        return np.array(arr.view(mx.uint16)).view(np.uint8).reshape(*arr.shape[:-1], -1), Q.BF16
    return np.array(arr.astype(mx.float32)), None


def ternary_tensor(hf: str, pt: PackedTernary, qtype: str, config: dict):
    """(data, raw dtype or None, max round-trip error) of one ternary weight."""
    from gguf import GGMLQuantizationType, quants

    w = pt.dequantize(np.float32)
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads")
    if ".q_proj." in hf:
        w = rotary_permute(w, heads)
    elif ".k_proj." in hf:
        w = rotary_permute(w, kv or heads)
    if pt.in_features % BLOCK:
        exact16 = np.array_equal(w.astype(np.float16).astype(np.float32), w)
        return (w.astype(np.float16) if exact16 else w), None, 0.0
    if pt.scales.shape[1] > 1 and pt.group_size < BLOCK:
        s = pt.scales.reshape(pt.out_features, -1, BLOCK // pt.group_size)
        if not (s == s[:, :, :1]).all():
            raise TernaryError(f"{hf}: its scales change every {pt.group_size} columns; TQ "
                               f"blocks hold one scale per {BLOCK}. Convert to the native or "
                               "MLX formats instead")
    q = GGMLQuantizationType[qtype]
    data = quants.quantize(w, q)
    back = quants.dequantize(data, q).reshape(w.shape)
    return data, q, float(np.abs(back - w).max(initial=0.0))


def write(out_file: Path, config: dict, items: Iterator[Tuple[str, object]],
          qtype: str = "TQ2_0", tokenizer_json: Optional[str] = None,
          tokenizer_config: Optional[dict] = None,
          on_tensor: Optional[Callable[[str, str, float], None]] = None) -> None:
    """Stream (name, tensor | PackedTernary) items into a GGUF file.

    Args:
        on_tensor: called as (name, kind, max round-trip error) after each tensor.
    """
    from gguf import GGUFWriter, LlamaFileType

    check_config(config)
    if qtype not in QTYPES:
        raise TernaryError(f"--gguf-type must be one of {QTYPES}, got {qtype!r}")
    w = GGUFWriter(str(out_file), "llama", use_temp_file=True)
    _metadata(w, config)
    w.add_file_type(LlamaFileType[f"MOSTLY_{qtype}"])
    _tokenizer(w, tokenizer_json, tokenizer_config or {}, config)
    for name, item in items:
        hf = f"{name}.weight" if isinstance(item, PackedTernary) else name
        g = gguf_name(hf)
        if g is None:
            raise TernaryError(f"{hf}: no llama.cpp name for this tensor (readers/gguf.py "
                               "NAME_TABLE); --to-gguf writes llama models")
        if isinstance(item, PackedTernary):
            data, raw, err = ternary_tensor(hf, item, qtype, config)
            kind = raw.name if raw is not None else str(data.dtype)
        else:
            data, raw = _float_tensor(item)
            if ".q_proj." in hf or ".k_proj." in hf:
                raise TernaryError(f"{hf}: float Q/K projections are not exported to GGUF")
            err, kind = 0.0, raw.name if raw is not None else str(data.dtype)
        w.add_tensor(g, data, raw_dtype=raw)
        if on_tensor:
            on_tensor(name, kind, err)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
