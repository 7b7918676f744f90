"""Reader for llama.cpp GGUF files with TQ1_0 / TQ2_0 ternary tensors.

`mx.load` stops at the first tensor type it does not know (TQ1_0 / TQ2_0) and drops
the rest, so tensors are read with `gguf.GGUFReader` one at a time. TQ blocks hold
256 weights of one row with an fp16 scale d (the block absmax): w = d * t exactly.
F32 / F16 / BF16 / Q8_0 tensors beside them become floats.

llama.cpp stores the Q and K projection rows permuted for its rotary layout (its
HF -> GGUF converter does this for llama); reading undoes it. The tokenizer is
rebuilt from the GGUF metadata (BPE "gpt2" vocabularies).
"""

import json
import re
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import FormatError
from ..format import PackedTernary
from .common import Source

BLOCK = 256
TERNARY_TYPES = ("TQ1_0", "TQ2_0")
FLOAT_TYPES = ("F32", "F16", "BF16", "Q8_0")
ARCHITECTURES = ("llama",)

# llama.cpp tensor name -> Hugging Face / mlx-lm parameter name ({i}: the layer).
NAME_TABLE = {
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
IGNORED = ("rope_freqs.weight",)  # llama.cpp's precomputed rope factors: mlx-lm derives them
_PATTERNS = [(re.compile("^" + re.escape(k).replace(r"\{i\}", r"(\d+)") + "$"), v)
             for k, v in NAME_TABLE.items()]


def hf_name(gguf_name: str) -> Optional[str]:
    for pat, hf in _PATTERNS:
        m = pat.match(gguf_name)
        if m:
            return hf.format(i=m.group(1)) if m.groups() else hf
    return None


def gguf_name(hf: str) -> Optional[str]:
    """The inverse of hf_name."""
    for g, h in NAME_TABLE.items():
        pat = "^" + re.escape(h).replace(r"\{i\}", r"(\d+)") + "$"
        m = re.match(pat, hf)
        if m:
            return g.format(i=m.group(1)) if m.groups() else g
    return None


def rotary_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF row order -> llama.cpp's (rows of each head interleaved as pairs)."""
    n = w.shape[0]
    return w.reshape(n_head, 2, n // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rotary_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order -> HF's (the inverse of rotary_permute)."""
    n = w.shape[0]
    return w.reshape(n_head, n // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct errors/IndexError on bad files
        raise FormatError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                          "it may be truncated: re-download it") from None


def _field(reader, key: str, default=None):
    f = reader.get_field(key)
    return default if f is None else f.contents()


def read_config(reader, path: Path) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise FormatError(f"{path}: GGUF architecture {arch!r} is not one mlx-ternary reads "
                          f"(supported: {', '.join(ARCHITECTURES)})")
    a = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    heads = a("attention.head_count")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": a("embedding_length"),
        "num_hidden_layers": a("block_count"),
        "intermediate_size": a("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": a("attention.head_count_kv", heads),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": a("rope.freq_base", 10000.0),
        "max_position_embeddings": a("context_length", 2048),
        "vocab_size": a("vocab_size", len(tokens)),
        "tie_word_embeddings": "output.weight" not in names,
    }
    if a("attention.key_length") is not None:
        config["head_dim"] = a("attention.key_length")
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            config[hf] = int(v)
    missing = [k for k, v in config.items() if v is None]
    if missing:
        raise FormatError(f"{path}: GGUF metadata lacks {arch}.* entries for {missing}")
    return config


def tokenizer_files(reader, path: Path) -> Dict[str, str]:
    """tokenizer.json and tokenizer_config.json rebuilt from the GGUF metadata."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        return {}
    if kind != "gpt2":
        raise FormatError(f"{path}: tokenizer.ggml.model is {kind!r}; mlx-ternary rebuilds "
                          "BPE ('gpt2') tokenizers from GGUF. Copy the original tokenizer "
                          "files into the output directory instead")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in (_field(reader, "tokenizer.ggml.merges") or [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               unk_token=None, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == 3]  # llama.cpp CONTROL tokens
    if special:
        tok.add_special_tokens(special)
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, field in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
        i = _field(reader, f"tokenizer.ggml.{field}")
        if i is not None and 0 <= int(i) < len(tokens):
            cfg[key] = tokens[int(i)]
    template = _field(reader, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(cfg, indent=2)}


def ternary_blocks(raw: np.ndarray, qtype, rows: int, cols: int, name: str):
    """TQ1_0/TQ2_0 bytes -> (trits (rows, cols) int8, block scales (rows, cols/256) fp16)."""
    from gguf import GGML_QUANT_SIZES, quants

    _, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(raw).reshape(rows, -1)
    w = quants.dequantize(raw, qtype).reshape(rows, cols)
    d = raw.reshape(rows, cols // BLOCK, block_bytes)[:, :, -2:].copy().view(np.float16)
    d = d.reshape(rows, cols // BLOCK)
    dd = np.repeat(d.astype(np.float32), BLOCK, axis=1)
    t = np.rint(np.divide(w, dd, out=np.zeros_like(w), where=dd != 0)).astype(np.int8)
    if not np.array_equal(t.astype(np.float32) * dd, w) or (np.abs(t) > 1).any():
        raise FormatError(f"{name}: {qtype.name} blocks do not decode to d * t; the file "
                          "is corrupt: re-download it")
    return t, d


def _reduce(d: np.ndarray):
    if (d == d.flat[0]).all():
        return d[:1, :1], None
    if (d == d[:, :1]).all():
        return d[:, :1], None
    return d, BLOCK


def iter_native(path: Path, config: dict, packing: str,
                unpermute: bool = True) -> Iterator[Tuple[str, object]]:
    from gguf import GGMLQuantizationType as Q

    reader = _open(path)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    for tensor in reader.tensors:
        if tensor.name in IGNORED:
            continue
        hf = hf_name(tensor.name)
        if hf is None:
            raise FormatError(f"{path}: tensor {tensor.name} has no entry in the llama.cpp -> "
                              "Hugging Face name table (readers/gguf.py NAME_TABLE)")
        qtype = tensor.tensor_type
        shape = tuple(int(x) for x in reversed(tensor.shape))  # ggml lists ne0 (columns) first
        label = f"{path.name}: {tensor.name}"
        unperm = {".q_proj.": heads, ".k_proj.": kv}
        n_head = next((v for k, v in unperm.items() if k in hf), None) if unpermute else None
        if qtype.name in TERNARY_TYPES:
            rows, cols = shape
            t, d = ternary_blocks(np.asarray(tensor.data), qtype, rows, cols, label)
            if n_head:
                t, d = rotary_unpermute(t, n_head), rotary_unpermute(d, n_head)
            s, gs = _reduce(d)
            yield hf.rpartition(".")[0], PackedTernary.from_trits(t, s, packing, gs, name=label)
        elif qtype.name in FLOAT_TYPES:
            from gguf import quants

            data = np.asarray(tensor.data)
            if qtype == Q.F16:
                w = data.reshape(shape)
            elif qtype == Q.F32:
                w = data.reshape(shape).astype(np.float32)
            else:
                w = quants.dequantize(data, qtype).reshape(shape).astype(np.float32)
            if n_head:
                w = rotary_unpermute(w, n_head)
            yield hf, mx.array(np.ascontiguousarray(w))
        else:
            raise FormatError(f"{label}: GGUF type {qtype.name} is not read by mlx-ternary "
                              f"(reads {', '.join(TERNARY_TYPES + FLOAT_TYPES)})")


def detect(path: Path) -> bool:
    """A single .gguf file."""
    return path.is_file() and path.suffix == ".gguf"


def source(path: Path, packing: str, unpermute: bool = True) -> Source:
    """A convert Source for a .gguf file (`unpermute=False` only for negative controls)."""
    reader = _open(path)
    config = read_config(reader, path)
    files = tokenizer_files(reader, path)
    n = sum(1 for t in reader.tensors if t.name not in IGNORED)
    groups = {BLOCK for t in reader.tensors if t.tensor_type.name in TERNARY_TYPES}
    del reader
    return Source(path=path, kind="llama.cpp GGUF (TQ1_0/TQ2_0)", config=config, count=n,
                  items=lambda: iter_native(path, config, packing, unpermute),
                  group_size=groups.pop() if groups else None,
                  tokenizer_files=files)
