"""GGUF files laid out as llama.cpp's own tools write them, built with gguf-py (tests only).

A "quantizer-style" file has its projections in TQ1_0/TQ2_0, token_embd in Q4_K (Q4_0
where llama.cpp's quantizer would pick it), output in Q6_K, 1-D tensors in F32, and
llama's Q/K rows in llama.cpp's rotary order. gguf-py 0.19 quantizes TQ*/Q4_0/Q4_1/Q8_0
but not k-quants: those blocks are random bytes in the exact on-disk layout with sane
float16 scales, and gguf-py's `dequantize` says what they mean.
"""

import json
from pathlib import Path

import numpy as np

from mlx_ternary.checkpoint.gguf_tables import ARCHITECTURES, NameTable

VOCAB = 128
DIMS = dict(
    hidden_size=256,
    num_hidden_layers=2,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
)
# byte offsets of the float16 scales in each k-quant block: (block bytes, [offsets])
K_SCALES = {
    "Q4_K": (144, [0, 2]),
    "Q5_K": (176, [0, 2]),
    "Q6_K": (210, [208]),
    "Q2_K": (84, [80, 82]),
    "Q3_K": (110, [108]),
}


def permute(w, n_head):  # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, restated
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def quantized(w_or_shape, qtype: str, rng):
    """(bytes (rows, row_bytes) uint8, float32 values gguf-py decodes them to)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    q = Q[qtype]
    if qtype in K_SCALES:
        rows, cols = w_or_shape
        size, offsets = K_SCALES[qtype]
        blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
        for off in offsets:
            d = rng.uniform(2e-4, 2e-3, blocks.shape[:2]).astype(np.float16)
            blocks[:, :, off : off + 2] = d.view(np.uint8).reshape(*d.shape, 2)
        data = blocks.reshape(rows, -1)
    else:
        data = quants.quantize(np.asarray(w_or_shape, dtype=np.float32), q)
    return data, quants.dequantize(data, q).reshape(data.shape[0], -1)


def byte_vocab():
    """A byte-level BPE vocabulary (special tokens 0, 1) with a few merges."""
    from tokenizers import pre_tokenizers

    alpha = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]
    rest = sorted(set(pre_tokenizers.ByteLevel.alphabet()) - set(alpha))
    merged = ["\u0120t", "he", "\u0120the", "in"]
    tokens = ["<s>", "</s>"] + merged + (alpha + rest)[: VOCAB - 6]
    return tokens, ["\u0120 t", "h e", "\u0120t he", "i n"]


def bpe_tokenizer(out: Path) -> None:
    """Replace a checkpoint's tokenizer with a byte-level BPE that has merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = byte_vocab()
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]
        )
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))


def add_tokenizer(w, pre: str = "gpt-2") -> None:
    tokens, merges = byte_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)


def write(
    path: Path,
    arch: str,
    *,
    ternary=("TQ2_0", "TQ1_0"),
    embd="Q4_K",
    output="Q6_K",
    seed: int = 0,
    extra_kv=None,
):
    """A quantizer-style GGUF of `arch` (llama, qwen3, bitnet, bitnet-b1.58).

    Returns (path, config, weights): weights are the float32 Hugging Face-named values
    the file encodes (ternary ones as s * t), what a loaded model must hold.
    """
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    spec = ARCHITECTURES[arch]
    names = NameTable(spec.names)
    d = DIMS
    h, heads, kv = d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"]
    hd = h // heads
    w = GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_block_count(d["num_hidden_layers"])
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    if arch == "qwen3":
        w.add_key_length(hd)
        w.add_value_length(hd)
    for key, value in (extra_kv or {}).items():
        (w.add_string if isinstance(value, str) else w.add_uint32)(key, value)
    add_tokenizer(w)
    weights = {}

    def put(gname, data, raw=None, values=None):
        w.add_tensor(gname, data, raw_dtype=raw)
        weights[names.hf(gname)] = np.asarray(
            values if values is not None else data, dtype=np.float32
        )

    data, values = (
        quantized((VOCAB, h), embd, rng)
        if embd in K_SCALES
        else quantized(rng.normal(0, 1, (VOCAB, h)), embd, rng)
    )
    put("token_embd.weight", data, Q[embd], values)
    if output:
        data, values = (
            quantized((VOCAB, h), output, rng)
            if output in K_SCALES
            else quantized(rng.normal(0, 1, (VOCAB, h)), output, rng)
        )
        put("output.weight", data, Q[output], values)
    put("output_norm.weight", (1 + 0.1 * rng.normal(size=h)).astype(np.float32))
    shapes = {
        "attn_q": (h, h),
        "attn_k": (kv * hd, h),
        "attn_v": (kv * hd, h),
        "attn_output": (h, h),
        "ffn_gate": (d["intermediate_size"], h),
        "ffn_up": (d["intermediate_size"], h),
        "ffn_down": (h, d["intermediate_size"]),
    }
    norms = {"attn_norm": h, "ffn_norm": h}
    if spec.model_type == "bitnet":
        norms.update(attn_sub_norm=h, ffn_sub_norm=d["intermediate_size"])
    if arch == "qwen3":
        norms.update(attn_q_norm=hd, attn_k_norm=hd)
    for i in range(d["num_hidden_layers"]):
        for g, n in norms.items():
            put(f"blk.{i}.{g}.weight", (1 + 0.1 * rng.normal(size=n)).astype(np.float32))
        for j, (g, shape) in enumerate(shapes.items()):
            t = rng.integers(-1, 2, shape).astype(np.float32)
            s = np.float32(np.float16(rng.uniform(0.01, 0.1)))  # exact in float16
            hf_values = t * s
            stored = hf_values
            if spec.rotary_permuted and g in ("attn_q", "attn_k"):
                stored = permute(hf_values, heads if g == "attn_q" else kv)
            qt = Q[ternary[j % len(ternary)]]
            from gguf import quants

            w.add_tensor(f"blk.{i}.{g}.weight", quants.quantize(stored, qt), raw_dtype=qt)
            weights[names.hf(f"blk.{i}.{g}.weight")] = hf_values
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = {
        "model_type": spec.model_type,
        **DIMS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": not output,
        "max_position_embeddings": 256,
    }
    if arch == "qwen3":
        config["head_dim"] = hd
    return path, config, weights


def reference_logits(config: dict, weights: dict, tokens) -> np.ndarray:
    """mlx-lm's own class for the config, plain Linear layers, holding `weights`."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    from mlx_ternary.runtime.layers import linear_paths, swap_modules

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    dims = linear_paths(model)
    swap_modules(
        model, lambda p, m: nn.Linear(*dims[p][:2], bias=dims[p][2]) if p in dims else None
    )
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return np.array(model(mx.array([tokens])).astype(mx.float32))


def config_json(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
