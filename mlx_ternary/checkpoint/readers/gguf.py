"""Reader for llama.cpp GGUF files: ternary tensors, quantized and float ones beside them.

Architectures: llama, qwen2, qwen3, bitnet (mainline llama.cpp) and bitnet.cpp's
bitnet-b1.58 / bitnet-25 (gguf_tables.ARCHITECTURES). Tensors, by type:
- TQ1_0 / TQ2_0, I2_S (bitnet.cpp), and Q8_0 whose codes are all in {-1, 0, 1}:
  ternary, read exactly as s * t (PackedTernary).
- Q8_0 / Q4_K / Q5_K / Q6_K (llama-quantize's tables): kept as their GGUF blocks
  (module path, GGMLTensor); Q4_0 / Q4_1: MLX affine codes, exactly (AffineTensor); with
  keep_affine=False all of them become floats.
- every other type gguf-py dequantizes (Q2_K, Q3_K, Q5_x, IQ*, ...): float16.
- F32 / F16 / BF16: as stored; ternary when our own writer listed them as such.
llama.cpp stores llama's Q and K rows in its rotary pair order; reading undoes it.
The tokenizer is rebuilt from the metadata (readers/gguf_tokenizer.py).
"""

import json
from collections import Counter
from pathlib import Path
from typing import Iterator, Tuple

import mlx.core as mx
import numpy as np

from ...errors import FormatError
from ...format import GGML_TABLES, GGMLTensor, PackedTernary, ceil_div, expand_scales
from ..gguf_tables import (
    ARCHITECTURES,
    IGNORED_TENSORS,
    META,
    Q_BLOCK,
    TQ_BLOCK,
    NameTable,
    rotary_heads,
    rotary_unpermute,
)
from . import gguf_quants as gq
from . import i2s
from .common import Source
from .config_check import check_counts
from .gguf_file import GGUFFile
from .gguf_tokenizer import tokenizer_files

TERNARY_TYPES = ("TQ1_0", "TQ2_0", "I2_S")
FLOAT_TYPES = ("F32", "F16", "BF16")


def detect(path: Path) -> bool:
    """True for a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _one(value, key: str, path: Path):
    """A per-layer array with one value throughout -> that value."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise FormatError(
                f"{path}: {key} differs between layers ({sorted(set(value))}); "
                "mlx-lm's classes need one value for every layer"
            )
        return value[0]
    return value


def _rope_scaling(a, path: Path):
    kind = a("rope.scaling.type")
    factor = a("rope.scaling.factor", 1.0)
    if kind in (None, "none") or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"type": "yarn", "factor": float(factor)}
        orig = a("rope.scaling.original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        return out
    raise FormatError(
        f"{path}: rope.scaling.type {kind!r} is not one mlx-ternary maps "
        "(supported: none, linear, yarn)"
    )


def read_config(gf: GGUFFile, path: Path) -> dict:
    """The Hugging Face / mlx-lm config the file's metadata describes."""
    name = gf.field("general.architecture")
    if name not in ARCHITECTURES:
        raise FormatError(
            f"{path}: GGUF architecture {name!r} is not one mlx-ternary reads "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    arch = ARCHITECTURES[name]
    a = lambda key, default=None: gf.field(f"{name}.{key}", default)  # noqa: E731
    tensors = {t.name: t for t in gf.tensors}
    tokens = gf.field("tokenizer.ggml.tokens") or []
    embd = tensors.get("token_embd.weight")
    heads = _one(a("attention.head_count"), f"{name}.attention.head_count", path)
    hidden = a("embedding_length")
    config = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": a("block_count"),
        "intermediate_size": _one(a("feed_forward_length"), f"{name}.feed_forward_length", path),
        "num_attention_heads": heads,
        "num_key_value_heads": _one(
            a("attention.head_count_kv", heads), f"{name}.attention.head_count_kv", path
        ),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": a("rope.freq_base", 10000.0),
        "max_position_embeddings": a("context_length", 2048),
        "vocab_size": a("vocab_size") or (embd.shape[0] if embd else len(tokens)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_scaling": _rope_scaling(a, path),
    }
    missing = [k for k, v in config.items() if v is None and k != "rope_scaling"]
    if missing:
        raise FormatError(f"{path}: GGUF metadata lacks the {name}.* entries for {missing}")
    check_counts(config, ("hidden_size", "num_attention_heads"), path)
    head_dim = a("attention.key_length") or hidden // heads
    if head_dim != hidden // heads or arch.model_type == "qwen3":
        config["head_dim"] = head_dim
    rot = a("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise FormatError(
            f"{path}: {name}.rope.dimension_count is {rot} but heads are "
            f"{head_dim} wide; partial rotary is not supported for {name}"
        )
    if arch.model_type == "bitnet":
        config["hidden_act"] = a("hidden_activation", arch.hidden_act)
    for key in ("bos_token_id", "eos_token_id"):
        v = gf.field(f"tokenizer.ggml.{key}")
        if v is not None:
            config[key] = int(v)
    if gf.field(f"{META}.intermediate_size"):  # MLP zero-padded to whole TQ blocks
        config["intermediate_size"] = int(gf.field(f"{META}.intermediate_size"))
    stored = gf.field(f"{META}.config")  # our own exports: what GGUF keys cannot say
    if stored:
        extra = json.loads(stored)
        config.update({k: v for k, v in extra.items() if k not in config or k == "rope_scaling"})
    return config


def _activation_bits(gf: GGUFFile, arch_name: str):
    v = gf.field(f"{META}.activation_bits")
    if v is not None:
        return int(v) or None
    # BitNet b1.58 is trained with int8 activations; llama.cpp quantizes them too
    return 8 if ARCHITECTURES[arch_name].model_type == "bitnet" else None


def _activations(gf: GGUFFile) -> str:
    """llama.cpp's files run as llama.cpp computes them (its Q8_K activation blocks); our
    exports, which record the model's own definition, keep it."""
    return "model" if gf.field(f"{META}.activation_bits") is not None else "q8k"


def _exact_scales(gf: GGUFFile, name: str, d: np.ndarray, block: int, cols: int, label: str):
    """Our writer's float32 scales for a tensor whose block d are their float16 rounding."""
    stored = gf.field(f"{META}.scale.{name}")
    if stored is None:
        return None
    s = np.asarray(stored, dtype=np.float32)
    s = s.reshape(1 if s.size == 1 else d.shape[0], -1)
    gs = gf.field(f"{META}.group_size") if s.shape[1] > 1 else None
    starts = np.broadcast_to(expand_scales(s, cols, gs), (d.shape[0], cols))[:, ::block]
    d = d.astype(np.float16)
    if not np.array_equal(np.where(d == 0, 0, starts.astype(np.float16)), d):  # 0: no trits
        raise FormatError(
            f"{label}: {META}.scale.{name} disagrees with the tensor's block "
            "scales; the file is corrupt: re-export it"
        )
    return s, gs


def _padding(gf: GGUFFile, hf: str):
    """(rows, cols) to keep of an MLP weight our writer zero-padded to whole TQ blocks."""
    n = gf.field(f"{META}.intermediate_size")
    if n is None:
        return None, None
    if ".mlp.gate_proj." in hf or ".mlp.up_proj." in hf:
        return int(n), None
    return (None, int(n)) if ".mlp.down_proj." in hf else (None, None)


def _cut(a: np.ndarray, keep, label: str) -> np.ndarray:
    """Slice the padding off (it must be zeros)."""
    rows, cols = keep
    rows = a.shape[0] if rows is None else rows
    cols = a.shape[-1] if cols is None else cols
    if a[rows:].any() or a[:, cols:].any():
        raise FormatError(
            f"{label}: the zero padding beyond ({rows}, {cols}) that "
            f"{META}.intermediate_size declares is not zero; the file is corrupt"
        )
    return a[:rows, :cols]


def _cut_scales(s: np.ndarray, keep, block: int) -> np.ndarray:
    rows, cols = keep
    if rows is not None and s.shape[0] > 1:
        s = s[:rows]
    if cols is not None and s.shape[1] > 1:
        s = s[:, : ceil_div(cols, block)]
    return s


def _ternary(t, d, block, n_head, packing, label, exact=None, keep=(None, None)):
    """PackedTernary from trits and per-block scales (or exact ones), rows in HF order."""
    s, gs = exact if exact is not None else (d, None)
    if n_head:
        order = rotary_unpermute(np.arange(t.shape[0]), n_head)
        t = t[order]
        s = s[order] if s.shape[0] > 1 else s
    t = _cut(t, keep, label)
    s = _cut_scales(s, keep, gs or block or 1)
    if exact is None and block:
        reduced = gq.reduce_scales(s, block)
        if reduced is None:
            return None
        s, gs = reduced
    return PackedTernary.from_trits(t, s, packing, gs, name=label)


def _float(raw, info, qtype):
    if info.type_name == "F32":
        return np.asarray(raw).view(np.float32).reshape(info.shape)
    if info.type_name == "F16":
        return np.asarray(raw).view(np.float16).reshape(info.shape)
    if info.type_name == "BF16":
        return np.asarray(raw).view(np.uint16).reshape(info.shape)
    return gq.dequantize(raw, qtype, info.shape)


def _blocks(raw, kind: str, rows: int, cols: int, n_head) -> GGMLTensor:
    """A llama.cpp table kept as its blocks (rows in Hugging Face order)."""
    blocks = np.ascontiguousarray(raw).reshape(rows, -1)
    if n_head:
        blocks = blocks[rotary_unpermute(np.arange(rows), n_head)]
    return GGMLTensor(mx.array(blocks), kind, cols)


def _tensor(gf, info, hf, config, packing, keep_affine, n_head, ternary_names):
    """One GGUF tensor -> (name, PackedTernary | AffineTensor | mx.array)."""
    from gguf import GGMLQuantizationType

    label = f"{gf.path.name}: {info.name}"
    raw = gf.tensor_bytes(info)
    module = hf.rpartition(".")[0]
    kind = info.type_name
    matrix = len(info.shape) == 2
    rows, cols = info.shape if matrix else (1, info.shape[0])
    keep = _padding(gf, hf)
    if kind in ("TQ1_0", "TQ2_0"):
        t, d = gq.tq_trits(raw, GGMLQuantizationType[kind], rows, cols, label)
        exact = _exact_scales(gf, info.name, d, TQ_BLOCK, cols, label)
        return module, _ternary(t, d, TQ_BLOCK, n_head, packing, label, exact, keep)
    if kind == "I2_S":
        t, s = i2s.decode(raw, rows, cols, label)
        return module, _ternary(t, s, None, n_head, packing, label, None, keep)
    if kind == "Q8_0" and matrix:
        found = gq.q8_0_trits(raw, rows, cols)
        if found is not None:
            exact = _exact_scales(gf, info.name, found[1], Q_BLOCK, cols, label)
            pt = _ternary(*found, Q_BLOCK, n_head, packing, label, exact, keep)
            if pt is not None:
                return module, pt
    if kind in GGML_TABLES and matrix and keep_affine and keep == (None, None):
        return module, _blocks(raw, kind, rows, cols, n_head)
    if kind in gq.AFFINE_TYPES and matrix and keep_affine and keep == (None, None):
        at = gq.affine(raw, kind, rows, cols)
        if n_head:
            order = mx.array(rotary_unpermute(np.arange(rows), n_head))
            at = type(at)(
                at.weight[order], at.scales[order], at.biases[order], at.bits, at.group_size
            )
        return module, at
    try:
        w = _float(raw, info, None if kind in FLOAT_TYPES else GGMLQuantizationType[kind])
    except (KeyError, NotImplementedError):
        raise FormatError(
            f"{label}: GGUF type {kind} is not read by mlx-ternary (reads "
            "F32/F16/BF16, TQ1_0/TQ2_0, I2_S and the types gguf-py "
            "dequantizes)"
        ) from None
    if n_head:
        w = rotary_unpermute(w, n_head)
    if matrix:
        w = _cut(w, keep, label)
    if info.name in ternary_names and kind in FLOAT_TYPES:
        found = gq.float_trits(
            w.astype(np.float32) if kind != "BF16" else (w.astype(np.uint32) << 16).view(np.float32)
        )
        if found is None:
            raise FormatError(
                f"{label}: listed as ternary in {META}.ternary but its values "
                "are not s * t per row; the file is corrupt"
            )
        return module, PackedTernary.from_trits(*found, packing, name=label)
    arr = mx.array(np.ascontiguousarray(w))
    return hf, arr.view(mx.bfloat16) if kind == "BF16" else arr


def iter_items(
    path: Path, config: dict, packing: str, *, keep_affine: bool = True, unpermute: bool = True
) -> Iterator[Tuple[str, object]]:
    gf = GGUFFile(path)
    arch = ARCHITECTURES[gf.field("general.architecture")]
    names = NameTable(arch.names)
    ternary_names = set(gf.field(f"{META}.ternary") or [])
    for info in gf.tensors:
        if info.name in IGNORED_TENSORS:
            continue
        hf = names.hf(info.name)
        if hf is None:
            raise FormatError(
                f"{path}: tensor {info.name} ({info.type_name}) has no entry in "
                f"the {arch.gguf} name table (gguf_tables.ARCHITECTURES)"
            )
        n_head = rotary_heads(hf, config) if arch.rotary_permuted and unpermute else None
        try:
            item = _tensor(gf, info, hf, config, packing, keep_affine, n_head, ternary_names)
            gf.release(info)  # its pages leave this process's RSS, not the file
        except FormatError:
            raise
        except (ValueError, IndexError, TypeError, ArithmeticError) as e:  # a corrupt table
            raise FormatError(
                f"{path}: tensor {info.name} ({info.type_name}, shape {info.shape}) cannot "
                f"be decoded ({type(e).__name__}: {e}); the file is corrupt: re-download it"
            ) from None
        yield item
        gf.release(info)  # the item holds its own copy: the file's pages can go


def source(path: Path, packing: str, *, keep_affine: bool = True, unpermute: bool = True) -> Source:
    """A convert Source for a .gguf file.

    Args:
        keep_affine: yield Q8_0/Q4_K/Q5_K/Q6_K tensors as GGMLTensor (their blocks) and
            Q4_0/Q4_1 as AffineTensor (else floats).
        unpermute: undo llama.cpp's Q/K row order (False only for negative controls).
    """
    path = Path(path)
    gf = GGUFFile(path)
    try:
        config = read_config(gf, path)
    except FormatError:
        raise
    except (ValueError, TypeError, ArithmeticError, KeyError, AttributeError) as e:
        raise FormatError(
            f"{path}: GGUF metadata does not describe a model mlx-ternary can build "
            f"({type(e).__name__}: {e}); the file is corrupt: re-download it"
        ) from None
    files = tokenizer_files(gf, path)
    kept = [t for t in gf.tensors if t.name not in IGNORED_TENSORS]
    types = Counter(t.type_name for t in kept)
    arch = gf.field("general.architecture")
    notes = []
    lossy = sorted(
        {t.type_name for t in kept}
        - set(TERNARY_TYPES + FLOAT_TYPES)
        - set(gq.AFFINE_TYPES)
        - set(GGML_TABLES)
    )
    if lossy:
        notes.append(
            f"non-ternary {', '.join(lossy)} tensors are dequantized to float16 "
            "(no exact MLX form kept)"
        )
    groups = {TQ_BLOCK for t in kept if t.type_name in ("TQ1_0", "TQ2_0")}
    summary = ", ".join(f"{n} {k}" for k, n in types.most_common())
    return Source(
        path=path,
        kind=f"llama.cpp GGUF ({arch}: {summary})",
        config=config,
        count=len(kept),
        items=lambda: iter_items(
            path, config, packing, keep_affine=keep_affine, unpermute=unpermute
        ),
        activation_bits=_activation_bits(gf, arch),
        activations=_activations(gf),
        group_size=groups.pop() if groups else None,
        tokenizer_files=files,
        notes=notes,
    )
