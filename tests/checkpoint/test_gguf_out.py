"""GGUF out: what llama.cpp needs (F32 norms, pre-tokenizer, TQ/Q8_0 codes) and an exact
round trip back into mlx-ternary (ternary layers, scales, activation_bits)."""

import json

import gguf_build as gb
import mlx.core as mx
import numpy as np
import pytest
from tiny import FIXTURES, ternary_checkpoint

import mlx_ternary
from mlx_ternary.checkpoint.convert import convert, open_input
from mlx_ternary.checkpoint.readers import gguf as reader
from mlx_ternary.checkpoint.readers.gguf_file import GGUFFile
from mlx_ternary.checkpoint.writers import gguf as writer
from mlx_ternary.errors import TernaryError
from mlx_ternary.format import AffineTensor, PackedTernary, to_numpy
from mlx_ternary.generate import EMBEDDED_MODEL

FIXTURES = FIXTURES / "gguf"
TOKENS = mx.array([[3, 17, 42, 5, 99, 64, 1, 20]])


@pytest.fixture(scope="module")
def embedded_gguf(tmp_path_factory):
    out = tmp_path_factory.mktemp("emb") / "emb.gguf"
    report = convert(str(EMBEDDED_MODEL), to_gguf=out)
    return out, report


def test_embedded_export_is_what_llamacpp_runs(embedded_gguf):
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    path, report = embedded_gguf
    gf = GGUFFile(path)
    types = {t.name: t.type_name for t in gf.tensors}
    assert all(types[t.name] == "F32" for t in gf.tensors if len(t.shape) == 1)
    ternary = gf.field("mlx_ternary.ternary")
    assert len(ternary) == 28 and all(types[n] == "TQ2_0" for n in ternary)
    # intermediate 704 is zero-padded to whole TQ blocks; the true size is recorded
    assert gf.field("llama.feed_forward_length") == 768
    assert gf.field("mlx_ternary.intermediate_size") == 704
    down = next(t for t in gf.tensors if t.name == "blk.0.ffn_down.weight")
    assert down.shape == (256, 768)
    assert gf.field("tokenizer.ggml.pre") == "gpt-2"
    assert gf.field("tokenizer.ggml.add_bos_token") is False
    assert gf.field("mlx_ternary.activation_bits") == 8
    # llama.cpp's view of q_proj: rows in its rotary order, d = float16(s)
    native = dict(open_input(str(EMBEDDED_MODEL), "compact").items())
    pt = native["model.layers.0.self_attn.q_proj"]
    info = next(t for t in gf.tensors if t.name == "blk.0.attn_q.weight")
    got = quants.dequantize(np.asarray(gf.tensor_bytes(info)), Q.TQ2_0).reshape(256, 256)
    scales = to_numpy(pt.scales)  # readers may hand stored tensors on as lazy MLX arrays
    s16 = scales.astype(np.float16).astype(np.float32)
    want = gb.permute(pt.trits().astype(np.float32) * s16, 4)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, pt.trits() * s16)  # negative control: rows permuted
    # scales are float32 numbers float16 cannot hold: the exact ones ride along
    assert report.max_error > 0  # llama.cpp's float16 d
    exact = gf.field("mlx_ternary.scale.blk.0.attn_q.weight")
    assert np.float32(exact[0]) == scales[0, 0] != s16[0, 0]


def test_embedded_round_trip_is_exact(embedded_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path, _ = embedded_gguf
    back, _, config = mlx_ternary.load(str(path), return_config=True)
    orig, _ = mlx_ternary.load(str(EMBEDDED_MODEL))
    np.testing.assert_array_equal(np.array(back(TOKENS)), np.array(orig(TOKENS)))
    assert config["quantization"]["activation_bits"] == 8
    assert config["intermediate_size"] == 704
    items = dict(reader.source(path, "compact").items())
    assert sum(isinstance(v, PackedTernary) for v in items.values()) == 28


@pytest.mark.parametrize("arch", ["bitnet", "qwen3"])
def test_narrow_layers_as_q8_0_codes_and_float(tmp_path, arch, monkeypatch):
    """Rows of 64 (not whole TQ blocks): Q8_0 with codes t, d = s; rows of 112 / 80
    (bitnet and qwen3's down_proj here; qwen3 pads nothing since hidden 64 is not TQ
    either): float32. All read back as the same ternary weights."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ckpt, _ = ternary_checkpoint(tmp_path, arch, scale="row")
    gb.bpe_tokenizer(ckpt)
    out = tmp_path / f"{arch}.gguf"
    convert(str(ckpt), to_gguf=out)
    gf = GGUFFile(out)
    types = {t.name: t.type_name for t in gf.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.ffn_down.weight"] == "F32"
    if arch == "bitnet":
        assert gf.field("bitnet.hidden_activation") == "relu2"
        assert "blk.1.attn_sub_norm.weight" in types and "output.weight" not in types
    else:
        assert gf.field("qwen3.attention.key_length") == 16 and "blk.0.attn_k_norm.weight" in types
    native = dict(open_input(str(ckpt), "compact").items())
    again = dict(reader.source(out, "compact").items())
    for name, pt in native.items():
        if isinstance(pt, PackedTernary):
            np.testing.assert_array_equal(again[name].trits(), pt.trits())
            np.testing.assert_array_equal(
                again[name].scales.astype(np.float32), to_numpy(pt.scales).astype(np.float32)
            )
    model, _ = mlx_ternary.load(str(out))
    ref, _ = mlx_ternary.load(str(ckpt))
    # Same weights; the GGUF's float16 table may run through the native dense kernel and the
    # source's float32 one through MLX's matmul: float32 sums in another order.
    np.testing.assert_allclose(np.array(model(TOKENS)), np.array(ref(TOKENS)), atol=1e-4)


def test_pre_tokenizer_detection():
    snippets = json.loads((FIXTURES / "pre_tokenizers.json").read_text())

    def tok_json(normalizer, pre_tokenizer):
        return json.dumps(
            {
                "version": "1.0",
                "added_tokens": [],
                "normalizer": normalizer,
                "pre_tokenizer": pre_tokenizer,
                "post_processor": None,
                "decoder": None,
                "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
            }
        )

    assert writer.detect_pre(tok_json(**snippets["llama3"])) == "llama-bpe"
    assert writer.detect_pre(tok_json(**snippets["qwen3"])) == "qwen2"
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    assert writer.detect_pre(tok_json(None, byte_level)) == "gpt-2"
    smollm = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
    }  # SmolLM2's, restated
    assert writer.detect_pre(tok_json(None, smollm)) == "smollm"
    with pytest.raises(TernaryError, match="splits text unlike every llama.cpp pre-tok"):
        writer.detect_pre(
            tok_json(
                None,
                {
                    "type": "Metaspace",
                    "replacement": "\u2581",
                    "prepend_scheme": "always",
                    "split": True,
                },
            )
        )
    with pytest.raises(TernaryError, match="a Lowercase normalizer"):
        writer.detect_pre(tok_json({"type": "Lowercase"}, byte_level))


def test_affine_tensors_written_exactly(tmp_path):
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(1)
    config = dict(
        model_type="llama", **gb.DIMS, rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=True
    )
    q4 = mx.quantize(mx.array(rng.normal(size=(gb.VOCAB, 256)).astype(np.float32)), 64, 4)
    q4 = AffineTensor(q4[0], q4[1].astype(mx.float16), q4[2].astype(mx.float16), 4, 64)
    q8 = mx.quantize(mx.array(rng.normal(size=(256, 256)).astype(np.float32)), 64, 8)
    q8 = AffineTensor(q8[0], q8[1].astype(mx.float16), q8[2].astype(mx.float16), 8, 64)
    kinds = {}
    writer.write(
        tmp_path / "a.gguf",
        config,
        iter([("model.embed_tokens", q4), ("model.layers.0.mlp.down_proj", q8)]),
        on_tensor=lambda n, k, e: kinds.update({n: (k, e)}),
    )
    assert kinds["model.embed_tokens"] == ("Q4_1", 0.0)
    # 8-bit codes whose bias is not -128 * scale have no GGUF twin: written as floats
    assert kinds["model.layers.0.mlp.down_proj"][0] in ("float16", "float32")
    gf = GGUFFile(tmp_path / "a.gguf")
    assert [t.type_name for t in gf.tensors] == [
        Q.Q4_1.name,
        "F16" if kinds["model.layers.0.mlp.down_proj"][0] == "float16" else "F32",
    ]

    def f32(a):
        if isinstance(a, AffineTensor):
            return np.array(
                mx.dequantize(
                    a.weight,
                    a.scales.astype(mx.float32),
                    a.biases.astype(mx.float32),
                    a.group_size,
                    a.bits,
                )
            )
        return np.array(a.astype(mx.float32))

    for (_, got), want in zip(reader.iter_items(tmp_path / "a.gguf", config, "compact"), (q4, q8)):
        np.testing.assert_array_equal(f32(got), f32(want))


def test_refusals(tmp_path):
    cfg = dict(model_type="bitnet", tie_word_embeddings=False, **gb.DIMS)
    with pytest.raises(TernaryError, match="llama.cpp's bitnet graph multiplies by the token"):
        writer.check_config(cfg)
    with pytest.raises(TernaryError, match="--to-gguf writes llama, qwen2, qwen3, bitnet"):
        writer.check_config(dict(cfg, model_type="gemma"))
    with pytest.raises(TernaryError, match="rope_scaling type 'llama3' is not exported"):
        writer.check_config(dict(cfg, model_type="llama", rope_scaling={"rope_type": "llama3"}))
    ckpt, _ = ternary_checkpoint(tmp_path, "llama")  # its tokenizer has no merges
    with pytest.raises(TernaryError, match="no BPE merges"):
        convert(str(ckpt), to_gguf=tmp_path / "x.gguf")
    assert not list(tmp_path.glob("*x.gguf*"))


def test_corrupt_tokenizer_config_is_named(tmp_path):
    ckpt, _ = ternary_checkpoint(tmp_path, "llama", scale="row")
    gb.bpe_tokenizer(ckpt)
    (ckpt / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TernaryError, match="tokenizer_config.json: not valid JSON"):
        convert(str(ckpt), to_gguf=tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()  # nothing half-written
