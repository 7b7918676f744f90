"""Layers that stay MLX affine-quantized: mlx-lm's quantize_model -> save -> reload, the
ternary format's version 2, stock MLX outputs, and the errors for what is not kept."""

import json
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny import ternary_checkpoint

import mlx_ternary
from mlx_ternary import format as F
from mlx_ternary.errors import FormatError
from mlx_ternary.runtime.layers import ternary_layers

TOKENS = mx.array([[3, 17, 42, 5, 99, 64, 1, 20]])


def logits(model) -> np.ndarray:
    return np.array(model(TOKENS).astype(mx.float32))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A native llama whose embedding and lm_head mlx-lm's quantize_model made 4-bit, saved
    with mlx-lm's save; returns (dir, logits of the in-memory model that was saved)."""
    from mlx_lm.utils import quantize_model, save

    tmp = tmp_path_factory.mktemp("affine")
    src, _ = ternary_checkpoint(tmp, "llama", "compact", "row", activation_bits=8)
    model, tok, config = mlx_ternary.load(str(src), return_config=True)
    model, config = quantize_model(model, config, 64, 4)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    want = logits(model)
    save(tmp / "q", src, model, tok, config)
    return tmp / "q", want


def test_quantize_model_save_reload(quantized):
    path, want = quantized
    saved = json.loads((path / "config.json").read_text())["quantization"]
    assert saved["model.embed_tokens"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    model, _, config = mlx_ternary.load(str(path), return_config=True)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert type(model.lm_head) is nn.QuantizedLinear and model.lm_head.bits == 4
    assert len(ternary_layers(model)) == 14
    np.testing.assert_array_equal(logits(model), want)
    assert config["quantization"]["format_version"] == 2


def test_native_version_2_keeps_affine_layers(quantized, tmp_path, monkeypatch):
    path, want = quantized
    report = mlx_ternary.convert(str(path), tmp_path / "n", packing="compact")
    kinds = {t.name: t.kind for t in report.tensors}
    assert kinds["model.embed_tokens"] == "affine 4-bit g64 (kept)"
    cfg = json.loads((tmp_path / "n" / "config.json").read_text())["quantization"]
    assert cfg["format_version"] == 2 and cfg["lm_head"]["bits"] == 4
    np.testing.assert_array_equal(logits(mlx_ternary.load(str(tmp_path / "n"))[0]), want)
    from mlx_ternary.checkpoint.verify import verify

    assert verify(tmp_path / "n").ok
    # a reader that knows only version 1 refuses, naming the file and the versions it reads
    monkeypatch.setattr(F, "KNOWN_VERSIONS", (1,))
    with pytest.raises(
        FormatError,
        match=r"config\.json: mlx-ternary format_version 2 is not "
        r"one .* \(known: 1\)",
    ):
        mlx_ternary.load(str(tmp_path / "n"))


def test_without_affine_layers_version_1_is_written(tmp_path):
    src, _ = ternary_checkpoint(tmp_path, "llama", "compact", "row")
    mlx_ternary.convert(str(src), tmp_path / "n")
    assert (
        json.loads((tmp_path / "n" / "config.json").read_text())["quantization"]["format_version"]
        == 1
    )


PLAIN_MLX_LM = """
import sys, json, numpy as np, mlx.core as mx, mlx_lm
model, tok = mlx_lm.load(sys.argv[2])
assert type(model.model.embed_tokens).__name__ == "QuantizedEmbedding"
assert model.model.embed_tokens.bits == 4 and model.model.layers[0].mlp.up_proj.bits == 2
print(json.dumps(np.array(model(mx.array(json.loads(sys.argv[1]))).astype(mx.float32)).tolist()))
assert "mlx_ternary" not in sys.modules
"""


def test_stock_output_records_kept_layers_per_layer(quantized, tmp_path):
    path, _ = quantized
    mlx_ternary.convert(str(path), tmp_path / "q2", q_bits=2, q_group_size=32)
    q = json.loads((tmp_path / "q2" / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"]) == (2, 32)
    assert q["model.embed_tokens"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    proc = subprocess.run(
        [sys.executable, "-c", PLAIN_MLX_LM, json.dumps(TOKENS.tolist()), str(tmp_path / "q2")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    ours = mlx_ternary.load(str(path))[0]
    for _, layer in ternary_layers(ours):  # stock mlx-lm has no activation quantization
        layer.activation_bits = None
    np.testing.assert_allclose(np.array(json.loads(proc.stdout)), logits(ours), atol=1e-4)


def test_dequantize_asks_for_floats(quantized, tmp_path):
    path, want = quantized
    mlx_ternary.convert(str(path), tmp_path / "d", dequantize=True)
    import mlx_lm

    model = mlx_lm.load(str(tmp_path / "d"))[0]
    assert type(model.model.embed_tokens) is nn.Embedding


def _with_lm_head_entry(src, dst, entry):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization"]["lm_head"] = entry
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_mode_is_one_clear_line(quantized, tmp_path):
    dst = _with_lm_head_entry(
        quantized[0], tmp_path / "m", {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    )
    with pytest.raises(
        FormatError,
        match=r"config\.json: quantization\.lm_head: quantization "
        "mode 'mxfp4' is not kept by mlx-ternary",
    ):
        mlx_ternary.load(str(dst))


def test_affine_shape_mismatch_names_file_and_tensor(quantized, tmp_path):
    dst = _with_lm_head_entry(
        quantized[0], tmp_path / "m", {"group_size": 64, "bits": 8, "mode": "affine"}
    )
    with pytest.raises(
        FormatError,
        match=r"m: lm_head\.weight: shape \(128, 8\) with scales "
        r"\(128, 1\) does not hold a \(128, 64\) weight at "
        "8 bits",
    ):
        mlx_ternary.load(str(dst))


@pytest.mark.parametrize("bits", [4, 2])
def test_stock_outputs_read_back_as_ternary_unless_a_code_is_not(tmp_path, bits):
    src, _ = ternary_checkpoint(tmp_path, "llama", "compact", "row")
    want = {p: np.array(m.dequantize()) for p, m in ternary_layers(mlx_ternary.load(str(src))[0])}
    mlx_ternary.convert(str(src), tmp_path / "q", q_bits=bits, q_group_size=32)
    got = dict(ternary_layers(mlx_ternary.load(str(tmp_path / "q"))[0]))
    assert set(got) == set(want)
    for p, w in want.items():
        np.testing.assert_array_equal(np.array(got[p].dequantize()), w, err_msg=p)
    # negative control: one code 3 (w = 2s) makes that layer an affine layer, kept as stored
    f = tmp_path / "q" / "model.safetensors"
    tensors = mx.load(str(f))
    name = "model.layers.1.mlp.up_proj.weight"
    w = np.array(tensors[name])
    w[0, 0] |= np.uint32(3)  # the first code of row 0
    tensors[name] = mx.array(w)
    mx.save_safetensors(str(f), tensors)
    model = mlx_ternary.load(str(tmp_path / "q"))[0]
    assert type(model.model.layers[1].mlp.up_proj) is nn.QuantizedLinear
    assert len(ternary_layers(model)) == len(want) - 1
