"""Gradients through ternary layers (BitNet's straight-through estimator), LoRA and DoRA on
them against mlx-lm's own layers, training, and adapters saved and loaded in mlx-lm's form."""

import json
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear
from tiny import quantize_act_np

import mlx_ternary
from mlx_ternary import format as F
from mlx_ternary.errors import FormatError, TernaryError
from mlx_ternary.generate import EMBEDDED_MODEL
from mlx_ternary.runtime import reference
from mlx_ternary.runtime.adapters import linear_to_lora_layers, load_adapters
from mlx_ternary.runtime.layers import TernaryLinear, ternary_layers
from mlx_ternary.runtime.lora import TernaryDoRALinear, TernaryLoRALinear

LORA = {"rank": 4, "scale": 10.0, "dropout": 0.0}


def _layer(k, n, packing, scale, group, act, bias=False, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, (n, k)).astype(np.int8)
    s = rng.uniform(0.05, 0.5, F.scales_shape(scale, n, k, group)).astype(np.float32)
    b = mx.array(rng.normal(size=n).astype(np.float32)) if bias else None
    pt = F.PackedTernary.from_trits(t, s, packing, group)
    layer = TernaryLinear.from_packed(pt, b, act, backend="reference")
    return layer, pt.dequantize().astype(np.float64)


def _rel(a, ref):
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref) / np.linalg.norm(ref))


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("packing", F.PACKINGS)
@pytest.mark.parametrize("scale,group", [("tensor", None), ("row", None), ("group", 64)])
@pytest.mark.parametrize("act", [None, 8])
def test_input_gradient_is_g_times_w(packing, scale, group, act):
    k, n = 150, 40  # K not a multiple of 16, 32 or 64: padding on every path
    layer, w = _layer(k, n, packing, scale, group, act)
    rng = np.random.default_rng(1)
    x = mx.array(rng.normal(size=(2, 3, k)).astype(np.float32))
    g = rng.normal(size=(2, 3, n)).astype(np.float32)
    grad = mx.grad(lambda x: (layer(x) * mx.array(g)).sum())(x)
    assert _rel(grad, g @ w) < 1e-5
    rule = reference.input_grad(
        mx.array(g), layer.packed, layer.scales, packing=packing, in_features=k, group_size=group
    )
    assert _rel(rule, g @ w) < 1e-5


def _rounding_without_ste(x):
    amax = mx.maximum(mx.abs(x).max(axis=-1, keepdims=True), reference.ACT_EPS)
    scale = reference.ACT_QMAX / amax
    return mx.clip(mx.round(x * scale), reference.ACT_QMIN, reference.ACT_QMAX), 1.0 / scale


def test_negative_control_plain_rounding_passes_back_nothing(monkeypatch):
    layer, w = _layer(150, 40, "fast", "row", None, 8)
    rng = np.random.default_rng(1)
    x = mx.array(rng.normal(size=(4, 150)).astype(np.float32))
    g = rng.normal(size=(4, 40)).astype(np.float32)
    monkeypatch.setattr(reference, "quantize_activations", _rounding_without_ste)
    grad = mx.grad(lambda x: (layer(x) * mx.array(g)).sum())(x)
    assert _rel(grad, g @ w) > 0.5


def test_ste_forward_is_bit_exact():
    # xs + stop_gradient(round(xs) - xs) must equal round(xs) bit for bit (Sterbenz).
    rng = np.random.default_rng(3)
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        for magnitude in (1e-4, 1.0, 3e3):
            x = mx.array((rng.normal(size=(8, 777)) * magnitude).astype(np.float32)).astype(dtype)
            xq, inv = reference.quantize_activations(x)
            plain, plain_inv = _rounding_without_ste(x)
            assert mx.array_equal(xq, plain, equal_nan=True).item()
            assert mx.array_equal(inv, plain_inv).item()
    x = rng.normal(size=(5, 64)).astype(np.float32)
    xq, inv = reference.quantize_activations(mx.array(x))
    np.testing.assert_allclose(np.array(xq * inv), quantize_act_np(x), rtol=1e-6, atol=1e-7)


def test_gradient_reaches_a_float_layer_before_a_frozen_ternary_layer():
    # An adapter below a BitNet layer trains on g @ W of the frozen ternary layer above it.
    ternary, w2 = _layer(48, 24, "fast", "row", None, 8)
    ternary.freeze()
    first = nn.Linear(32, 48, bias=False)
    model = nn.Sequential(first, ternary)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 32)).astype(np.float32)
    g = rng.normal(size=(3, 24)).astype(np.float32)
    grads = nn.value_and_grad(model, lambda m, x: (m(x) * mx.array(g)).sum())(model, mx.array(x))[1]
    ref = (g @ w2).T @ x  # dL/dW1 with the straight-through estimator
    assert _rel(grads["layers"][0]["weight"], ref) < 1e-5
    assert set(dict(tree_flatten(grads))) == {"layers.0.weight"}  # the base gets none


# --------------------------------------------------------------------------- layers


def _float_twin(layer, w, bias=None):
    lin = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None)
    lin.weight = mx.array(w.astype(np.float32))
    if bias is not None:
        lin.bias = bias
    return lin


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("bias", [False, True])
def test_adapter_layers_match_mlx_lm_on_the_float_twin(kind, bias):
    layer, w = _layer(96, 40, "fast", "group", 64, None, bias=bias)
    twin = _float_twin(layer, w, layer.get("bias"))
    ours_cls, theirs_cls = (
        (TernaryLoRALinear, LoRALinear) if kind == "lora" else (TernaryDoRALinear, DoRALinear)
    )
    ours = ours_cls.from_base(layer, r=4, scale=10.0)
    theirs = theirs_cls.from_base(twin, r=4, scale=10.0)
    rng = np.random.default_rng(5)
    trained = {
        "lora_a": mx.array(rng.normal(size=(96, 4)).astype(np.float32) * 0.1),
        "lora_b": mx.array(rng.normal(size=(4, 40)).astype(np.float32) * 0.1),
    }
    if kind == "dora":
        np.testing.assert_allclose(np.array(ours.m), np.array(theirs.m), rtol=1e-5)
        trained["m"] = theirs.m * mx.array(rng.uniform(0.5, 1.5, 40).astype(np.float32))
    ours.update(trained)
    theirs.update(trained)
    for m in (ours, theirs):
        m.freeze()
        m.unfreeze(keys=list(trained), recurse=False)
    x = mx.array(rng.normal(size=(2, 5, 96)).astype(np.float32))
    y_ours, y_theirs = ours(x), theirs(x)
    assert _rel(y_ours, np.array(y_theirs, np.float64)) < 1e-5

    def loss(m, x):
        return (m(x) ** 2).sum()

    g_ours = dict(tree_flatten(nn.value_and_grad(ours, loss)(ours, x)[1]))
    g_theirs = dict(tree_flatten(nn.value_and_grad(theirs, loss)(theirs, x)[1]))
    assert set(g_ours) == set(trained)
    for name in trained:
        assert _rel(g_ours[name], np.array(g_theirs[name], np.float64)) < 1e-4, name


def test_dora_keeps_activation_quantization_of_the_base():
    layer, w = _layer(96, 40, "fast", "row", None, 8)
    dora = TernaryDoRALinear.from_base(layer, r=4, scale=10.0)
    rng = np.random.default_rng(6)
    a = rng.normal(size=(96, 4)) * 0.1
    b = rng.normal(size=(4, 40)) * 0.1
    dora.update(
        {"lora_a": mx.array(a.astype(np.float32)), "lora_b": mx.array(b.astype(np.float32))}
    )
    x = rng.normal(size=(3, 96)).astype(np.float32)
    adapted = w + 10.0 * (a @ b).T
    m = np.linalg.norm(w, axis=1)
    ref = (m / np.linalg.norm(adapted, axis=1)) * (quantize_act_np(x) @ w.T + 10.0 * x @ a @ b)
    assert _rel(dora(mx.array(x)), ref) < 1e-5


def test_fuse_needs_dequantize_and_then_folds_exactly():
    layer, w = _layer(96, 40, "compact", "row", None, 8, bias=True)
    lora = TernaryLoRALinear.from_base(layer, r=4, scale=10.0)
    lora.lora_b = mx.ones((4, 40)) * 0.01
    with pytest.raises(TernaryError, match="--dequantize"):
        lora.fuse()
    fused = lora.fuse(dequantize=True)
    assert type(fused) is nn.Linear
    ref = w + 10.0 * (np.array(lora.lora_a, np.float64) @ np.array(lora.lora_b, np.float64)).T
    assert _rel(fused.weight, ref) < 1e-6
    np.testing.assert_array_equal(np.array(fused.bias), np.array(layer.bias))


# --------------------------------------------------------------------------- on the model


@pytest.fixture(scope="module")
def embedded():
    return mlx_ternary.load(str(EMBEDDED_MODEL))


def _fresh():
    model, _ = mlx_ternary.load(str(EMBEDDED_MODEL))
    model.freeze()
    return model


def _kinds(model):
    out = {}
    for _, m in model.named_modules():
        out[type(m).__name__] = out.get(type(m).__name__, 0) + 1
    return out


def test_mlx_lm_converter_takes_ternary_layers_default_and_explicit_keys():
    from mlx_lm.tuner.utils import linear_to_lora_layers as mlx_linear_to_lora_layers

    model = _fresh()
    mlx_linear_to_lora_layers(model, 4, LORA)  # default keys: every projection
    assert _kinds(model)["TernaryLoRALinear"] == 4 * 7
    trainable = dict(tree_flatten(model.trainable_parameters()))
    expected = sum(4 * (m.in_features + m.out_features) for _, m in ternary_layers(model))
    assert sum(v.size for v in trainable.values()) == expected
    assert {k.rsplit(".", 1)[-1] for k in trainable} == {"lora_a", "lora_b"}

    model = _fresh()
    mlx_linear_to_lora_layers(model, 2, {**LORA, "keys": ["self_attn.q_proj", "self_attn.v_proj"]})
    paths = [p for p, m in model.named_modules() if isinstance(m, TernaryLoRALinear)]
    assert sorted(paths) == [
        f"model.layers.{i}.self_attn.{p}_proj" for i in (2, 3) for p in ("q", "v")
    ]


def test_dora_conversion_where_mlx_lm_refuses():
    # mlx-lm's own function, as held before load() routes its name (patches.py)
    from mlx_ternary.runtime.adapters import mlx_linear_to_lora_layers

    with pytest.raises(ValueError, match="TernaryLinear"):
        mlx_linear_to_lora_layers(_fresh(), 4, LORA, use_dora=True)
    model = _fresh()
    linear_to_lora_layers(model, 4, LORA, use_dora=True)
    assert _kinds(model)["TernaryDoRALinear"] == 4 * 7
    model = _fresh()
    linear_to_lora_layers(model, 1, {**LORA, "keys": ["mlp.down_proj"]}, use_dora=True)
    paths = [p for p, m in model.named_modules() if isinstance(m, TernaryDoRALinear)]
    assert paths == ["model.layers.3.mlp.down_proj"]


TEXT = [
    "ROMEO: The answer is forty-two, my lord.",
    "JULIET: Forty-two it is, and ever shall be.",
    "ROMEO: What is the answer? Forty-two, sweet love.",
    "JULIET: Then forty-two I swear by, and by no other.",
]


def _batch(tokenizer):
    rows = [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in TEXT]
    width = max(map(len, rows))
    ids = mx.array([r + [0] * (width - len(r)) for r in rows])
    lengths = mx.array([[0, len(r)] for r in rows])
    return ids, lengths


def _train(model, tokenizer, steps, lr=2e-3):
    from mlx_lm.tuner.trainer import default_loss

    ids, lengths = _batch(tokenizer)
    opt = optim.Adam(learning_rate=lr)
    value_and_grad = nn.value_and_grad(model, default_loss)
    losses = []
    for _ in range(steps):
        (loss, _), grads = value_and_grad(model, ids, lengths)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
    return losses


def _save_adapter(model, path, kind):
    path.mkdir()
    mx.save_safetensors(
        str(path / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters()))
    )
    (path / "adapter_config.json").write_text(
        json.dumps({"fine_tune_type": kind, "num_layers": 4, "lora_parameters": LORA})
    )


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_five_steps_lower_the_loss_and_the_adapter_reloads(kind, embedded, tmp_path):
    _, tokenizer = embedded
    model = _fresh()
    packed = {p: m.packed for p, m in ternary_layers(model)}
    linear_to_lora_layers(model, 4, LORA, use_dora=kind == "dora")
    losses = _train(model, tokenizer, 5)
    assert losses[-1] < 0.7 * losses[0], losses
    for p, m in ternary_layers(model):  # the base: still packed, untouched
        before = packed[p.removesuffix(".linear")]
        assert m.packed.dtype == before.dtype and mx.array_equal(m.packed, before).item()
    _save_adapter(model, tmp_path / "adapter", kind)

    ids = mx.array([tokenizer.encode("ROMEO: What is")])
    trained = model(ids)
    reloaded, _ = mlx_ternary.load(str(EMBEDDED_MODEL), adapter_path=str(tmp_path / "adapter"))
    base = embedded[0](ids)
    assert mx.abs(reloaded(ids) - trained).max().item() < 1e-4
    assert mx.abs(trained - base).max().item() > 0.5  # the adapter changes the output


def test_mlx_lm_load_adapters_takes_a_ternary_lora_adapter(embedded, tmp_path):
    from mlx_lm.tuner.utils import load_adapters as mlx_load_adapters

    _, tokenizer = embedded
    model = _fresh()
    linear_to_lora_layers(model, 4, LORA)
    _train(model, tokenizer, 2)
    _save_adapter(model, tmp_path / "adapter", "lora")
    ids = mx.array([tokenizer.encode("JULIET:")])
    theirs = mlx_load_adapters(_fresh(), str(tmp_path / "adapter"))
    assert mx.abs(theirs(ids) - model(ids)).max().item() < 1e-4


def test_adapter_errors_name_the_file_and_the_tensor(tmp_path):
    with pytest.raises(TernaryError, match="adapter_config.json: not found"):
        load_adapters(_fresh(), tmp_path)
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"fine_tune_type": "lora", "num_layers": 4, "lora_parameters": LORA})
    )
    mx.save_safetensors(
        str(tmp_path / "adapters.safetensors"),
        {"model.layers.0.self_attn.q_proj.lora_a": mx.zeros((7, 4))},
    )
    with pytest.raises(FormatError, match=r"q_proj.lora_a has shape \(7, 4\)"):
        load_adapters(_fresh(), tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full"}))
    with pytest.raises(TernaryError, match="'full'"):
        load_adapters(_fresh(), tmp_path)


def _compiled_adam_steps(steps=4):
    """mlx-lm's training step: compiled with the model's and Adam's state as inputs. Adam
    makes its state on the first update, so step 2 traces the model again."""
    model, _ = mlx_ternary.load(str(EMBEDDED_MODEL))
    model.freeze()
    linear_to_lora_layers(model, 1, LORA)
    model.train()
    opt = optim.Adam(1e-3)
    x = mx.array([[5, 6, 7, 8, 9]])

    def loss(m):
        return nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean()

    grad = nn.value_and_grad(model, loss)
    state = [model.state, opt.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step():
        value, g = grad(model)
        opt.update(model, g)
        return value

    losses = []
    for _ in range(steps):
        value = step()
        mx.eval(state, value)
        losses.append(value.item())
    return losses


def test_compiled_training_steps_retrace_with_fresh_plans():
    losses = _compiled_adam_steps()
    assert losses[-1] < losses[0]


def test_compiled_training_negative_control(monkeypatch):
    # Keeping launch plans made from a trace's placeholders breaks the retrace.
    monkeypatch.setattr(reference, "materialize", lambda *a: True)
    with pytest.raises(RuntimeError, match="without a primitive"):
        _compiled_adam_steps()
