"""llama.cpp's quantized tables (Q8_0, Q4_K, Q5_K, Q6_K) kept as their GGUF blocks.

References: gguf-py's `dequantize` (llama.cpp's own Python package) for the weights, and a
numpy transcription, written here from ggml's generic C, of quantize_row_q8_K_ref /
quantize_row_q8_0_ref and ggml_vec_dot_{q4_K,q5_K,q6_K}_q8_K / ggml_vec_dot_q8_0_q8_0 for
llama.cpp's numerics. Both the pure-MLX twin (runtime/ggml.py) and the native kernels
(csrc/kernels/kquants.h) are checked against them, and against each other.
"""

import json

import gguf_build as gb
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_ternary
from mlx_ternary import format as fmt
from mlx_ternary.checkpoint.convert import convert
from mlx_ternary.checkpoint.writers.gguf_kquants import encode
from mlx_ternary.errors import FormatError
from mlx_ternary.memory import activation_dtype
from mlx_ternary.runtime import cpu, ggml
from mlx_ternary.runtime.cpu.tables import GGMLEmbedding, GGMLLinear

TYPES = ["Q8_0", "Q4_K", "Q5_K", "Q6_K"]
F32 = np.float32
TOKENS = [3, 17, 42, 5, 99, 64, 1, 20]

native = pytest.mark.skipif(not cpu.available(), reason="the native CPU kernel does not build")


def _blocks(qtype, n, k, seed):
    """(blocks (n, row_bytes) uint8, gguf-py's float32 weights): random bytes with sane
    float16 scales for the k-quants (negative Q6_K scales included), gguf-py's quantizer
    for Q8_0."""
    rng = np.random.default_rng(seed)
    shape = rng.normal(size=(n, k)).astype(F32) if qtype == "Q8_0" else (n, k)
    return gb.quantized(shape, qtype, rng)


# --------------------------------------------------------------------------- #
# numpy, from ggml's generic C
# --------------------------------------------------------------------------- #


def _f16(b):
    return F32(np.frombuffer(bytes(b[:2]), np.float16)[0])


def _decode(qtype, blk):
    """One block -> (codes, scales per sub-block, mins, d, dmin) as ggml's C reads them."""
    blk = [int(v) for v in blk]
    if qtype == "Q8_0":
        return (
            np.array(blk[2:], np.uint8).view(np.int8).astype(np.int64),
            None,
            None,
            _f16(blk[0:2]),
            None,
        )
    if qtype == "Q6_K":
        ql, qh, a = blk[0:128], blk[128:192], [0] * 256
        for h in range(2):
            for l in range(32):
                q4, bits = ql[64 * h :], qh[32 * h + l]
                a[128 * h + l] = ((q4[l] & 15) | ((bits & 3) << 4)) - 32
                a[128 * h + l + 32] = ((q4[l + 32] & 15) | (((bits >> 2) & 3) << 4)) - 32
                a[128 * h + l + 64] = ((q4[l] >> 4) | (((bits >> 4) & 3) << 4)) - 32
                a[128 * h + l + 96] = ((q4[l + 32] >> 4) | (((bits >> 6) & 3) << 4)) - 32
        sc = np.array(blk[192:208], np.uint8).view(np.int8).astype(np.int64)
        return np.array(a), sc, None, _f16(blk[208:210]), None
    s = blk[4:16]
    sc = [s[j] & 63 for j in range(4)] + [
        (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4) for j in range(4, 8)
    ]
    mn = [s[j + 4] & 63 for j in range(4)] + [
        (s[j + 4] >> 4) | ((s[j] >> 6) << 4) for j in range(4, 8)
    ]
    qs = blk[48:] if qtype == "Q5_K" else blk[16:]
    a = []
    for c in range(4):
        a += [qs[32 * c + l] & 15 for l in range(32)] + [qs[32 * c + l] >> 4 for l in range(32)]
    if qtype == "Q5_K":
        a = [v | (((blk[16 + i % 32] >> (i // 32)) & 1) << 4) for i, v in enumerate(a)]
    return np.array(a), np.array(sc), np.array(mn), _f16(blk[0:2]), _f16(blk[2:4])


def _q8k(x):
    """quantize_row_q8_K_ref of one row: (q (nb, 256), d (nb,), bsums (nb, 16))."""
    out = []
    for xb in x.reshape(-1, 256):
        i = int(np.argmax(np.abs(xb)))
        if xb[i] == 0:
            out.append((np.zeros(256, np.int64), F32(0), np.zeros(16, np.int64)))
            continue
        iscale = F32(-127) / xb[i]
        q = np.minimum(127, np.rint(iscale * xb)).astype(np.int64)
        out.append((q, F32(1) / iscale, q.reshape(16, 16).sum(1)))
    return out


def _q8_0(x):
    """quantize_row_q8_0_ref of one row: [(q (32,), d as its float16)]."""
    out = []
    for xb in x.reshape(-1, 32):
        d = np.abs(xb).max() / F32(127)
        inv = F32(1) / d if d else F32(0)
        v = (xb * inv).astype(np.float64)  # roundf: half away from zero
        out.append((np.trunc(v + np.copysign(0.5, v)).astype(np.int64), F32(np.float16(d))))
    return out


def vec_dot(qtype, row, x):
    """ggml_vec_dot_<qtype>_q8_K (or _q8_0_q8_0), generic, of one row of blocks and x."""
    size = fmt.GGML_TABLES[qtype].bytes
    blocks = row.reshape(-1, size)
    if qtype == "Q8_0":
        sumf = F32(0)
        for blk, (q8, dx) in zip(blocks, _q8_0(x)):
            a, _, _, d, _ = _decode(qtype, blk)
            sumf = F32(sumf + F32(int((a * q8).sum())) * F32(d * dx))
        return sumf
    sums, sumf = np.zeros(8, F32), F32(0)
    for blk, (q8, dx, bsums) in zip(blocks, _q8k(x)):
        a, sc, mn, d, dmin = _decode(qtype, blk)
        sub = 16 if qtype == "Q6_K" else 32
        aux = np.zeros(8, np.int64)
        for j in range(256 // sub):
            for c in range(sub * j, sub * j + sub):
                aux[c % 8] += sc[j] * int(q8[c] * a[c])
        sums = (sums + F32(d * dx) * aux.astype(F32)).astype(F32)
        if mn is not None:
            sumi = int(sum(int(bsums[j]) * int(mn[j // 2]) for j in range(16)))
            sumf = F32(sumf - F32(dmin * dx) * F32(sumi))
    for l in range(8):
        sumf = F32(sumf + sums[l])
    return sumf


# --------------------------------------------------------------------------- #
# The kernels
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_exact_against_gguf_py(qtype):
    data, want = _blocks(qtype, 9, 512, seed=1)
    assert np.array_equal(np.array(ggml.dequantize(mx.array(data), qtype, 512)), want)
    if cpu.available():
        rows = mx.array(data)[mx.array([4, 0, 4])]  # a gather, as the embedding does
        got = np.array(cpu.ggml_dequantize(rows, qtype, 512))
        assert np.array_equal(got, want[[4, 0, 4]])
    # negative control: one scale byte changed changes the weights
    off = {"Q8_0": 1, "Q4_K": 5, "Q5_K": 5, "Q6_K": 193}[qtype]
    bad = data.copy()
    bad[0, off] ^= 0x11
    assert not np.array_equal(np.array(ggml.dequantize(mx.array(bad), qtype, 512)), want)


@pytest.mark.parametrize("qtype", TYPES)
def test_encoder_round_trip(qtype):
    """Our writer's blocks mean what gguf-py says they mean (4-8 bits: close, not exact)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    w = np.random.default_rng(2).normal(size=(6, 512)).astype(F32)
    back = quants.dequantize(encode(w, qtype), Q[qtype]).reshape(w.shape)
    err = np.abs(back - w).max() / np.abs(w).max()
    assert 0 < err < {"Q8_0": 0.006, "Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02}[qtype]


@pytest.mark.parametrize("qtype", TYPES)
def test_llama_numerics_bit_exact(qtype):
    """Twin and native kernel = the numpy transcription of ggml, bit for bit; M crosses the
    native kernel's 8-token tile; one token has an all-zero block (d = 0)."""
    n, k = 5, 512
    data, w = _blocks(qtype, n, k, seed=3)
    x = np.random.default_rng(4).normal(size=(9, k)).astype(F32)
    x[2, :256] = 0
    want = np.array([[vec_dot(qtype, data[r], x[m]) for r in range(n)] for m in range(len(x))])
    twin = np.array(ggml.matmul(mx.array(x), mx.array(data), qtype, k, llama=True))
    assert np.array_equal(twin, want)
    if cpu.available():
        got = np.array(cpu.ggml_matmul(mx.array(x), mx.array(data), qtype, k, llama=True))
        assert np.array_equal(got, want)
    # negative control: float activations give other numbers
    flt = np.array(ggml.matmul(mx.array(x), mx.array(data), qtype, k, llama=False))
    assert not np.array_equal(flt, want)
    assert np.abs(flt - want).max() < 0.05 * np.abs(x.astype(np.float64) @ w.T).max()


@native
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 4, 11])
def test_float_numerics_against_float64(qtype, m):
    data, w = _blocks(qtype, 7, 768 if qtype == "Q6_K" else 512, seed=5)
    k = w.shape[1]
    x = np.random.default_rng(m).normal(size=(m, k)).astype(F32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    for y in (
        cpu.ggml_matmul(mx.array(x), mx.array(data), qtype, k, llama=False),
        ggml.matmul(mx.array(x), mx.array(data), qtype, k, llama=False),
    ):
        assert np.abs(np.array(y) - want).max() / scale.max() < 2e-6
    # the gradient with respect to x: g @ W
    g = mx.array(np.random.default_rng(9).normal(size=(m, 7)).astype(F32))
    _, vjp = mx.vjp(
        lambda a: cpu.ggml_matmul(a, mx.array(data), qtype, k, llama=True), [mx.array(x)], [g]
    )
    np.testing.assert_allclose(np.array(vjp[0]), np.array(g) @ w, rtol=1e-5, atol=1e-5)


@native
def test_bad_arguments_name_the_problem():
    data, _ = _blocks("Q6_K", 2, 256, seed=0)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        cpu.ggml_matmul(mx.zeros((1, 200)), mx.array(data), "Q6_K", 200, llama=True)
    with pytest.raises(ValueError, match="uint8 rows of 210 bytes"):
        cpu.ggml_matmul(mx.zeros((1, 256)), mx.array(data[:, :200]), "Q6_K", 256, llama=True)


# --------------------------------------------------------------------------- #
# GGUF -> ternary checkpoint -> the layers, per backend
# --------------------------------------------------------------------------- #


def _table_bytes(path):
    from mlx_ternary.checkpoint.readers.gguf_file import GGUFFile

    gf = GGUFFile(path)
    return {t.name: np.asarray(gf.tensor_bytes(t)).reshape(t.shape[0], -1) for t in gf.tensors}


@native
def test_tables_stay_as_stored(tmp_path):
    """Q4_K embedding + Q6_K output: converted as blocks (format version 3), loaded as
    GGMLEmbedding / GGMLLinear holding the file's bytes; logits = the file's numbers (float
    numerics), the same model on the reference backend (affine / float32 tables), and
    llama.cpp's numerics by default."""
    path, config, weights = gb.write(tmp_path / "m.gguf", "llama", embd="Q4_K", output="Q6_K")
    convert(str(path), tmp_path / "out")
    quant = gb.config_json(tmp_path / "out")["quantization"]
    assert quant["format_version"] == fmt.GGML_FORMAT_VERSION
    assert quant["model.embed_tokens"] == {"mode": "ggml", "type": "Q4_K"}
    assert quant["lm_head"] == {"mode": "ggml", "type": "Q6_K"}
    model, _ = mlx_ternary.load(str(tmp_path / "out"), activations="float", backend="native")
    emb, head = model.model.embed_tokens, model.lm_head
    assert type(emb) is GGMLEmbedding and type(head) is GGMLLinear and not emb.llama
    assert activation_dtype(model) == mx.float32  # the KV cache too, not the scales' float16
    raw = _table_bytes(path)
    assert np.array_equal(np.array(emb.weight), raw["token_embd.weight"])
    rows = np.array(raw["output.weight"])  # llama: no rotary rows in the output layer
    assert np.array_equal(np.array(head.weight), rows)
    want = gb.reference_logits(config, weights, TOKENS)
    got = np.array(model(mx.array([TOKENS])))
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)
    ref, _ = mlx_ternary.load(str(tmp_path / "out"), activations="float", backend="reference")
    assert isinstance(ref.model.embed_tokens, nn.QuantizedEmbedding)
    assert type(ref.lm_head) is nn.Linear and ref.lm_head.weight.dtype == mx.float32
    np.testing.assert_allclose(np.array(ref(mx.array([TOKENS]))), got, atol=1e-4, rtol=1e-4)
    default, _ = mlx_ternary.load(str(tmp_path / "out"), backend="native")  # q8k: llama's
    assert default.model.embed_tokens.llama and default.lm_head.llama
    y = np.array(default(mx.array([TOKENS])))
    assert not np.array_equal(y, got) and np.abs(y - want).max() < 0.05 * np.abs(want).max()
    # mlx-lm's quantize_model path: the float32 widening of the blocks, quantized
    q = head.to_quantized(64, 4)
    assert isinstance(q, nn.QuantizedLinear) and q.weight.shape == (config["vocab_size"], 32)


@native
def test_tied_table_and_round_trip(tmp_path):
    """A tied Q6_K embedding (as_linear), saved again through save_model: same bytes."""
    from mlx_ternary.checkpoint.writers.ternary import save_model

    path, config, weights = gb.write(tmp_path / "m.gguf", "llama", embd="Q6_K", output=None)
    convert(str(path), tmp_path / "out")
    model, tok, cfg = mlx_ternary.load(
        str(tmp_path / "out"), activations="float", backend="native", return_config=True
    )
    assert type(model.model.embed_tokens) is GGMLEmbedding and "lm_head" not in model
    want = gb.reference_logits(config, weights, TOKENS)
    np.testing.assert_allclose(np.array(model(mx.array([TOKENS]))), want, atol=2e-3, rtol=2e-3)
    save_model(model, cfg, tmp_path / "again", tok)
    again, _ = mlx_ternary.load(str(tmp_path / "again"), activations="float", backend="native")
    assert np.array_equal(
        np.array(again.model.embed_tokens.weight), np.array(model.model.embed_tokens.weight)
    )


def test_unknown_table_kinds_are_refused_by_name(tmp_path):
    path, _, _ = gb.write(tmp_path / "m.gguf", "llama", embd="Q4_K", output="Q6_K")
    convert(str(path), tmp_path / "out")
    cfg_path = tmp_path / "out" / "config.json"
    good = json.loads(cfg_path.read_text())
    for entry, word in (
        ({"mode": "ggml", "type": "Q3_K"}, "Q3_K"),
        ({"mode": "mxfp4", "group_size": 32, "bits": 4}, "mxfp4"),
    ):
        cfg = json.loads(json.dumps(good))
        cfg["quantization"]["lm_head"] = entry
        cfg_path.write_text(json.dumps(cfg))
        with pytest.raises(FormatError, match=word):
            mlx_ternary.load(str(tmp_path / "out"))
    cfg = json.loads(json.dumps(good))
    cfg["quantization"]["format_version"] = 4
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="format_version 4"):
        mlx_ternary.load(str(tmp_path / "out"))
