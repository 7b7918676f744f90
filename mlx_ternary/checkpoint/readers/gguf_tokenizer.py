"""A Hugging Face tokenizer rebuilt from GGUF metadata (byte-level BPE, "gpt2" model).

`tokenizer.ggml.pre` decides how text is split before BPE; it is honoured with the
split patterns llama.cpp uses for that name (gguf_tables.PRE_TOKENIZERS). CONTROL
tokens (type 3) become special added tokens, USER_DEFINED ones (type 4) plain added
tokens; a BOS is prepended when `tokenizer.ggml.add_bos_token` says so (or, without
the key, where llama.cpp adds it by default: the llama-bpe family).
"""

import json
from pathlib import Path
from typing import Dict

from ...errors import FormatError
from ..gguf_tables import PRE_ALIASES, PRE_TOKENIZERS, hf_pre_tokenizer, pre_tokenizer
from .gguf_file import GGUFFile

CONTROL, USER_DEFINED = 3, 4


def _add_bos(gf: GGUFFile, pre_name: str) -> bool:
    explicit = gf.field("tokenizer.ggml.add_bos_token")
    if explicit is not None:
        return bool(explicit)
    return PRE_ALIASES.get(pre_name, pre_name) == "llama-bpe"


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes the reader kept as lone surrogates: not UTF-8
        return False
    return True


def _vocabulary(gf: GGUFFile, path: Path):
    """(tokens, token types, merge pairs) from the metadata, each checked for its form."""
    tokens = gf.field("tokenizer.ggml.tokens") or []
    merges = gf.field("tokenizer.ggml.merges") or []
    if not _strings(tokens) or not _strings(merges):
        raise FormatError(
            f"{path}: tokenizer.ggml.tokens and tokenizer.ggml.merges must be arrays of "
            "strings; the file is corrupt: re-download it"
        )
    bad = next((t for t in tokens + merges if not _encodable(t)), None)
    if bad is not None:
        raise FormatError(
            f"{path}: a tokenizer string ({bad!r}) is not valid UTF-8; the file is "
            "corrupt: re-download it"
        )
    if any(" " not in m for m in merges):
        raise FormatError(f"{path}: a tokenizer.ggml.merges entry is not two tokens 'a b'")
    types = gf.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        raise FormatError(
            f"{path}: tokenizer.ggml.token_type has no entry for each of the "
            f"{len(tokens)} tokens; the file is corrupt: re-download it"
        )
    return tokens, types, [tuple(m.split(" ", 1)) for m in merges]


def tokenizer_files(gf: GGUFFile, path: Path) -> Dict[str, str]:
    """tokenizer.json and tokenizer_config.json rebuilt from the metadata ({} if none)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    kind = gf.field("tokenizer.ggml.model")
    if kind is None:
        return {}
    if kind != "gpt2":
        raise FormatError(
            f"{path}: tokenizer.ggml.model is {kind!r}; mlx-ternary rebuilds "
            "byte-level BPE ('gpt2') tokenizers from GGUF. Convert, then copy "
            "the original tokenizer files into the output directory"
        )
    pre_name = gf.field("tokenizer.ggml.pre", "default")  # llama.cpp's fallback too
    pre = pre_tokenizer(pre_name)
    if pre is None:
        known = ", ".join(sorted(set(PRE_TOKENIZERS) | set(PRE_ALIASES)))
        raise FormatError(
            f"{path}: tokenizer.ggml.pre {pre_name!r} is not a pre-tokenizer "
            f"mlx-ternary can rebuild (known: {known})"
        )
    tokens, types, merges = _vocabulary(gf, path)
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    try:  # tokenizers raises a bare Exception on merges it cannot resolve
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, unk_token=None, ignore_merges=pre.ignore_merges)
        )
    except Exception as e:
        raise FormatError(
            f"{path}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e}); "
            "the file is corrupt: re-download it"
        ) from None
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = hf_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(t, special=ty == CONTROL, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (CONTROL, USER_DEFINED)
    ]
    if added:
        tok.add_tokens(added)
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for key in ("bos", "eos", "unknown", "padding"):
        i = gf.field(f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            cfg[{"unknown": "unk", "padding": "pad"}.get(key, key) + "_token"] = tokens[int(i)]
    if _add_bos(gf, pre_name) and "bos_token" in cfg:
        bos = cfg["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    template = gf.field("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(cfg, indent=2)}
