"""Every published config variant (docs/FORMAT.md, "Published checkpoints"), built here.

Each builder writes a checkpoint laid out as its hub repo publishes it: the config fields
of that revision (dimensions shrunk), the tensor names, on-disk dtypes and shapes, random
weights. The test checks that the loaded ternary layers equal the s * t the file encodes
(computed here in numpy from what was written, under the semantics transformers of that
day gave the config), the activation quantization, and that generation runs. A negative
control shows the check would catch the other scale semantics.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tiny import FIXTURES, write_tokenizer

import mlx_ternary
from mlx_ternary.runtime.layers import ternary_layers

H, I, V, LAYERS = 64, 128, 128, 2
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
FIXTURES = FIXTURES / "hf"


def bf16(x) -> np.ndarray:
    """Round to bfloat16 (ties to even), kept as float32."""
    bits = np.asarray(x, np.float32).reshape(-1).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).reshape(np.shape(x))


def to_mx(a: np.ndarray, dtype: str) -> mx.array:
    return mx.array(np.asarray(a, np.float32)).astype(getattr(mx, dtype))


def hf_pack(t: np.ndarray) -> np.ndarray:
    """transformers' pack_weights: field i of packed row r holds row r + i * rows."""
    rows = -(-t.shape[0] // 4)
    padded = np.zeros((4 * rows, t.shape[1]), np.uint8)
    padded[: t.shape[0]] = t + 1
    out = np.zeros((rows, t.shape[1]), np.uint8)
    for i in range(4):
        out |= padded[i * rows : (i + 1) * rows] << (2 * i)
    return out


def shapes(cfg):
    kv = cfg["num_key_value_heads"] * cfg.get("head_dim", H // cfg["num_attention_heads"])
    q = cfg["num_attention_heads"] * cfg.get("head_dim", H // cfg["num_attention_heads"])
    return {
        "q_proj": (q, H),
        "k_proj": (kv, H),
        "v_proj": (kv, H),
        "o_proj": (H, q),
        "gate_proj": (I, H),
        "up_proj": (I, H),
        "down_proj": (H, I),
    }


def build(
    tmp: Path,
    name: str,
    config: dict,
    linear: str,
    dtype: str,
    *,
    sub_norms: bool,
    seed: int,
    names=None,
):
    """Write a checkpoint; returns (dir, {module path: (t int8, s float)} as encoded).

    linear: "packed:inv" (uint8 + weight_scale = 1/s), "packed:mean" (weight_scale = s),
        "latent" (float latent weights), "ts" (floats equal to t * s).
    """
    rng = np.random.default_rng(seed)
    w, enc = {}, {}
    norm = lambda n: to_mx(1 + 0.1 * rng.standard_normal(n), dtype)  # noqa: E731
    w["model.embed_tokens.weight"] = to_mx(rng.normal(0, 0.5, (V, H)), dtype)
    w["model.norm.weight"] = norm(H)
    if not config.get("tie_word_embeddings"):
        w["lm_head.weight"] = to_mx(rng.normal(0, 0.3, (V, H)), dtype)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        if sub_norms:
            w[p + "self_attn.attn_sub_norm.weight"] = norm(H)
            w[p + "mlp.ffn_sub_norm.weight"] = norm(I)
        for proj, shape in shapes(config).items():
            path = p + ("self_attn." if proj in ATTN else "mlp.") + proj
            s = np.float32(rng.uniform(0.02, 0.1))
            t = rng.integers(-1, 2, shape).astype(np.int8)
            if linear.startswith("packed"):
                stored = np.float32(bf16(1 / s) if linear == "packed:inv" else bf16(s))
                w[path + ".weight"] = mx.array(hf_pack(t))
                w[path + ".weight_scale"] = to_mx([stored], "bfloat16")
                s = np.float32(1) / stored if linear == "packed:inv" else stored
            elif linear == "latent":
                lat = to_mx(rng.normal(0, s, shape), dtype)
                w[path + ".weight"] = lat
                f = np.array(lat.astype(mx.float32))
                s = np.float32(np.abs(f).mean())
                t = np.clip(np.rint(f / s), -1, 1).astype(np.int8)
            else:  # "ts": one magnitude per tensor, exact in the storage dtype
                s = np.float32(bf16(s) if dtype == "bfloat16" else np.float16(s))
                w[path + ".weight"] = to_mx(t * s, dtype)
            enc[path] = (t, s)
    for old, new in (names or {}).items():
        w = {k.replace(new, old): v for k, v in w.items()}
    out = tmp / name
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(out)
    return out, enc


def check_layers(model, enc, invert_control=True):
    layers = dict(ternary_layers(model))
    assert set(layers) == set(enc)
    worst_inverted = 0.0
    for path, (t, s) in enc.items():
        got = np.array(layers[path].dequantize())
        np.testing.assert_allclose(got, t * s, rtol=1e-6, atol=0, err_msg=path)
        worst_inverted = max(worst_inverted, np.abs(got - t / s).max())
    if invert_control:  # the other scale semantics would be off by 1/s^2: caught above
        assert worst_inverted > 1.0


def generates(model, tok) -> int:
    from mlx_lm import stream_generate

    return sum(1 for _ in stream_generate(model, tok, "hi", max_tokens=3))


def common(**extra):
    return dict(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=0,
        eos_token_id=1,
        **extra,
    )


# --------------------------------------------------------------------------- #
# microsoft/bitnet-b1.58-2B-4T (and -bf16)
# --------------------------------------------------------------------------- #

BITNET_2B4T = common(
    architectures=["BitNetForCausalLM"],
    hidden_act="relu2",
    initializer_range=0.02,
    max_position_embeddings=4096,
    model_type="bitnet",
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    use_cache=True,
)
REV_2025_04 = {
    **BITNET_2B4T,
    "auto_map": {
        "AutoConfig": "configuration_bitnet.BitNetConfig",
        "AutoModelForCausalLM": "modeling_bitnet.BitNetForCausalLM",
    },
    "quantization_config": {"quant_method": "bitnet", "offline_quantization": True},
}
REV_CURRENT = {
    **BITNET_2B4T,
    "quantization_config": {
        "quant_method": "bitnet",
        "linear_class": "autobitlinear",
        "quantization_mode": "offline",
    },
}


@pytest.mark.parametrize("rev", ["2025-04 offline_quantization", "current linear_class"])
def test_bitnet_2b4t_packed(tmp_path, rev):
    cfg = REV_2025_04 if rev.startswith("2025") else REV_CURRENT
    src, enc = build(tmp_path, "2b4t", cfg, "packed:mean", "bfloat16", sub_norms=True, seed=1)
    model, tok = mlx_ternary.load(str(src))
    check_layers(model, enc)
    assert {m.activation_bits for _, m in ternary_layers(model)} == {8}
    assert generates(model, tok) == 3


@pytest.mark.parametrize(
    "qc",
    [
        {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"},
        {"quant_method": "bitnet", "online_quantization": True},
    ],
)
def test_bitnet_2b4t_bf16_master_weights(tmp_path, qc):
    cfg = {**BITNET_2B4T, "quantization_config": qc}
    src, enc = build(tmp_path, "bf16", cfg, "latent", "bfloat16", sub_norms=True, seed=2)
    model, tok = mlx_ternary.load(str(src))
    check_layers(model, enc, invert_control=False)
    assert {m.activation_bits for _, m in ternary_layers(model)} == {8}
    assert generates(model, tok) == 3


def test_bitnet_dequantized_output_reads_back_exactly(tmp_path):
    """`convert -d` of a bitnet-type model: floats t * s and no BitNet block. Read exactly,
    not re-ternarized with absmean (which would give s * mean|t|)."""
    src, enc = build(
        tmp_path, "2b4t", REV_CURRENT, "packed:mean", "bfloat16", sub_norms=True, seed=10
    )
    mlx_ternary.convert(str(src), tmp_path / "d", dequantize=True)
    check_layers(mlx_ternary.load(str(tmp_path / "d"))[0], enc)


def test_unsupported_bitnet_variant_is_refused_by_name(tmp_path):
    cfg = {
        **REV_CURRENT,
        "quantization_config": {**REV_CURRENT["quantization_config"], "use_rms_norm": True},
    }
    src, _ = build(tmp_path, "rms", cfg, "packed:mean", "bfloat16", sub_norms=True, seed=11)
    with pytest.raises(
        mlx_ternary.TernaryError,
        match=r"rms/config\.json: quantization_config"
        r"\.use_rms_norm is true",
    ):
        mlx_ternary.load(str(src))


# --------------------------------------------------------------------------- #
# mlx-community conversions of BitNet (mlx_lm.convert -q)
# --------------------------------------------------------------------------- #


def test_mlx_lm_convert_q_bitnet_made_by_mlx_lm(tmp_path):
    """mlx-lm itself quantizes the 2B4T layout (today's block: affine only) and saves it."""
    import mlx_lm
    from mlx_lm.utils import quantize_model, save

    src, enc = build(
        tmp_path, "2b4t", REV_CURRENT, "packed:mean", "bfloat16", sub_norms=True, seed=3
    )
    model, tok, config = mlx_lm.load(str(src), return_config=True, lazy=True)
    model, config = quantize_model(model, config, 64, 4)
    save(tmp_path / "q4", src, model, tok, config)
    assert json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"] == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
    }
    ours, tok, cfg = mlx_ternary.load(str(tmp_path / "q4"), return_config=True)
    check_layers(ours, enc)
    emb = ours.model.embed_tokens
    assert type(emb).__name__ == "QuantizedEmbedding" and (emb.bits, emb.group_size) == (4, 64)
    assert cfg["quantization"]["model.embed_tokens"] == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
    }
    # the embedding (and tied head) are mlx-lm's own quantized arrays, untouched
    saved = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    for leaf in ("weight", "scales", "biases"):
        np.testing.assert_array_equal(
            np.array(getattr(emb, leaf).astype(mx.float32)),
            np.array(saved[f"model.embed_tokens.{leaf}"].astype(mx.float32)),
        )
    assert generates(ours, tok) == 3


def test_mlx_community_bitnet_4bit_2025_06_block(tmp_path):
    """The block older mlx-lm wrote: the HF BitNet keys merged into `quantization`."""
    q = {
        "group_size": 64,
        "bits": 4,
        "quant_method": "bitnet",
        "linear_class": "autobitlinear",
        "quantization_mode": "offline",
    }
    cfg = {**BITNET_2B4T, "quantization": q, "quantization_config": dict(q)}
    src, enc = build(tmp_path, "mc", cfg, "packed:mean", "bfloat16", sub_norms=True, seed=4)
    emb = mx.load(str(src / "model.safetensors"))["model.embed_tokens.weight"]
    wq, sc, bi = mx.quantize(emb, group_size=64, bits=4)
    tensors = {
        **mx.load(str(src / "model.safetensors")),
        "model.embed_tokens.weight": wq,
        "model.embed_tokens.scales": sc,
        "model.embed_tokens.biases": bi,
    }
    mx.save_safetensors(str(src / "model.safetensors"), tensors)
    model, tok = mlx_ternary.load(str(src))
    check_layers(model, enc)
    np.testing.assert_array_equal(
        np.array(model.model.embed_tokens(mx.array([[5, 9]])).astype(mx.float32))[0],
        # the exact values the file encodes (scales widened first: bfloat16 math would round)
        np.array(
            mx.dequantize(wq, sc.astype(mx.float32), bi.astype(mx.float32), group_size=64, bits=4)[
                mx.array([5, 9])
            ]
        ),
    )
    assert generates(model, tok) == 3


# --------------------------------------------------------------------------- #
# Llama-typed BitNet: Falcon3-*-1.58bit, HF1BitLLM, Falcon-E (three revisions)
# --------------------------------------------------------------------------- #

LLAMA = common(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1000042.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    attention_bias=False,
    mlp_bias=False,
    pretraining_tp=1,
    head_dim=16,
)
PUBLISHED_LLAMA = {
    "Falcon3-1.58bit": {
        **LLAMA,
        "is_bitnet_config": True,
        "quantization_config": {"modules_to_not_convert": None, "quant_method": "bitnet"},
    },
    "HF1BitLLM": {
        **LLAMA,
        "quantization_config": {"modules_to_not_convert": None, "quant_method": "bitnet"},
    },
    "Falcon-E main": {
        **LLAMA,
        "is_bitnet_config": True,
        "quantization_config": {"modules_to_not_convert": ["lm_head"], "quant_method": "bitnet"},
    },
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_LLAMA))
def test_llama_bitnet_packed(tmp_path, name):
    src, enc = build(
        tmp_path, "m", PUBLISHED_LLAMA[name], "packed:inv", "bfloat16", sub_norms=False, seed=5
    )
    model, tok = mlx_ternary.load(str(src))
    check_layers(model, enc)
    assert {m.activation_bits for _, m in ternary_layers(model)} == {8}
    assert generates(model, tok) == 3


def test_falcon_e_prequantized_latent(tmp_path):
    src, enc = build(
        tmp_path,
        "pre",
        {**LLAMA, "is_bitnet_config": True},
        "latent",
        "bfloat16",
        sub_norms=False,
        seed=6,
    )
    model, tok = mlx_ternary.load(str(src))
    check_layers(model, enc, invert_control=False)
    assert {m.activation_bits for _, m in ternary_layers(model)} == {8}
    assert generates(model, tok) == 3


@pytest.mark.parametrize("marked", [True, False])
def test_falcon_e_bfloat16_revision(tmp_path, marked):
    cfg = {**LLAMA, "is_bitnet_config": True} if marked else LLAMA
    src, enc = build(tmp_path, "bf16", cfg, "ts", "bfloat16", sub_norms=False, seed=7)
    report = mlx_ternary.convert(str(src), tmp_path / "out")
    assert report.max_error == 0.0
    model, tok, config = mlx_ternary.load(str(tmp_path / "out"), return_config=True)
    check_layers(model, enc)
    # int8 activations as trained when the config says BitNet; none can be inferred otherwise
    assert config["quantization"]["activation_bits"] == (8 if marked else None)
    assert generates(model, tok) == 3
    if not marked:  # ... unless the caller says so
        from click.testing import CliRunner

        from mlx_ternary.cli import main

        res = CliRunner().invoke(
            main,
            [
                "convert",
                "--hf-path",
                str(src),
                "--mlx-path",
                str(tmp_path / "a8"),
                "--activation-bits",
                "8",
            ],
        )
        assert res.exit_code == 0, res.output
        assert "activation quantization set by the caller: int8" in res.output
        model = mlx_ternary.load(str(tmp_path / "a8"))[0]
        assert {m.activation_bits for _, m in ternary_layers(model)} == {8}


# --------------------------------------------------------------------------- #
# 1bitLLM (transformers-made fixture), TriLM
# --------------------------------------------------------------------------- #


def test_1bitllm_fixture_layers_and_generation(tmp_path):
    from safetensors.numpy import load_file

    src = tmp_path / "1bit"
    shutil.copytree(FIXTURES / "bitnet_latent_noquantconfig", src)
    write_tokenizer(src)
    stored = load_file(str(src / "model.safetensors"))
    enc = {}
    for name, w in stored.items():
        if name.endswith("_proj.weight"):
            f = w.astype(np.float32)
            s = np.float32(np.abs(f).mean())
            enc[name[:-7]] = (np.clip(np.rint(f / s), -1, 1).astype(np.int8), s)
    model, tok = mlx_ternary.load(str(src))
    check_layers(model, enc, invert_control=False)
    assert generates(model, tok) == 3


def test_trilm_unpacked(tmp_path):
    cfg = common(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype="float16",
    )
    src, enc = build(tmp_path, "trilm", cfg, "ts", "float16", sub_norms=False, seed=8)
    model, tok, config = mlx_ternary.load(str(src), return_config=True)
    check_layers(model, enc)
    assert config["quantization"]["activation_bits"] is None
    assert generates(model, tok) == 3


# --------------------------------------------------------------------------- #
# Ternary-Bonsai (MLX 2-bit g128 packs): embedding and lm_head stay packed
# --------------------------------------------------------------------------- #


def bonsai(tmp: Path, tied: bool, seed=9):
    """Qwen3 with every linear, the embedding and the lm_head 2-bit g128, codes t + 1."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from mlx_ternary.checkpoint.writers.mlx_affine import pack_codes

    cfg = dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=V,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=1024,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="float16",
        quantization={"group_size": 128, "bits": 2},
        quantization_config={"group_size": 128, "bits": 2},
    )
    model_class, args_class = _get_classes(cfg)
    rng = np.random.default_rng(seed)
    w, enc = {}, {}
    for name, v in tree_flatten(model_class(args_class.from_dict(cfg)).parameters()):
        path = name.rpartition(".")[0]
        if v.ndim == 2:  # Linear or Embedding: packed
            n, k = v.shape
            t = rng.integers(-1, 2, (n, k)).astype(np.int8)
            s = rng.uniform(0.01, 0.1, (n, k // 128)).astype(np.float16)
            w[name] = mx.array(pack_codes((t + 1).astype(np.uint8), 2))
            w[f"{path}.scales"], w[f"{path}.biases"] = mx.array(s), mx.array(-s)
            enc[path] = (t, np.repeat(s.astype(np.float32), 128, axis=1))
        else:
            w[name] = mx.array((1 + 0.05 * rng.standard_normal(v.shape)).astype(np.float16))
    out = tmp / f"bonsai-{'tied' if tied else 'untied'}"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(out)
    return out, enc


@pytest.mark.parametrize("tied", [True, False])  # 1.7B/4B tie the head; 8B does not
def test_ternary_bonsai_stays_packed(tmp_path, tied):
    from mlx.utils import tree_flatten

    src, enc = bonsai(tmp_path, tied)
    model, tok = mlx_ternary.load(str(src), packing="fast")
    layers = dict(ternary_layers(model))
    for path, (t, s) in enc.items():
        if path in layers:
            got = np.array(layers[path].dequantize())
        else:  # the embedding: MLX 2-bit affine, as stored
            m = dict(model.named_modules())[path]
            assert type(m).__name__ == "QuantizedEmbedding" and m.bits == 2
            got = np.array(
                mx.dequantize(m.weight, m.scales, m.biases, group_size=128, bits=2).astype(
                    mx.float32
                )
            )
        np.testing.assert_array_equal(got, t * s, err_msg=path)
    assert ("lm_head" in layers) != tied and len(layers) == 14 + (not tied)
    resident = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    packed = (src / "model.safetensors").stat().st_size
    norms = sum(a.nbytes for n, a in tree_flatten(model.parameters()) if a.ndim == 1)
    # float32 norms off the GPU double their bytes; the rest is at most the packed bytes
    assert resident <= 1.05 * packed and resident - norms / 2 <= packed, (resident, packed)
    assert generates(model, tok) == 3


def test_ternary_bonsai_converts_with_its_embedding_packed(tmp_path):
    src, _ = bonsai(tmp_path, tied=True)
    report = mlx_ternary.convert(str(src), tmp_path / "native", packing="compact")
    assert report.max_error == 0.0
    kinds = {t.name: t.kind for t in report.tensors}
    assert kinds["model.embed_tokens"] == "affine 2-bit g128 (kept)"
    assert report.bits_per_weight <= 1.75
    tokens = mx.array([[3, 17, 42, 5]])
    want = np.array(mlx_ternary.load(str(src))[0](tokens))
    model = mlx_ternary.load(str(tmp_path / "native"))[0]
    assert model.model.embed_tokens.bits == 2
    np.testing.assert_allclose(np.array(model(tokens)), want, rtol=1e-5, atol=1e-5)
