"""GGUF in: llama.cpp's layouts (architectures, quant types, tokenizers) read exactly."""

import json

import gguf_build as gb
import mlx.core as mx
import numpy as np
import pytest
from tiny import FIXTURES

import mlx_ternary
from mlx_ternary import format as fmt
from mlx_ternary.checkpoint.convert import convert, convert_source
from mlx_ternary.checkpoint.readers import gguf as reader
from mlx_ternary.checkpoint.readers import gguf_quants as gq
from mlx_ternary.checkpoint.readers.gguf_file import GGUFFile
from mlx_ternary.checkpoint.readers.gguf_tokenizer import tokenizer_files
from mlx_ternary.errors import FormatError
from mlx_ternary.format import AffineTensor, GGMLTensor, PackedTernary
from mlx_ternary.runtime.layers import ternary_layers

FIXTURES = FIXTURES / "gguf"
TOKENS = [3, 17, 42, 5, 99, 64, 1, 20]


def _items(path, **kw):
    return dict(reader.source(path, "compact", **kw).items())


@pytest.mark.parametrize(
    "arch,embd,output",
    [("llama", "Q4_K", "Q6_K"), ("qwen3", "Q4_0", None), ("bitnet", "Q4_K", None)],
)
def test_quantizer_layout_loads_exactly(tmp_path, arch, embd, output):
    # bitnet: mlx_ternary.activation_bits 0 so the float twin is the reference
    extra = (
        {"bitnet.hidden_activation": "relu2", "mlx_ternary.activation_bits": 0}
        if arch == "bitnet"
        else None
    )
    path, config, weights = gb.write(
        tmp_path / f"{arch}.gguf", arch, embd=embd, output=output, extra_kv=extra
    )
    items = _items(path, keep_affine=False)
    ternary = {k: v for k, v in items.items() if isinstance(v, PackedTernary)}
    assert len(ternary) == 14
    for module, pt in ternary.items():  # exactly the s * t the file encodes, HF row order
        np.testing.assert_array_equal(pt.dequantize(np.float32), weights[f"{module}.weight"])
    if output:  # Q6_K has no exact MLX form: float16 of gguf-py's values
        lm = np.array(items["lm_head.weight"].astype(mx.float32))
        np.testing.assert_array_equal(lm, weights["lm_head.weight"].astype(np.float16))
    report = convert(str(path), tmp_path / "out")
    assert report.max_error == 0.0
    # llama.cpp's files run with its Q8_K activations unless they record their own definition
    recorded = gb.config_json(tmp_path / "out")["quantization"].get("activations", "model")
    assert recorded == ("model" if extra else "q8k")
    default, _ = mlx_ternary.load(str(tmp_path / "out"))
    bits = {m.activation_bits for _, m in ternary_layers(default)}
    assert bits == ({None} if extra else {fmt.Q8K})
    model, tok = mlx_ternary.load(str(tmp_path / "out"), activations="float")  # float twin
    want = gb.reference_logits(config, weights, TOKENS)
    np.testing.assert_allclose(np.array(model(mx.array([TOKENS]))), want, atol=2e-3, rtol=2e-3)
    assert tok.encode(" the", add_special_tokens=False) == [4]  # the merges are honoured
    from mlx_lm import generate

    assert isinstance(generate(model, tok, "the", max_tokens=3), str)


@pytest.mark.parametrize("embd", ["Q4_0", "Q4_K"])
def test_quantized_embedding_and_head_stay_quantized(tmp_path, embd):
    """llama.cpp's quantizer output end to end on the reference backend: the Q4 embedding and
    a Q8_0 head become 4-/8-bit MLX layers (never dequantized), and the logits are the
    file's exact numbers. (The native backend keeps Q4_K / Q8_0 as their GGUF blocks:
    tests/runtime/test_ggml_tables.py.)"""
    import mlx.nn as nn

    path, config, weights = gb.write(tmp_path / "m.gguf", "llama", embd=embd, output="Q8_0")
    convert(str(path), tmp_path / "out")
    model, _ = mlx_ternary.load(str(tmp_path / "out"), activations="float", backend="reference")
    emb, head = model.model.embed_tokens, model.lm_head
    assert isinstance(emb, nn.QuantizedEmbedding) and (emb.bits, emb.group_size) == (4, 32)
    assert isinstance(head, nn.QuantizedLinear) and (head.bits, head.group_size) == (8, 32)
    rows = np.array(emb(mx.array(TOKENS)))
    assert rows.dtype == np.float32  # float16 scales do not make the model float16 on the CPU
    np.testing.assert_array_equal(rows, weights["model.embed_tokens.weight"][TOKENS])
    want = gb.reference_logits(config, weights, TOKENS)
    np.testing.assert_allclose(np.array(model(mx.array([TOKENS]))), want, atol=2e-3, rtol=2e-3)


def test_llama_rotary_rows_negative_control(tmp_path):
    path, config, weights = gb.write(tmp_path / "m.gguf", "llama", output=None)
    src = reader.source(path, "compact", keep_affine=False, unpermute=False)
    convert_source(src, tmp_path / "perm")
    bad = mlx_ternary.load(str(tmp_path / "perm"), activations="float")[0]
    bad = np.array(bad(mx.array([TOKENS])))
    assert np.abs(bad - gb.reference_logits(config, weights, TOKENS)).max() > 1e-2


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K"])
def test_affine_types_map_exactly(tmp_path, qtype):
    """Q8_0/Q4_0/Q4_1/Q4_K/Q5_K -> AffineTensor (Q4_0/Q4_1 from the reader; the tables kept
    as blocks through the reference backends' conversion): the numbers gguf-py decodes."""
    path, _, weights = gb.write(tmp_path / "m.gguf", "llama", embd=qtype, output="Q5_K", seed=3)
    items = _items(path)
    for module, want in (
        ("model.embed_tokens", weights["model.embed_tokens.weight"]),
        ("lm_head", weights["lm_head.weight"]),
    ):
        at = items[module]
        if isinstance(at, GGMLTensor):
            assert at.type == (qtype if module == "model.embed_tokens" else "Q5_K")
            at = gq.affine(np.array(at.blocks), at.type, *at.shape)
        assert isinstance(at, AffineTensor) and at.group_size == 32
        as_f32 = mx.dequantize(
            at.weight,
            at.scales.astype(mx.float32),
            at.biases.astype(mx.float32),
            group_size=32,
            bits=at.bits,
        )
        np.testing.assert_array_equal(np.array(as_f32), want)
        x = mx.array(np.random.default_rng(0).normal(size=(3, want.shape[1])).astype(np.float32))
        y = mx.quantized_matmul(
            x, at.weight, at.scales, at.biases, transpose=True, group_size=32, bits=at.bits
        )
        np.testing.assert_allclose(np.array(y), np.array(x) @ want.T, rtol=1e-4, atol=1e-4)
        # negative control: without the bias (Q4_0's -8 d, Q8_0's -128 d, the k-quant mins)
        no_bias = mx.dequantize(
            at.weight,
            at.scales.astype(mx.float32),
            mx.zeros_like(at.biases, mx.float32),
            group_size=32,
            bits=at.bits,
        )
        assert not np.array_equal(np.array(no_bias), want)


def test_q8_0_ternary_codes_read_as_ternary(tmp_path):
    from gguf import GGMLQuantizationType as Q

    path, _, weights = gb.write(tmp_path / "m.gguf", "llama", ternary=("Q8_0",), output=None)
    # gguf-py's Q8_0 quantizer gives codes +-127 (d = s / 127): not ternary codes, so they
    # stay quantized (their blocks); rewrite them as our writer does (codes t, d = s) and
    # they are ternary
    items = _items(path)
    assert isinstance(items["model.layers.0.mlp.up_proj"], GGMLTensor)
    from mlx_ternary.checkpoint.writers.gguf_tensors import q8_0_codes

    t = np.sign(weights["model.layers.0.mlp.up_proj.weight"]).astype(np.int8)
    s = np.abs(weights["model.layers.0.mlp.up_proj.weight"]).max()
    data = q8_0_codes(t, np.full(t.shape, s, np.float32))
    from gguf import quants

    np.testing.assert_array_equal(
        quants.dequantize(data, Q.Q8_0).reshape(t.shape),
        weights["model.layers.0.mlp.up_proj.weight"],
    )
    from mlx_ternary.checkpoint.readers import gguf_quants

    found = gguf_quants.q8_0_trits(data, *t.shape)
    np.testing.assert_array_equal(found[0], t)
    assert gguf_quants.reduce_scales(found[1], 32)[0].shape == (1, 1)


def test_bitnet_defaults(tmp_path):
    path, _, _ = gb.write(tmp_path / "b.gguf", "bitnet", output=None)
    src = reader.source(path, "compact")
    assert src.config["hidden_act"] == "silu"  # mainline llama.cpp's default for bitnet
    assert src.activation_bits == 8
    path, _, _ = gb.write(tmp_path / "c.gguf", "bitnet-b1.58", output=None)
    assert reader.source(path, "compact").config["hidden_act"] == "relu2"


def test_i2s_fixture_reads_exactly():
    """bitnet.cpp's I2_S, bytes made by its own quantize_i2_s (x86 build, compiled from
    microsoft/BitNet's src/ggml-bitnet-mad.cpp, unchanged) for random ternary s * t in a
    tiny model laid out as its BitNet b1.58 2B4T GGUF (architecture bitnet-b1.58,
    attn_sub_norm / ffn_sub_norm, F16 token_embd, tied output); the expected trits and
    scales are the ones given to the quantizer."""
    from mlx_ternary.checkpoint.gguf_tables import ARCHITECTURES, NameTable
    from mlx_ternary.checkpoint.readers import i2s

    path = FIXTURES / "bitnet-i2s.gguf"
    expected = np.load(FIXTURES / "bitnet-i2s.expected.npz")
    names = NameTable(ARCHITECTURES["bitnet-b1.58"].names)
    src = reader.source(path, "fast")
    assert src.config["model_type"] == "bitnet" and src.config["hidden_act"] == "relu2"
    ternary = {k: v for k, v in src.items() if isinstance(v, PackedTernary)}
    assert len(ternary) == 14
    for module, pt in ternary.items():
        g = names.gguf(f"{module}.weight")
        np.testing.assert_array_equal(pt.trits(), expected[f"{g}.trits"])
        np.testing.assert_array_equal(pt.scales, expected[f"{g}.scale"])
    # negative control: the ARM build's layout (64-weight blocks of 16 bytes) differs
    gf = GGUFFile(path)
    info = next(t for t in gf.tensors if t.name == "blk.0.attn_q.weight")
    raw = np.asarray(gf.tensor_bytes(info))
    n = info.size
    arm = (raw[: n // 4].reshape(-1, 1, 16) >> np.array([6, 4, 2, 0], np.uint8)[:, None]) & 3
    assert not np.array_equal(
        arm.reshape(info.shape).astype(np.int8) - 1, expected["blk.0.attn_q.weight.trits"]
    )
    t, s = i2s.decode(raw, *info.shape, "x")
    np.testing.assert_array_equal(t, expected["blk.0.attn_q.weight.trits"])


def test_i2s_model_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, tok = mlx_ternary.load(str(FIXTURES / "bitnet-i2s.gguf"))
    from mlx_lm import generate

    assert isinstance(generate(model, tok, "the", max_tokens=4), str)
    cfg = json.loads(
        next((tmp_path / "mlx_ternary" / "gguf").iterdir()).joinpath("config.json").read_text()
    )
    assert cfg["quantization"]["activation_bits"] == 8


@pytest.mark.parametrize("name", ["gpt-2", "llama-bpe", "qwen2", "qwen35", "starcoder", "falcon"])
def test_pre_tokenizer_matches_llamacpp_expected_ids(name):
    """Vocabularies cut from llama.cpp's ggml-vocab-<name>.gguf test files (llama-cpp-python
    0.3.36 sdist; scripts/fixtures/make_gguf_vocab_fixtures.py): the rebuilt tokenizer gives the ids
    of their .out files for every .inp string."""
    from tokenizers import Tokenizer

    path = FIXTURES / f"{name}.gguf"
    cases = json.loads((FIXTURES / f"{name}.json").read_text())
    tok = Tokenizer.from_str(tokenizer_files(GGUFFile(path), path)["tokenizer.json"])
    got = [tok.encode(t, add_special_tokens=False).ids for t in cases["texts"]]
    assert got == cases["ids"]
    if name != "gpt-2":  # negative control: llama.cpp's "default" splitting differs
        gf = GGUFFile(path)
        gf.fields["tokenizer.ggml.pre"] = "default"
        tok = Tokenizer.from_str(tokenizer_files(gf, path)["tokenizer.json"])
        wrong = [tok.encode(t, add_special_tokens=False).ids for t in cases["texts"]]
        assert wrong != cases["ids"]


def test_llama_bpe_adds_bos_by_default():
    from tokenizers import Tokenizer

    path = FIXTURES / "llama-bpe.gguf"
    gf = GGUFFile(path)
    tok = Tokenizer.from_str(tokenizer_files(gf, path)["tokenizer.json"])
    assert tok.encode("Hi").ids[0] == gf.field("tokenizer.ggml.bos_token_id")
    gf.fields["tokenizer.ggml.add_bos_token"] = False
    tok = Tokenizer.from_str(tokenizer_files(gf, path)["tokenizer.json"])
    assert tok.encode("Hi").ids[0] != gf.field("tokenizer.ggml.bos_token_id")


def _write_one(path, arch="llama", tensors=(), kv=None, pre="gpt-2"):
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_embedding_length(256)
    w.add_block_count(1)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    for key, value in (kv or {}).items():
        w.add_string(key, value)
    gb.add_tokenizer(w, pre)
    for name, data, raw in tensors:
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_files_fail_with_one_clear_line(tmp_path):
    from gguf import GGMLQuantizationType as Q

    with pytest.raises(FormatError, match=r"x\.gguf: GGUF architecture 'gpt2' is not one"):
        reader.source(_write_one(tmp_path / "x.gguf", "gpt2"), "compact")
    with pytest.raises(FormatError, match=r"tokenizer.ggml.pre 'tekken' is not a pre-tok"):
        reader.source(_write_one(tmp_path / "p.gguf", pre="tekken"), "compact")
    raw = np.zeros((4, 256 // 32 * 40), np.uint8)  # Q8_1: no gguf-py dequantizer
    path = _write_one(tmp_path / "q.gguf", tensors=[("token_embd.weight", raw, Q.Q8_1)])
    src = reader.source(path, "compact")
    with pytest.raises(
        FormatError,
        match=r"q\.gguf: token_embd\.weight: GGUF type Q8_1 is "
        r"not read",
    ):
        list(src.items())
    path = _write_one(
        tmp_path / "n.gguf", tensors=[("blk.0.mystery.weight", np.ones(4, np.float32), None)]
    )
    with pytest.raises(
        FormatError,
        match=r"n\.gguf: tensor blk\.0\.mystery\.weight \(F32\) "
        "has no entry",
    ):
        list(reader.source(path, "compact").items())


def test_truncated_gguf_leaves_nothing(tmp_path):
    path, _, _ = gb.write(tmp_path / "m.gguf", "llama", output=None)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(FormatError, match=r"cut\.gguf: truncated GGUF file: tensor \S+ needs"):
        convert(str(cut), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    (tmp_path / "head.gguf").write_bytes(path.read_bytes()[:100])
    with pytest.raises(FormatError, match=r"head\.gguf: not a readable GGUF file"):
        reader.source(tmp_path / "head.gguf", "compact")


def _rss_file() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="Linux /proc")
def test_release_drops_a_read_tensors_pages_and_keeps_its_bytes(tmp_path):
    from gguf import GGUFWriter

    rng = np.random.default_rng(0)
    w = GGUFWriter(str(tmp_path / "big.gguf"), "llama")
    tables = [rng.standard_normal((1024, 4096)).astype(np.float16) for _ in range(2)]
    for i, t in enumerate(tables):  # 8 MiB each
        w.add_tensor(f"t{i}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf = GGUFFile(tmp_path / "big.gguf")
    before = _rss_file()
    sums = [int(np.asarray(gf.tensor_bytes(i), np.int64).sum()) for i in gf.tensors]
    read = _rss_file()
    assert read - before > 12 << 20  # negative control: reading maps the pages in
    gf.release(gf.tensors[0])
    one = _rss_file()
    assert read - one > 6 << 20 and one - before > 6 << 20  # the one tensor's pages only
    gf.release(gf.tensors[1])
    assert _rss_file() - before < 2 << 20
    # still readable, the same bytes (faulted back in from the file)
    assert [int(np.asarray(gf.tensor_bytes(i), np.int64).sum()) for i in gf.tensors] == sums
    assert np.array_equal(gf.tensor_bytes(gf.tensors[1]).view(np.float16).reshape(1024, 4096),
                          tables[1])  # fmt: skip
