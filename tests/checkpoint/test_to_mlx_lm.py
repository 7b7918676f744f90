"""convert --to-mlx-lm: what stock mlx-lm loads, checked by stock mlx-lm itself.

The stock side runs in a subprocess that never imports mlx_ternary: plain `mlx_lm.load`
and the model's own forward pass. mlx-lm's BitLinear kernel is Metal-only; off a Mac the
subprocess builds it through the Metal emulator (its files loaded by path under another
package name, so `mlx_ternary` stays out of sys.modules): mlx-lm's own kernel source runs.
"""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file
from tiny import FIXTURES, ternary_checkpoint

import mlx_ternary
from mlx_ternary.checkpoint.convert import convert
from mlx_ternary.cli import main
from mlx_ternary.errors import TernaryError

TOKENS = [[3, 17, 42, 5, 99, 64, 1, 20]]
PACKAGE = Path(mlx_ternary.__file__).parent

STOCK_MLX_LM = """
import importlib, json, sys, types
import mlx.core as mx, numpy as np
if not mx.metal.is_available():  # the Metal emulator, loaded by path: not mlx_ternary
    host = types.ModuleType("_emulator_host")
    host.__path__ = [sys.argv[1]]
    sys.modules["_emulator_host"] = host
    with importlib.import_module("_emulator_host.emulator").use_emulator():
        import mlx_lm.models.bitlinear_layers  # builds its kernel at import
import mlx_lm
out = {}
for d in sys.argv[3:]:
    try:
        model, _ = mlx_lm.load(d)
        logits = model(mx.array(json.loads(sys.argv[2])))
        out[d] = np.array(logits.astype(mx.float32)).tolist()
    except Exception as e:
        out[d] = f"{type(e).__name__}: {e}"
assert "mlx_ternary" not in sys.modules
print(json.dumps(out))
"""


def stock_logits(tmp: Path, *dirs) -> dict:
    """{dir: logits (numpy) or the error text} from stock mlx-lm in a clean subprocess."""
    proc = subprocess.run(
        [sys.executable, "-c", STOCK_MLX_LM, str(PACKAGE), json.dumps(TOKENS), *map(str, dirs)],
        capture_output=True,
        text=True,
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    return {Path(k): v if isinstance(v, str) else np.array(v) for k, v in out.items()}


def our_logits(path, activations="float") -> np.ndarray:
    model = mlx_ternary.load(str(path), activations=activations)[0]
    return np.array(model(mx.array(TOKENS)).astype(mx.float32))


def test_bitnet_to_mlx_lm_loads_in_stock_mlx_lm(tmp_path):
    src, _ = ternary_checkpoint(tmp_path, "bitnet", "compact", "tensor", activation_bits=8)
    out, deq, q4 = tmp_path / "mlx-lm", tmp_path / "deq", tmp_path / "q4"
    report = convert(str(src), to_mlx_lm=out, dtype="float32")
    assert report.max_error == 0.0 and report.target.startswith("mlx-lm BitLinear")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bitnet"
    assert "quantization" not in config  # mlx-lm would take the affine route
    w = load_file(str(out / "model.safetensors"))
    assert w["model.layers.0.mlp.gate_proj.weight"].dtype == np.uint8
    assert w["model.layers.0.mlp.gate_proj.weight"].shape == (112 // 4, 64)
    assert w["model.layers.0.mlp.gate_proj.weight_scale"].shape == (1,)
    card = (out / "README.md").read_text()
    assert "stock `mlx_lm.load`" in card and "int8" in card
    convert(str(src), deq, dequantize=True)
    assert "Stock `mlx_lm.load` does not load it" in (deq / "README.md").read_text()
    with pytest.raises(TernaryError, match="--to-mlx-lm DIR` without -q"):
        convert(str(src), q4, q_bits=4)

    got = stock_logits(tmp_path, out, deq)
    # what the -d card says: stock mlx-lm refuses the float bitnet checkpoint ...
    assert isinstance(got[deq], str) and "weight_scale" in got[deq], got[deq]
    # ... and mlx_ternary reads it, as the card says
    want = our_logits(out)
    np.testing.assert_allclose(our_logits(deq), want, atol=1e-4, rtol=1e-4)
    # stock mlx-lm on the BitLinear checkpoint = mlx_ternary's model, activations in float
    np.testing.assert_allclose(got[out], want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(our_logits(src), want, atol=1e-4, rtol=1e-4)
    # negative control: with the source's int8 activations the model differs
    assert np.abs(our_logits(out, activations=None) - got[out]).max() > 1e-2


def test_transformers_bitnet_round_trips_byte_for_byte(tmp_path):
    """A checkpoint transformers made (packed, autobitlinear) already is mlx-lm's layout:
    reading it and writing --to-mlx-lm gives its packed bytes and scales back."""
    src = FIXTURES / "hf" / "bitnet_offline_autobitlinear"
    out = tmp_path / "out"
    convert(str(src), to_mlx_lm=out)
    theirs, ours = mx.load(str(src / "model.safetensors")), mx.load(str(out / "model.safetensors"))
    packed = [k for k, v in theirs.items() if v.dtype == mx.uint8]
    assert len(packed) == 14
    for k in packed:
        np.testing.assert_array_equal(np.array(ours[k]), np.array(theirs[k]), err_msg=k)
        scale = k + "_scale"
        assert ours[scale].dtype == theirs[scale].dtype == mx.bfloat16
        assert mx.array_equal(ours[scale], theirs[scale]).item(), k
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and "input_bits" not in config


def test_llama_to_mlx_lm_is_the_exact_affine_checkpoint(tmp_path):
    src, _ = ternary_checkpoint(tmp_path, "llama", "compact", "row", intermediate_size=128)
    two, four = tmp_path / "two", tmp_path / "four"
    report = convert(str(src), to_mlx_lm=two)
    assert report.max_error == 0.0 and report.target == "MLX affine 2-bit, group size 64"
    convert(str(src), to_mlx_lm=four, q_bits=4, q_group_size=32)
    assert json.loads((four / "config.json").read_text())["quantization"]["bits"] == 4
    got = stock_logits(tmp_path, two, four)
    want = our_logits(src)
    for d in (two, four):
        np.testing.assert_allclose(got[d], want, atol=1e-4, rtol=1e-4, err_msg=str(d))
    # negative control: mx.quantize's own 2-bit rounding of the same weights is lossy
    lossy = mlx_ternary.load(str(src), activations="float")[0]
    from mlx_ternary.runtime.layers import ternary_layers

    w = {p: m.dequantize() for p, m in ternary_layers(lossy)}
    p0 = sorted(w)[0]
    back = mx.dequantize(*mx.quantize(w[p0], group_size=64, bits=2), group_size=64, bits=2)
    assert mx.abs(back - w[p0]).max().item() > 1e-2


def test_gguf_bitnet_to_mlx_lm(tmp_path, monkeypatch):
    """bitnet.cpp's architecture (relu2) is written; llama.cpp's `bitnet` (1bitLLM: silu)
    is refused, since mlx-lm's bitnet class computes relu2 whatever the config says."""
    import gguf_build as gb

    monkeypatch.setenv("MLX_TERNARY_GGUF_CACHE", str(tmp_path / "cache"))  # load() converts

    src, _, _ = gb.write(tmp_path / "b.gguf", "bitnet-b1.58", ternary=("TQ2_0", "TQ1_0"))
    out = tmp_path / "out"
    assert convert(str(src), to_mlx_lm=out, dtype="float32").max_error == 0.0
    got = stock_logits(tmp_path, out)[out]
    np.testing.assert_allclose(got, our_logits(src), atol=1e-4, rtol=1e-4)
    silu, _, _ = gb.write(tmp_path / "s.gguf", "bitnet", ternary=("TQ2_0",))
    with pytest.raises(TernaryError, match="hidden_act 'silu'; mlx-lm's bitnet class computes"):
        convert(str(silu), to_mlx_lm=tmp_path / "silu")


def test_per_row_scales_cannot_be_bitlinear(tmp_path):
    src, _ = ternary_checkpoint(tmp_path, "bitnet", "compact", "row")
    with pytest.raises(TernaryError, match=r"q_proj: its ternary scales vary .* ternary format"):
        convert(str(src), to_mlx_lm=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("src")
    return ternary_checkpoint(tmp, "llama", "compact", "row", intermediate_size=128)[0]


@pytest.mark.parametrize(
    "args, bits",
    [
        (["-q", "4"], 4),
        (["-q", "--q-bits", "3"], 3),
        (["--quantize"], 4),
        (["--q-bits", "8"], 8),
        (["-q", "--q-group-size", "32"], 4),
    ],
)
def test_cli_quantize_forms(tmp_path, llama_src, args, bits):
    out = tmp_path / "o"
    res = CliRunner().invoke(
        main, ["convert", "--hf-path", str(llama_src), "--mlx-path", str(out), *args]
    )
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == bits


@pytest.mark.parametrize(
    "args, message",
    [
        (["-q", "4", "--q-bits", "3"], "-q 4 and --q-bits 3 disagree"),
        (["--q-group-size", "32"], "--q-group-size applies to -q"),
        (["-q", "--packing", "fast"], "drop --packing"),
        (["-d", "--packing", "fast"], "drop --packing"),
        (["--gguf-type", "TQ1_0"], "--gguf-type applies to --to-gguf only"),
        (["-d", "--to-mlx-lm", "x"], "give exactly one destination"),
        (["-q", "--to-gguf", "x.gguf"], "--to-gguf a GGUF file; give one"),
    ],
)
def test_cli_refuses_options_that_do_nothing(tmp_path, llama_src, args, message):
    res = CliRunner().invoke(
        main, ["convert", "--hf-path", str(llama_src), "--mlx-path", str(tmp_path / "o"), *args]
    )
    assert res.exit_code in (1, 2) and message in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "o").exists()
