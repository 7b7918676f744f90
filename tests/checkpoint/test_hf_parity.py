"""Parity with transformers' own BitNet code, through fixtures it produced.

tests/fixtures/hf/*/ were written by scripts/fixtures/make_hf_fixtures.py: checkpoints packed with
transformers' `pack_weights` (or float latent), and the logits of transformers' forward,
activation quantization included. No torch is needed here.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from tiny import FIXTURES

from mlx_ternary.checkpoint.load import load_model
from mlx_ternary.runtime.layers import ternary_layers

FIXTURES = FIXTURES / "hf"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.safetensors").exists())
# Float32 on both sides; transformers dequantizes before or after the matmul depending on
# the class, which moves logits by ~1e-6. Every wrong-math variant is >= 0.05 off.
ATOL = 1e-4


def _logits(path, **kw):
    expected = mx.load(str(path / "expected.safetensors"))
    model, _ = load_model(path, **kw)
    return np.array(model(expected["input_ids"])), np.array(expected["logits"]), model


def test_all_four_fixtures_present():
    assert NAMES == [
        "bitnet_latent_noquantconfig",
        "bitnet_offline_autobitlinear",
        "llama_offline_bitlinear",
        "llama_online_autobitlinear",
    ]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("packing", ["compact", "fast"])
def test_logits_match_transformers(name, packing):
    got, want, model = _logits(FIXTURES / name, packing=packing)
    assert {m.activation_bits for _, m in ternary_layers(model)} == {8}
    assert len(ternary_layers(model)) == 14
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_negative_control_without_activation_quantization(name):
    path = FIXTURES / name
    expected = mx.load(str(path / "expected.safetensors"))
    model, _ = load_model(path)
    for _, m in ternary_layers(model):
        m.activation_bits = None
    got = np.array(model(expected["input_ids"]))
    assert np.abs(got - np.array(expected["logits"])).max() > 0.05


def _copy_with_config(tmp_path, name, **changes):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if isinstance(v, dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_negative_control_wrong_scale_semantics(tmp_path):
    # Reading a `bitlinear` checkpoint's 1/mean|W| as if it were mean|W| must break parity.
    dst = _copy_with_config(
        tmp_path, "llama_offline_bitlinear", quantization_config={"linear_class": "autobitlinear"}
    )
    got, want, _ = _logits(dst)
    assert np.abs(got - want).max() > 0.05


def test_negative_control_rope_parameters_ignored(tmp_path):
    dst = _copy_with_config(tmp_path, "llama_offline_bitlinear", rope_theta=10000.0)
    got, want, _ = _logits(dst)
    assert np.abs(got - want).max() > 0.05


def test_negative_control_onebit_activation(tmp_path):
    dst = _copy_with_config(tmp_path, "bitnet_latent_noquantconfig", hidden_act="relu2")
    got, want, _ = _logits(dst)
    assert np.abs(got - want).max() > 0.05
