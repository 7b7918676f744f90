"""TernaryLinear and load(): exact against float references, and at home inside mlx-lm."""

import copy
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny import float_model, quantize_act_np, ternary_checkpoint

import mlx_ternary
from mlx_ternary import format as F
from mlx_ternary.errors import FormatError, TernaryError
from mlx_ternary.runtime import dispatch
from mlx_ternary.runtime.layers import TernaryLinear, ternary_layers

# Float32 throughout: a ternary layer and the float reference differ only in summation
# order, so relative errors stay near 1e-6; the bound below leaves room for K up to ~300.
RTOL = 2e-5


def _layer(k, n, packing, scale, group, bias, act, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, (n, k)).astype(np.int8)
    s = rng.uniform(0.01, 0.1, F.scales_shape(scale, n, k, group)).astype(np.float32)
    b = mx.array(rng.normal(size=n).astype(np.float32)) if bias else None
    pt = F.PackedTernary.from_trits(t, s, packing, group)
    return TernaryLinear.from_packed(pt, b, act), pt.dequantize(), b


@pytest.mark.parametrize("packing", F.PACKINGS)
@pytest.mark.parametrize(
    "scale,group", [("tensor", None), ("row", None), ("group", 64), ("group", 128), ("group", 256)]
)
@pytest.mark.parametrize("k", [7, 33, 130, 300])
@pytest.mark.parametrize("act", [None, 8])
def test_ternary_linear_matches_numpy(packing, scale, group, k, act):
    layer, w, b = _layer(k, 11, packing, scale, group, bias=(k % 2 == 1), act=act)
    x = np.random.default_rng(1).normal(size=(2, 3, k)).astype(np.float32)
    y = np.array(layer(mx.array(x)))
    xr = quantize_act_np(x) if act else x.astype(np.float64)
    ref = xr @ w.astype(np.float64).T + (np.array(b) if b is not None else 0)
    np.testing.assert_allclose(y, ref, rtol=RTOL, atol=RTOL * np.abs(ref).max())


def test_negative_controls_scale_and_activation_quant_matter():
    layer, w, _ = _layer(130, 9, "fast", "row", None, False, 8)
    x = mx.array(np.random.default_rng(2).normal(size=(4, 130)).astype(np.float32))
    ref = quantize_act_np(np.array(x)) @ w.T
    good = np.array(layer(x))
    np.testing.assert_allclose(good, ref, rtol=RTOL, atol=1e-5)
    layer.activation_bits = None  # activation quantization off: must differ
    assert np.abs(np.array(layer(x)) - ref).max() > 1e-3
    layer.activation_bits = 8
    layer.scales = mx.ones_like(layer.scales)  # scale off: must differ
    assert np.abs(np.array(layer(x)) - ref).max() > 1e-2


def test_reference_compact_and_fast_agree_and_repack_is_exact():
    layer, w, _ = _layer(257, 13, "compact", "group", 128, True, None)
    x = mx.array(np.random.default_rng(3).normal(size=(5, 257)).astype(np.float32))
    y_compact = np.array(layer(x))
    layer.repack("fast")
    assert layer.packed.dtype == mx.uint32
    np.testing.assert_allclose(np.array(layer(x)), y_compact, rtol=RTOL, atol=1e-5)
    np.testing.assert_array_equal(np.array(layer.dequantize()), w)


ARCHS = ["llama", "qwen3", "bitnet"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("packing,scale", [("compact", "tensor"), ("fast", "row")])
def test_model_logits_equal_float_twin(tmp_path, arch, packing, scale):
    path, twin = ternary_checkpoint(tmp_path, arch, packing, scale)
    model, tok = mlx_ternary.load(path)
    assert type(model).__module__ == f"mlx_lm.models.{arch}"
    assert len(ternary_layers(model)) == 14  # 7 projections x 2 layers
    ids = mx.array([[0, 5, 9, 20, 33, 7, 90, 14]])
    got, want = np.array(model(ids)), np.array(twin(ids))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_model_with_activation_quant_matches_quantized_twin(tmp_path):
    path, twin = ternary_checkpoint(tmp_path, "llama", "compact", "row", activation_bits=8)
    model, _ = mlx_ternary.load(path)

    class ActQuant(nn.Module):  # the float twin with BitNet's input quantization, in numpy
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def __call__(self, x):
            return self.lin(mx.array(quantize_act_np(np.array(x)).astype(np.float32)))

    from mlx_ternary.runtime.layers import swap_modules

    swap_modules(
        twin, lambda p, m: ActQuant(m) if isinstance(m, nn.Linear) and p != "lm_head" else None
    )
    ids = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    want = np.array(twin(ids))
    np.testing.assert_allclose(
        np.array(model(ids)), want, rtol=1e-4, atol=1e-4 * np.abs(want).max()
    )


def test_runtime_packing_on_cpu_is_fast_and_compact_on_request(tmp_path):
    path, _ = ternary_checkpoint(tmp_path, "llama", "compact", "row")
    auto, _ = mlx_ternary.load(path)
    kept, _ = mlx_ternary.load(path, packing="compact")
    # the reference twin reads the fast layout in place; the native kernel runs either
    runtime = "compact" if dispatch.resolve_backend() == "native" else "fast"
    assert {m.packing for _, m in ternary_layers(auto)} == {runtime}
    assert {m.packing for _, m in ternary_layers(kept)} == {"compact"}
    ids = mx.array([[1, 2, 3, 4]])
    np.testing.assert_allclose(np.array(auto(ids)), np.array(kept(ids)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_lm_model_routine(tmp_path, arch, monkeypatch):
    """mlx-lm's own model test: logits shape, cache path, one-token decode, batch 2, deepcopy
    (the cache in float32, so cached logits equal uncached ones to 1e-4; the fused CPU
    block's default float16 cache is tests/runtime/test_block.py's)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_ternary.runtime.cpu import block

    monkeypatch.setenv(block.ENV_KV, "float32")

    model, _ = mlx_ternary.load(ternary_checkpoint(tmp_path, arch, "fast", "row")[0])
    vocab = model.args.vocab_size
    ids = mx.array([[0, 1, 2, 3, 4, 5]])
    full = model(ids)
    assert full.shape == (1, 6, vocab) and full.dtype == mx.float32
    cache = make_prompt_cache(model)
    prefix = model(ids[:, :5], cache=cache)
    step = model(ids[:, 5:], cache=cache)
    np.testing.assert_allclose(np.array(prefix), np.array(full[:, :5]), atol=1e-4)
    np.testing.assert_allclose(np.array(step[:, 0]), np.array(full[:, 5]), atol=1e-4)
    batch = model(mx.concatenate([ids, ids[:, ::-1]], axis=0))
    assert batch.shape == (2, 6, vocab)
    np.testing.assert_allclose(np.array(batch[0]), np.array(full[0]), atol=1e-4)
    clone = copy.deepcopy(model)
    np.testing.assert_array_equal(np.array(clone(ids)), np.array(full))


def test_mlx_lm_generate_stream_and_batch(tmp_path):
    from mlx_lm import batch_generate, generate, stream_generate

    model, tok = mlx_ternary.load(ternary_checkpoint(tmp_path, "qwen3", "compact", "row")[0])
    a = generate(model, tok, "the fox", max_tokens=12)
    b = generate(model, tok, "the fox", max_tokens=12)
    assert a == b and len(a) > 0  # greedy is deterministic
    streamed = "".join(r.text for r in stream_generate(model, tok, "the fox", max_tokens=12))
    assert streamed == a
    prompts = [tok.encode("the fox"), tok.encode("a dog ran")]
    out = batch_generate(model, tok, prompts, max_tokens=12)
    assert out.texts[0] == a


def test_greedy_tokens_match_manual_argmax(tmp_path):
    from mlx_lm import stream_generate

    model, tok = mlx_ternary.load(ternary_checkpoint(tmp_path, "llama", "fast", "row")[0])
    prompt = tok.encode("abc")
    got = [r.token for r in stream_generate(model, tok, prompt, max_tokens=6)]
    ids = list(prompt)
    for _ in range(6):  # no cache: the whole sequence each time
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1])))
    assert got == ids[len(prompt) :]


# --------------------------------------------------------------------------- errors


def test_missing_directory(tmp_path):
    with pytest.raises(TernaryError, match="no such model directory"):
        mlx_ternary.load(str(tmp_path / "nope"))


def test_missing_config(tmp_path):
    with pytest.raises(TernaryError, match="no config.json"):
        mlx_ternary.load(str(tmp_path))


def _checkpoint(tmp_path):
    return ternary_checkpoint(tmp_path, "llama", "compact", "row")[0]


def _edit_config(path, **kv):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in kv.items():
        if isinstance(v, dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_model_type(tmp_path):
    path = _checkpoint(tmp_path)
    _edit_config(path, model_type="nonexistent_arch")
    with pytest.raises(TernaryError, match="model_type 'nonexistent_arch' is not"):
        mlx_ternary.load(path)


def test_unknown_format_version(tmp_path):
    path = _checkpoint(tmp_path)
    _edit_config(path, quantization={"format_version": 7})
    with pytest.raises(FormatError, match=r"config.json.*format_version 7.*known: 1"):
        mlx_ternary.load(path)


def test_wrong_shape_in_config(tmp_path):
    path = _checkpoint(tmp_path)
    _edit_config(path, intermediate_size=128)
    with pytest.raises(FormatError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.\w+ has shape"):
        mlx_ternary.load(path)


def test_truncated_safetensors(tmp_path):
    path = _checkpoint(tmp_path)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(FormatError, match=r"model\.safetensors: truncated"):
        mlx_ternary.load(path)


def test_missing_shard(tmp_path):
    path = _checkpoint(tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="model-00002-of-00002.safetensors.*missing"):
        mlx_ternary.load(path)


def test_float_model_without_ternary_weights_is_refused(tmp_path):
    path = _checkpoint(tmp_path)
    _edit_config(path, quantization=None)  # packed tensors, but no native section
    with pytest.raises(
        TernaryError,
        match=r"tensor model\.layers\.0\.\w+\.\w+_proj\.packed "
        "is not a parameter of the model",
    ):
        mlx_ternary.load(path)
    float_dir = tmp_path / "float"  # a plain float model: its first linear weight is named
    model, config = float_model("llama")
    float_dir.mkdir()
    mx.save_safetensors(
        str(float_dir / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    (float_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        TernaryError,
        match=r"model\.layers\.0\.\w+\.\w+_proj\.weight: not "
        "ternary-valued.*never re-quantizes",
    ):
        mlx_ternary.load(float_dir)


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"weights")
    with pytest.raises(TernaryError, match="is a file, not a model directory"):
        mlx_ternary.load(str(f))
    f = tmp_path / "model.gguf"  # a GGUF file is read (converted into the cache) ...
    f.write_bytes(b"GGUF")
    with pytest.raises(TernaryError, match="model.gguf: not a readable GGUF file"):
        mlx_ternary.load(str(f))  # ... and a broken one says so


def test_hub_repo_offline_gives_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(TernaryError, match="some-org/some-model"):
        mlx_ternary.load("some-org/some-model")


def test_backend_env_is_validated(monkeypatch):
    from mlx_ternary.runtime.dispatch import resolve_backend

    monkeypatch.setenv("MLX_TERNARY_BACKEND", "cuda-magic")
    with pytest.raises(TernaryError, match="unknown ternary backend 'cuda-magic'"):
        resolve_backend()
    monkeypatch.setenv("MLX_TERNARY_BACKEND", "reference")
    assert resolve_backend() == "reference"
    if not mx.metal.is_available():
        with pytest.raises(TernaryError, match="Metal is not available"):
            resolve_backend("metal")
