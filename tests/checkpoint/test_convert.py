"""convert / verify: every reader into the ternary format and stock MLX, with integrity checks.

Each source checkpoint is built here, from seeded numbers; expected weights are computed
independently in numpy, and stock outputs are loaded by plain mlx-lm in a subprocess
that never imports mlx_ternary.
"""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from tiny import CONFIGS, FIXTURES, float_model, ternary_checkpoint, write_tokenizer

import mlx_ternary
from mlx_ternary.checkpoint.convert import convert, convert_source
from mlx_ternary.checkpoint.verify import verify
from mlx_ternary.cli import main
from mlx_ternary.errors import FormatError, TernaryError
from mlx_ternary.runtime.layers import ternary_layers

TOKENS = mx.array([[3, 17, 42, 5, 99, 64, 1, 20]])
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def logits(model) -> np.ndarray:
    return np.array(model(TOKENS).astype(mx.float32))


def leftovers(parent: Path, name: str):
    """Anything convert left for destination `name` (the dir itself or a partial)."""
    return [p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}")]


def hf_weights(model) -> dict:
    from mlx.utils import tree_flatten

    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def save(out: Path, weights: dict, config: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out / "model.safetensors"),
        {k: v if isinstance(v, mx.array) else mx.array(v) for k, v in weights.items()},
    )
    (out / "config.json").write_text(json.dumps(config))
    write_tokenizer(out)
    return out


def layer_paths(n_layers=2):
    return [f"model.layers.{i}.{m}" for i in range(n_layers) for m in LINEARS]


# --------------------------------------------------------------------------- #
# Source builders
# --------------------------------------------------------------------------- #


def hf_bitnet_checkpoint(tmp: Path, linear_class: str, latent: bool = False):
    """A llama HF BitNet checkpoint; returns (dir, {path: expected float weight})."""
    model, config = float_model("llama", seed=1)
    w = hf_weights(model)
    expected = {}
    for path in layer_paths():
        f = w[f"{path}.weight"]
        s = np.float32(np.abs(f).mean())
        t = np.clip(np.rint(f / s), -1, 1).astype(np.int8)
        expected[path] = t * s
        if latent:
            continue
        n, k = t.shape
        rows = -(-n // 4)
        padded = np.zeros((4 * rows, k), np.uint8)
        padded[:n] = t + 1
        packed = np.zeros((rows, k), np.uint8)
        for i in range(4):  # field i of packed row r holds output row r + i * rows
            packed |= padded[i * rows : (i + 1) * rows] << (2 * i)
        w[f"{path}.weight"] = packed
        ws = 1 / s if linear_class == "bitlinear" else s
        w[f"{path}.weight_scale"] = np.array([ws], np.float32)
    qc = {
        "quant_method": "bitnet",
        "linear_class": linear_class,
        "quantization_mode": "online" if latent else "offline",
    }
    name = f"hf-{linear_class}-{'latent' if latent else 'packed'}"
    return save(tmp / name, w, {**config, "quantization_config": qc}), expected


def trilm_checkpoint(tmp: Path, along_columns: bool = False, dtype=np.float32):
    """Float weights already t * s with blocks of scales; returns (dir, {path: weight})."""
    model, config = float_model("llama", seed=2)
    w = hf_weights(model)
    rng = np.random.default_rng(2)
    expected = {}
    for path in layer_paths():
        n, k = w[f"{path}.weight"].shape
        t = rng.integers(-1, 2, (n, k)).astype(np.float32)
        if along_columns:  # blocks of 64 input columns (K = 96: a partial last block)
            s = np.repeat(rng.uniform(0.01, 0.1, (n, -(-k // 64))), 64, axis=1)[:, :k]
        else:
            blocks = rng.uniform(0.01, 0.1, 2)  # two row blocks, as model-parallel shards
            s = np.repeat(blocks, [n // 2, n - n // 2])[:, None]
        wt = (t * s).astype(dtype)
        w[f"{path}.weight"] = wt
        expected[path] = wt.astype(np.float32)
    return save(tmp / f"trilm-{'cols' if along_columns else 'rows'}", w, config), expected


def affine_pack(tmp: Path, group_size=64, hidden=128, hadamard=False):
    """A stock MLX 2-bit affine llama pack whose weights are exactly ternary."""
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    config = dict(
        CONFIGS["llama"],
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        bos_token_id=0,
        eos_token_id=1,
    )
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    nn.quantize(
        model,
        group_size=group_size,
        bits=2,
        class_predicate=lambda p, m: isinstance(m, nn.Linear) and "lm_head" not in p,
    )
    rng = np.random.default_rng(3)
    w, expected = {}, {}
    from mlx.utils import tree_flatten

    from mlx_ternary.checkpoint.writers.mlx_affine import pack_codes

    for name, v in tree_flatten(model.parameters()):
        path, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases"):
            continue
        if f"{path}.scales" in dict(tree_flatten(model.parameters())):
            n = v.shape[0]
            k = v.shape[1] * 16
            t = rng.integers(-1, 2, (n, k))
            s = rng.uniform(0.01, 0.1, (n, k // group_size)).astype(np.float16)
            w[name] = pack_codes((t + 1).astype(np.uint8), 2)
            w[f"{path}.scales"] = s
            w[f"{path}.biases"] = -s
            expected[path] = t * np.repeat(s.astype(np.float32), group_size, axis=1)
        else:
            w[name] = (
                rng.normal(0, 0.5, v.shape).astype(np.float32)
                if v.ndim > 1
                else np.ones(v.shape, np.float32)
            )
    config["quantization"] = {"group_size": group_size, "bits": 2}
    return save(tmp / f"affine-g{group_size}", w, config), expected


def check_weights(model, expected: dict, tol=0.0):
    layers = dict(ternary_layers(model))
    assert set(expected) <= set(layers)
    for path, want in expected.items():
        got = np.array(layers[path].dequantize())
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=path)


# --------------------------------------------------------------------------- #
# Readers -> native
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("linear_class", ["bitlinear", "autobitlinear"])
def test_hf_bitnet_packed(tmp_path, linear_class):
    src, expected = hf_bitnet_checkpoint(tmp_path, linear_class)
    report = convert(str(src), tmp_path / "out", packing="compact")
    assert report.max_error == 0.0 and "packed" in report.source_kind
    model, _, config = mlx_ternary.load(str(tmp_path / "out"), return_config=True)
    check_weights(model, expected, tol=1e-6)
    assert config["quantization"]["activation_bits"] == 8
    np.testing.assert_allclose(logits(model), logits(mlx_ternary.load(str(src))[0]), atol=1e-4)


def test_hf_bitnet_latent(tmp_path):
    src, expected = hf_bitnet_checkpoint(tmp_path, "autobitlinear", latent=True)
    report = convert(str(src), tmp_path / "out")
    assert "latent" in report.source_kind
    check_weights(mlx_ternary.load(str(tmp_path / "out"))[0], expected, tol=1e-6)


@pytest.mark.parametrize("along_columns", [False, True])
def test_trilm_scale_blocks_exact(tmp_path, along_columns):
    src, expected = trilm_checkpoint(tmp_path, along_columns, dtype=np.float16)
    report = convert(str(src), tmp_path / "out", packing="fast", group_size=64)
    assert report.max_error == 0.0
    notes = {t.name: t.note for t in report.tensors}
    if along_columns:
        assert notes["model.layers.0.mlp.down_proj"].endswith("scales in groups of 64 columns")
    else:
        assert notes["model.layers.0.self_attn.q_proj"] == "2 scales in 2 row block(s)"
    check_weights(mlx_ternary.load(str(tmp_path / "out"))[0], expected)


def test_trilm_refuses_non_ternary_tensor(tmp_path):
    src, _ = trilm_checkpoint(tmp_path)
    from safetensors.numpy import load_file, save_file

    w = load_file(str(src / "model.safetensors"))
    w["model.layers.1.mlp.up_proj.weight"][0, :3] = [0.5, 0.25, -0.125]
    save_file(w, str(src / "model.safetensors"))
    with pytest.raises(
        FormatError,
        match=r"model\.layers\.1\.mlp\.up_proj\.weight: not "
        "ternary-valued: row 0",
    ):
        convert(str(src), tmp_path / "out")
    assert leftovers(tmp_path, "out") == []


def test_affine_pack_lossless(tmp_path):
    import mlx_lm

    src, expected = affine_pack(tmp_path, group_size=128, hidden=512)
    ref = logits(mlx_lm.load(str(src))[0])
    bpw = {}
    for packing in ("compact", "fast"):
        report = convert(str(src), tmp_path / packing, packing=packing)
        assert report.max_error == 0.0
        bpw[packing] = report.bits_per_weight
        model = mlx_ternary.load(str(tmp_path / packing))[0]
        check_weights(model, expected)
        np.testing.assert_allclose(logits(model), ref, atol=2e-3, rtol=1e-3)
    assert bpw["compact"] <= 1.75 and bpw["fast"] <= 2.13, bpw
    # load() reads the pack in place too
    check_weights(mlx_ternary.load(str(src))[0], expected)


def test_native_repack_multi_shard(tmp_path):
    src, twin = ternary_checkpoint(tmp_path, "qwen3", "compact", "group", group_size=64)
    report = convert(str(src), tmp_path / "out", packing="fast", max_shard_bytes=8_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((tmp_path / "out" / s).exists() for s in shards)
    assert report.max_error == 0.0
    model, _, config = mlx_ternary.load(str(tmp_path / "out"), return_config=True)
    assert config["quantization"]["group_size"] == 64
    np.testing.assert_allclose(logits(model), logits(twin), atol=1e-4)
    assert verify(tmp_path / "out").ok


# --------------------------------------------------------------------------- #
# Stock MLX outputs, loaded by plain mlx-lm without mlx_ternary
# --------------------------------------------------------------------------- #

PLAIN_MLX_LM = """
import sys, json, numpy as np, mlx.core as mx, mlx_lm
out = {}
for d in sys.argv[2:]:
    model, tok = mlx_lm.load(d)
    out[d] = np.array(model(mx.array(json.loads(sys.argv[1]))).astype(mx.float32)).tolist()
assert "mlx_ternary" not in sys.modules
print(json.dumps(out))
"""


def test_stock_mlx_outputs_load_in_plain_mlx_lm(tmp_path):
    src, _ = hf_bitnet_checkpoint(tmp_path, "autobitlinear")
    outs = {}
    for bits in (4, 2):
        outs[bits] = tmp_path / f"q{bits}"
        report = convert(str(src), outs[bits], q_bits=bits, q_group_size=32)
        assert report.max_error == 0.0 and any("activation" in n for n in report.notes)
        assert "activation quantization" in (outs[bits] / "README.md").read_text()
    outs["d"] = tmp_path / "deq"
    convert(str(src), outs["d"], dequantize=True)
    proc = subprocess.run(
        [sys.executable, "-c", PLAIN_MLX_LM, json.dumps(TOKENS.tolist()), *map(str, outs.values())],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    got = {k: np.array(v) for k, v in json.loads(proc.stdout).items()}
    # the reference: the native model with activation quantization switched off
    native = mlx_ternary.load(str(src))[0]
    for _, layer in ternary_layers(native):
        layer.activation_bits = None
    want = logits(native)
    for d in outs.values():
        np.testing.assert_allclose(got[str(d)], want, atol=1e-4, rtol=1e-4, err_msg=str(d))
    # negative control: with int8 activations on, the native model differs
    assert np.abs(logits(mlx_ternary.load(str(src))[0]) - want).max() > 1e-3


def test_mx_quantize_is_lossy_on_ternary():
    """Why the affine writer builds codes itself."""
    from mlx_ternary.checkpoint.writers.mlx_affine import affine_tensors
    from mlx_ternary.format import PackedTernary

    t = np.random.default_rng(0).integers(-1, 2, (8, 64)).astype(np.int8)
    pt = PackedTernary.from_trits(t, np.full((8, 1), 0.5, np.float32), "fast")
    w = mx.array(pt.dequantize())
    lossy = mx.dequantize(*mx.quantize(w, group_size=32, bits=2), group_size=32, bits=2)
    assert np.abs(np.array(lossy) - np.array(w)).max() > 0.1
    ours = affine_tensors("x", pt, 2, 32)
    exact = mx.dequantize(*(a for _, a in ours), group_size=32, bits=2)
    assert np.array_equal(np.array(exact), np.array(w))


# --------------------------------------------------------------------------- #
# Integrity: corrupt inputs, partial outputs, manifest, verify
# --------------------------------------------------------------------------- #


@pytest.fixture
def native_src(tmp_path):
    return ternary_checkpoint(tmp_path, "llama", "compact", "row")[0]


def _truncate(src):
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _missing_shard(src):
    idx = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))


def _wrong_shape(src):
    c = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**c, "intermediate_size": 128}))


def _unknown_version(src):
    c = json.loads((src / "config.json").read_text())
    c["quantization"]["format_version"] = 99
    (src / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_truncate, "truncated safetensors"),
        (_missing_shard, r"model-00002\.safetensors listed in .* missing"),
        (_wrong_shape, r"mlp\.(gate|up|down)_proj.* the config implies"),
        (_unknown_version, "format_version 99 is not one"),
    ],
)
def test_corrupt_inputs_leave_nothing(tmp_path, native_src, corrupt, message):
    corrupt(native_src)
    with pytest.raises(TernaryError, match=message):
        convert(str(native_src), tmp_path / "out")
    assert leftovers(tmp_path, "out") == []


def test_interrupt_leaves_nothing_and_force(tmp_path, native_src):
    def interrupt(name, done, total):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(str(native_src), tmp_path / "out", progress=interrupt)
    assert leftovers(tmp_path, "out") == []
    convert(str(native_src), tmp_path / "out")
    with pytest.raises(TernaryError, match="already exists; pass --force"):
        convert(str(native_src), tmp_path / "out")
    convert(str(native_src), tmp_path / "out", packing="fast", force=True)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization"]["packing"] == "fast"
    assert sorted(leftovers(tmp_path, "out")) == ["out"]


def test_manifest_and_verify(tmp_path, native_src):
    out = tmp_path / "out"
    convert(str(native_src), out)
    manifest = json.loads((out / "manifest.json").read_text())
    import hashlib

    for name, meta in manifest["files"].items():
        data = (out / name).read_bytes()
        assert meta == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert {
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    } <= set(manifest["files"])
    runner = CliRunner()
    ok = runner.invoke(main, ["verify", str(out)])
    assert ok.exit_code == 0 and ok.output.startswith("OK"), ok.output
    shard = out / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    report = verify(out)
    assert not report.ok and "sha256 differs" in report.problems[0]
    shard.unlink()
    bad = runner.invoke(main, ["verify", str(out)])
    assert (
        bad.exit_code == 1
        and "model.safetensors: listed in manifest.json but missing" in bad.output
    )


def test_cli_convert(tmp_path, native_src):
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "convert",
            "--hf-path",
            str(native_src),
            "--output-dir",
            str(tmp_path / "o"),
            "--packing",
            "fast",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "max error 0" in res.output and "bits per weight" in res.output
    res = runner.invoke(
        main, ["convert", "--hf-path", str(native_src), "--mlx-path", str(tmp_path / "o")]
    )
    assert res.exit_code == 1 and "already exists" in res.output
    res = runner.invoke(
        main, ["convert", "--hf-path", str(tmp_path / "nope"), "--mlx-path", str(tmp_path / "p")]
    )
    assert res.exit_code == 1 and "no such model directory" in res.output


FIXTURES = FIXTURES / "hf"


@pytest.mark.parametrize(
    "name", sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) if FIXTURES.is_dir() else []
)
def test_transformers_fixtures_convert(tmp_path, name):
    """transformers-made HF BitNet checkpoints: converting keeps load()'s logits exactly."""
    from mlx_ternary.checkpoint.load import load_model

    report = convert(str(FIXTURES / name), tmp_path / "out")
    assert report.max_error == 0.0
    want = logits(load_model(FIXTURES / name)[0])
    np.testing.assert_array_equal(logits(load_model(tmp_path / "out")[0]), want)


@pytest.mark.parametrize("kind", ["dir", "file", "dangling link"])
def test_one_destination_check_refuses_and_leaves_the_old_output_intact(tmp_path, native_src, kind):
    """Without force an existing output (a dangling symlink too) is refused before any read,
    for both convert() and convert_source(); the old output is left byte for byte."""
    from mlx_ternary.checkpoint.convert import open_input

    out = tmp_path / "out"
    if kind == "dir":
        out.mkdir()
        (out / "keep.txt").write_text("old")
    elif kind == "file":
        out.write_text("old")
    else:
        out.symlink_to(tmp_path / "nowhere")
    for run in (
        lambda: convert(str(tmp_path / "no-such-source"), out),  # refused before opening
        lambda: convert_source(open_input(str(native_src)), out),
    ):
        with pytest.raises(TernaryError, match="already exists; pass --force"):
            run()
    if kind == "dir":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
        assert (out / "keep.txt").read_text() == "old"
    elif kind == "file":
        assert out.read_text() == "old"
    else:
        assert out.is_symlink() and not out.exists()
    assert leftovers(tmp_path, "out") == ["out"]
    convert(str(native_src), out, force=True)  # the control: force replaces it
    assert (out / "config.json").is_file() and not (out / "keep.txt").exists()
