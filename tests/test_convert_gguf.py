"""GGUF TQ1_0 / TQ2_0 in and out, checked against gguf-py's own quantizers and reader."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_ternary
from mlx_ternary.convert import convert, convert_source
from mlx_ternary.errors import FormatError
from mlx_ternary.readers import gguf as gguf_reader

from tiny import write_tokenizer

TOKENS = mx.array([[3, 17, 42, 5, 99, 64, 1, 20]])
CONFIG = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128,
              tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=256,
              bos_token_id=0, eos_token_id=1)
PROJ = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj"}


def permute(w, n_head):  # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, restated
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def reference_model(weights):
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(CONFIG)
    model = model_class(args_class.from_dict(CONFIG))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return model


def logits(model):
    return np.array(model(TOKENS).astype(mx.float32))


def write_gguf(tmp: Path):
    """A llama GGUF written with gguf-py: TQ1_0 / TQ2_0 projections, F16/F32/Q8_0 others.

    Returns (file, HF-ordered float weights the model must reproduce).
    """
    from gguf import GGMLQuantizationType as Q, GGUFWriter, quants

    rng = np.random.default_rng(4)
    tok_dir = tmp / "tok"
    write_tokenizer(tok_dir)
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    w = GGUFWriter(str(tmp / "model.gguf"), "llama")
    w.add_context_length(256)
    w.add_embedding_length(256)
    w.add_block_count(2)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(64)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    hf = {}
    emb = rng.normal(0, 0.5, (128, 256)).astype(np.float32)
    w.add_tensor("token_embd.weight", emb)
    hf["model.embed_tokens.weight"] = emb
    out = rng.normal(0, 0.5, (128, 256)).astype(np.float32)
    q8 = quants.quantize(out, Q.Q8_0)
    w.add_tensor("output.weight", q8, raw_dtype=Q.Q8_0)
    hf["lm_head.weight"] = quants.dequantize(q8, Q.Q8_0).reshape(out.shape)
    norm = (1 + 0.1 * rng.normal(size=256)).astype(np.float16)
    w.add_tensor("output_norm.weight", norm)
    hf["model.norm.weight"] = norm.astype(np.float32)
    for i in range(2):
        for g, h in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            v = (1 + 0.1 * rng.normal(size=256)).astype(np.float32)
            w.add_tensor(f"blk.{i}.{g}.weight", v)
            hf[f"model.layers.{i}.{h}.weight"] = v
        for j, (g, h) in enumerate(PROJ.items()):
            n = {"attn_k": 128, "attn_v": 128, "ffn_gate": 512, "ffn_up": 512}.get(g, 256)
            k = 512 if g == "ffn_down" else 256
            t = rng.integers(-1, 2, (n, k)).astype(np.float32)
            s = np.float16(rng.uniform(0.01, 0.1)).astype(np.float32)  # exact in fp16
            weight = t * s
            hf[f"model.layers.{i}.{h}.weight"] = weight
            stored = permute(weight, 4) if g == "attn_q" else (
                permute(weight, 2) if g == "attn_k" else weight)
            qt = Q.TQ1_0 if j % 2 else Q.TQ2_0
            w.add_tensor(f"blk.{i}.{g}.weight", quants.quantize(stored, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tmp / "model.gguf", hf


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf"))


def test_gguf_reader_tq1_tq2(tmp_path, gguf_file):
    path, hf = gguf_file
    report = convert(str(path), tmp_path / "out", packing="compact")
    assert report.max_error == 0.0 and "GGUF" in report.source_kind
    model, tok = mlx_ternary.load(str(tmp_path / "out"))
    want = logits(reference_model(hf))
    np.testing.assert_allclose(logits(model), want, atol=1e-3, rtol=1e-3)
    assert tok.encode("hi", add_special_tokens=False) == [ord("h") - 31, ord("i") - 31]
    # negative control: without undoing llama.cpp's rotary permutation the logits differ
    src = gguf_reader.source(path, "compact", unpermute=False)
    convert_source(src, tmp_path / "perm")
    bad = logits(mlx_ternary.load(str(tmp_path / "perm"))[0])
    assert np.abs(bad - want).max() > 1e-2


@pytest.mark.parametrize("qtype", ["TQ1_0", "TQ2_0"])
def test_gguf_export_reads_back(tmp_path, gguf_file, qtype):
    from gguf import GGUFReader, quants

    path, hf = gguf_file
    convert(str(path), tmp_path / "native")
    report = convert(str(tmp_path / "native"), to_gguf=tmp_path / "out.gguf", gguf_type=qtype)
    assert report.max_error == 0.0
    reader = GGUFReader(str(tmp_path / "out.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type.name == qtype
    got = quants.dequantize(np.asarray(q.data), q.tensor_type).reshape(256, 256)
    np.testing.assert_array_equal(got, permute(hf["model.layers.0.self_attn.q_proj.weight"], 4))
    down = tensors["blk.1.ffn_down.weight"]
    got = quants.dequantize(np.asarray(down.data), down.tensor_type).reshape(256, 512)
    np.testing.assert_array_equal(got, hf["model.layers.1.mlp.down_proj.weight"])
    assert str(reader.get_field("general.architecture").contents()) == "llama"
    assert len(reader.get_field("tokenizer.ggml.tokens").contents()) == 128
    # and back again: the same logits
    convert(str(tmp_path / "out.gguf"), tmp_path / "again")
    np.testing.assert_allclose(logits(mlx_ternary.load(str(tmp_path / "again"))[0]),
                               logits(reference_model(hf)), atol=1e-3, rtol=1e-3)


def test_truncated_gguf_leaves_nothing(tmp_path, gguf_file):
    path, _ = gguf_file
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(FormatError, match="cut.gguf: not a readable GGUF file"):
        convert(str(cut), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
