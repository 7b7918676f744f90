"""bench and the ceiling model: exact representations, honest bytes, numbers that add up."""

import importlib.util
import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from tiny import ROOT, quantize_act_np, ternary_checkpoint

from mlx_ternary import format as F
from mlx_ternary.bench import ceiling as C
from mlx_ternary.bench import formats as B
from mlx_ternary.bench import variants as V
from mlx_ternary.checkpoint.load import load_model
from mlx_ternary.cli import main
from mlx_ternary.runtime import dispatch
from mlx_ternary.runtime.layers import ternary_layers
from mlx_ternary.runtime.reference import qmm_group

ROOT = ROOT
ALL = list(B.FORMATS)


def _synthetic():
    spec = importlib.util.spec_from_file_location(
        "make_synthetic_model", ROOT / "scripts" / "fixtures" / "make_synthetic_model.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """BitNet-shaped, widths multiples of 64, bf16 scales, int8 activations."""
    return _synthetic().write(tmp_path_factory.mktemp("syn") / "tiny", "tiny", seed=3)


@pytest.fixture(scope="module", params=["compact", "fast"])
def variants(tiny_dir, request):
    """Every format, built from a base held compact (from trits) or fast (bit moves)."""
    base, config = load_model(tiny_dir, packing=request.param)
    return base, B.build_variants(base, config, tiny_dir, ALL)


def test_synthetic_checkpoint_has_the_shape_and_real_trits(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["quantization"]["packing"] == "compact"
    assert config["quantization"]["activation_bits"] == 8
    base, _ = load_model(tiny_dir, packing="compact")
    layers = dict(ternary_layers(base))
    assert len(layers) == 2 * 7  # q k v o gate up down per layer
    down = layers["model.layers.0.mlp.down_proj"]
    assert (down.in_features, down.out_features) == (320, 128)
    t = np.array(down.trits())
    assert set(np.unique(t)) == {-1, 0, 1}
    assert 0.25 < (t == 0).mean() < 0.42  # uniform random trits
    assert _synthetic().shape_config("bonsai-27b", 2)["text_config"]["num_hidden_layers"] == 2


def test_every_representation_computes_the_same_layer(variants):
    """Each format's layer equals x @ (s * t).T, computed in float64 from the trits."""
    base, built = variants
    x = np.random.default_rng(0).normal(size=(3, 320)).astype(np.float32)
    for path, layer in ternary_layers(base):
        k = layer.in_features
        w = np.array(layer.dequantize(mx.float32)).astype(np.float64)
        xs = x[:, :k]
        for name in ALL:
            model, res = built[name]
            assert res.loads, (name, res.reason)
            m = dict(model.named_modules())[path]
            if name == "bf16":
                y = np.array(m(mx.array(xs).astype(mx.bfloat16)).astype(mx.float32))
                ref = np.array(mx.array(xs).astype(mx.bfloat16).astype(mx.float32)) @ w.T
                tol = 3e-2
            else:
                y = np.array(m(mx.array(xs)))
                xr = quantize_act_np(xs) if name in ("compact", "fast") else xs
                ref, tol = xr @ w.T, 2e-5
            np.testing.assert_allclose(
                y, ref, rtol=tol, atol=tol * np.abs(ref).max(), err_msg=f"{name} {path}"
            )


def test_negative_control_mx_quantize_2bit_is_lossy_on_ternary(variants):
    base, _ = variants
    layer = ternary_layers(base)[0][1]
    w = layer.dequantize(mx.float32)
    wq, s, b = mx.quantize(w, group_size=64, bits=2)
    lossy = mx.dequantize(wq, s, b, group_size=64, bits=2)
    assert mx.abs(lossy - w).max().item() > 1e-3  # why q2 is built by hand


def test_bytes_held_per_format(variants):
    base, built = variants
    layers = ternary_layers(base)
    n_weights = sum(m.in_features * m.out_features for _, m in layers)
    assert built["q2"][1].bits_per_weight == pytest.approx(2 + 2 * 16 / 64)  # bf16 s, b
    assert built["q4"][1].bits_per_weight == pytest.approx(4 + 2 * 16 / 64)
    assert built["bf16"][1].bits_per_weight == 16
    assert built["f32"][1].bits_per_weight == 32
    # fast: 2-bit codes + one bf16 scale per tensor; on the reference backend also float32
    # unit scale/bias arrays (N, K/g), shared by every layer of one shape, counted once.
    native = dispatch.resolve_backend() == "native"
    shapes = {(m.out_features, m.in_features) for _, m in layers}
    units = 0 if native else sum(2 * n * (k // qmm_group(k, None)) * 4 for n, k in shapes)
    want = n_weights // 4 + 2 * len(layers) + units
    assert built["fast"][1].linear_bytes == want
    if native:  # the native kernel runs compact in place
        assert built["compact"][1].linear_bytes == sum(
            C.linear_bytes(V.linear_shape(m), "compact") for _, m in layers
        )
    else:  # repacked to fast at load on the reference backend
        assert built["compact"][1].linear_bytes == want
    # The analytic bytes of the ceiling model agree with what was built (16-bit scales).
    for name in ("q2", "q4", "bf16", "f32"):
        assert (
            sum(C.linear_bytes(V.linear_shape(m), name) for _, m in layers)
            == built[name][1].linear_bytes
        ), name
    compact = sum(
        F.PackedTernary(
            "compact",
            F.pack_compact(np.array(m.trits())),
            np.zeros(m.scales.shape, np.float16),
            m.out_features,
            m.in_features,
        ).nbytes
        for _, m in layers
    )
    assert sum(C.linear_bytes(V.linear_shape(m), "compact") for _, m in layers) == compact
    # Tied embeddings: every format reads its whole table as the output layer.
    for name in ALL:
        assert built[name][1].read_bytes == built[name][1].weight_bytes


def test_q_formats_refuse_widths_mlx_cannot_group(tmp_path):
    path, _ = ternary_checkpoint(tmp_path, "llama", "compact", "row")  # intermediate 96
    base, config = load_model(path, packing="compact")
    built = B.build_variants(base, config, path, ["fast", "q2", "q4"])
    assert built["fast"][1].loads
    for name in ("q2", "q4"):
        model, res = built[name]
        assert model is None and not res.loads
        assert "down_proj" in res.reason and "96" in res.reason


def test_ceiling_arithmetic_by_hand():
    shape = C.LinearShape(256, 320, (1, 1), 2)
    assert C.linear_bytes(shape, "fast") == 256 * 320 // 4 + 2
    assert C.linear_bytes(shape, "compact") == 256 * 64 + 2  # 5 trits per byte
    assert C.linear_bytes(shape, "q4") == 256 * 160 + 2 * 256 * 5 * 2
    b = C.decode_bytes(1_000_000, 1000, 500, 100)
    assert b == 1_100_500
    assert C.ceiling_tps(b, 100) == pytest.approx(100e9 / 1_100_500)
    assert C.device_bandwidth("Apple M2 Pro")[0] == 200
    assert C.device_bandwidth("Apple M4 Max")[0] in (None, 410, 546)
    assert C.device_bandwidth("Intel(R) Xeon(R) Processor")[0] is None
    assert len(C.APPLE_CHIPS) == 17


def test_run_bench_end_to_end(tiny_dir):
    r = B.run_bench(
        str(tiny_dir), ("fast", "q4"), prompt_tokens=8, gen_tokens=3, repeats=2, bandwidth_gbs=10.0
    )
    assert [f.name for f in r.formats] == ["fast", "q4"]
    for f in r.formats:
        assert f.loads and len(f.runs) == 2
        assert all(x.prefill_tps > 0 and x.decode_tps > 0 for x in f.runs)
        assert all(x.peak_bytes >= f.weight_bytes for x in f.runs)
        # 2 layers x (K and V) x 2 KV heads x head_dim 32 x float32, or float16 where the
        # fused native block runs (ternary layers on the native backend: its 16-bit cache)
        from mlx_ternary.runtime import dispatch
        from mlx_ternary.runtime.cpu import block

        fused = f.name == "fast" and dispatch.resolve_backend() == "native"
        item = 2 if fused and block.kv_dtype() == "float16" else 4
        assert f.kv_bytes_per_token == 2 * 2 * 2 * 32 * item
        ctx = 8 + 3 / 2
        want = 10e9 / (f.read_bytes + f.kv_bytes_per_token * ctx)
        assert r.ceiling_tps(f) == pytest.approx(want)
    assert r.device["mlx"] == mx.__version__
    d = json.loads(json.dumps(r.to_dict()))
    assert d["formats"][0]["decode_tps"]["min"] <= d["formats"][0]["decode_tps"]["median"]
    # The Apple table: bandwidth / bytes, 16-bit floats, at prompt + gen tokens of context.
    base, _ = load_model(tiny_dir, packing="compact")
    shapes, floats = V.model_shapes(base)
    kv16 = 2 * 2 * 2 * 32
    m2 = next(row for row in r.apple if row["chip"] == "M2")
    want = C.ceiling_tps(C.metal_decode_bytes(shapes, "q4", floats, kv16, 0, 11), 100)
    assert m2["tps"]["q4"] == pytest.approx(want)
    assert m2["tps"]["fast"] > m2["tps"]["q4"]  # fewer bytes, higher ceiling


def test_cli_bench_table_json_and_plot(tiny_dir, tmp_path):
    out = tmp_path / "b.json"
    png = tmp_path / "b.png"
    res = CliRunner().invoke(
        main,
        [
            "bench",
            "--model",
            str(tiny_dir),
            "--formats",
            "fast,q2",
            "--prompt-tokens",
            "4",
            "--gen-tokens",
            "2",
            "--repeats",
            "1",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
    )
    assert "measured:" in res.output and "computed:" in res.output
    assert "M4 Pro" in res.output
    assert [f["name"] for f in json.loads(out.read_text())["formats"]] == ["fast", "q2"]
    if importlib.util.find_spec("matplotlib"):
        assert res.exit_code == 0, res.output
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert res.exit_code == 1
        assert "pip install 'mlx-ternary[bench]'" in res.output


def test_cli_bench_rejects_unknown_format(tiny_dir):
    res = CliRunner().invoke(main, ["bench", "--model", str(tiny_dir), "--formats", "q3"])
    assert res.exit_code == 1 and "unknown format(s) q3" in res.output


@pytest.mark.parametrize("stored", ["compact", "fast"])
def test_bench_holds_each_packing_as_load_does(tmp_path, stored):
    """bench's compact/fast rows run in the packing load() itself holds for that checkpoint
    (one rule, checkpoint.load.runtime_packing), on whatever backend this machine picks."""
    path, _ = ternary_checkpoint(tmp_path, "llama", stored, "row")
    model, _ = load_model(path)
    held = {m.packing for _, m in ternary_layers(model)}
    assert held == {V.held_packing(stored)}
    layer = ternary_layers(model)[0][1]
    assert V.make_layer(layer, stored).packing == V.held_packing(stored)
