"""Bonsai-2 style prism_hadamard_qwen35 packs: repacked losslessly with the rotation kept."""

import json

import mlx.core as mx
import numpy as np
import pytest
from tiny import write_tokenizer

import mlx_ternary
from mlx_ternary.checkpoint.convert import convert
from mlx_ternary.checkpoint.writers.mlx_affine import pack_codes
from mlx_ternary.runtime.layers import HadamardTernaryLinear

TOKENS = mx.array([[3, 17, 42, 5, 99, 64, 1, 20]])
TEXT = dict(
    model_type="qwen3_5_text",
    hidden_size=512,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=128,
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    rope_parameters={
        "type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [4, 2, 2],
    },
)
MODULES = [
    {
        "path": f"model.layers.{i}.mlp.{m}",
        "embedding": False,
        "dtype": "float16",
        "block": 0 if (i, m) == (1, "down_proj") else 512,
    }
    for i in range(2)
    for m in ("gate_proj", "up_proj", "down_proj")
] + [{"path": "model.embed_tokens", "embedding": True, "dtype": "float16", "block": 512}]


def logits(model):
    return np.array(model(TOKENS).astype(mx.float32))


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """A tiny pack laid out per mlx-lm's prism_hadamard_qwen35 schema 1."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = {
        "model_type": "prism_hadamard_qwen35",
        "schema_version": 1,
        "tensor_namespace": "mlx-lm-text",
        "gdn_activation_layout": "grouped",
        "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
        "modules": MODULES,
        "text_config": TEXT,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    model_class, args_class = _get_classes(config)
    params = dict(tree_flatten(model_class(args_class.from_dict(config)).parameters()))
    rng = np.random.default_rng(5)
    w = {}
    for name, v in params.items():
        path, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases"):
            continue
        if leaf == "weight" and f"{path}.scales" in params:
            n, k = v.shape[0], v.shape[1] * 16
            t = rng.integers(-1, 2, (n, k))
            s = rng.uniform(0.02, 0.1, (n, k // 128)).astype(np.float16)
            w[name] = mx.array(pack_codes((t + 1).astype(np.uint8), 2))
            w[f"{path}.scales"] = mx.array(s)
            w[f"{path}.biases"] = mx.array(-s)
        elif leaf == "signs":
            w[name] = mx.array(rng.choice([-1.0, 1.0], v.shape).astype(np.float32))
        elif v.ndim == 1:
            w[name] = (
                mx.array((1 + 0.05 * rng.normal(size=v.shape)).astype(np.float32))
                if "norm" in name
                else mx.array(0.1 * rng.normal(size=v.shape).astype(np.float32))
            )
        else:
            w[name] = mx.array(rng.normal(0, 0.1, v.shape).astype(np.float32))
    out = tmp_path_factory.mktemp("prism") / "pack"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), w)
    (out / "config.json").write_text(json.dumps(config))
    write_tokenizer(out)
    return out


def test_prism_pack_keeps_rotation(tmp_path, pack):
    import mlx_lm

    want = logits(mlx_lm.load(str(pack))[0])  # mlx-lm's own class on the same pack
    in_place = mlx_ternary.load(str(pack))[0]
    np.testing.assert_allclose(logits(in_place), want, atol=2e-3, rtol=2e-3)
    report = convert(str(pack), tmp_path / "native", packing="compact")
    assert report.max_error == 0.0 and "rotation kept" in report.source_kind
    assert report.bits_per_weight <= 1.75
    model = mlx_ternary.load(str(tmp_path / "native"))[0]
    layers = [m for _, m in model.named_modules() if isinstance(m, HadamardTernaryLinear)]
    assert len(layers) == 6 and sorted(m.block for m in layers) == [0] + [512] * 5
    np.testing.assert_allclose(logits(model), want, atol=2e-3, rtol=2e-3)
    # negative control: with the rotation switched off the logits differ
    for m in layers:
        m.block = 0
    assert np.abs(logits(model) - want).max() > 1e-2


def test_prism_pack_refuses_stock_output(tmp_path, pack):
    with pytest.raises(mlx_ternary.TernaryError, match="prism_hadamard_qwen35 class"):
        convert(str(pack), tmp_path / "q4", q_bits=4)
    assert not (tmp_path / "q4").exists()
