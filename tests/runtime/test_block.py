"""The fused native decoder block (runtime/cpu/block.py, csrc/ops/block.h) against mlx-lm's own
block on the same model: logits over a prefill and 8 greedy decode steps, the cache, the
tokens; a negative control; and the cases that must keep mlx-lm's path."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_ternary.runtime import cpu
from mlx_ternary.runtime.cpu import block

pytestmark = pytest.mark.native

PROMPT = [[1, 5, 9, 33, 70, 2, 4, 8, 11, 3]]
CASES = {  # activations, packing, scale, group, config overrides
    "int8-fast-row": (8, "fast", "row", None, {}),
    "q8k-fast-group256": (
        "q8k",
        "fast",
        "group",
        256,
        dict(hidden_size=256, intermediate_size=512, num_attention_heads=4),
    ),
    "float-compact-tensor": (None, "compact", "tensor", None, {}),
    "traditional-rope": (8, "fast", "row", None, dict(rope_traditional=True)),
    "llama3-rope": (
        8,
        "fast",
        "row",
        None,
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
            max_position_embeddings=128,
        ),
    ),
    "linear-rope-bias": (
        8,
        "fast",
        "row",
        None,
        dict(rope_scaling=dict(type="linear", factor=2.0), attention_bias=True, mlp_bias=True),
    ),
    "qwen2": (8, "fast", "row", None, dict(model_type="qwen2")),  # q/k/v biases
    "qwen3": (8, "fast", "row", None, dict(arch="qwen3")),  # q_norm / k_norm of each head
    "qwen3-q8k": (
        "q8k",
        "fast",
        "group",
        256,
        dict(arch="qwen3", hidden_size=256, intermediate_size=512, head_dim=64),
    ),
    # BitNet's block: sub-norms before o_proj and down_proj, relu2
    "bitnet": (8, "fast", "row", None, dict(arch="bitnet")),
    "bitnet-q8k": (
        "q8k",
        "fast",
        "tensor",
        None,
        dict(arch="bitnet", hidden_size=256, intermediate_size=512),
    ),
}


@pytest.fixture
def on_cpu():
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)
    block.set_enabled(None)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls of each fused op (the native module's functions, spied on)."""
    m = cpu.require()
    calls = {"attn_in": 0, "attn_out": 0, "mlp": 0}
    for name in calls:
        real = getattr(m, name)

        def spy(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(m, name, spy)
    return calls


def _model(tmp_path, case):
    from tiny import ternary_checkpoint

    from mlx_ternary.checkpoint.load import load_model

    act, packing, scale, group, over = CASES[case]
    over = dict(over)
    arch = over.pop("arch", "llama")
    bits = 8 if act == 8 else None
    path, _ = ternary_checkpoint(tmp_path, arch, packing, scale, group, bits, **over)
    model, _ = load_model(path, activations="q8k" if act == "q8k" else None)
    return model


def _half(cls):
    """`cls` (an mlx-lm KV cache class) keeping float16 keys and values, as the fused block
    hands them over (block.kv_dtype()): the unfused block's cache in the comparisons."""

    class Half(cls):
        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))

    return Half


def _decode(model, on: bool, steps: int = 8, cache=None, prompt=PROMPT):
    """Logits of the prompt and of `steps` greedy steps, the tokens, and the cache (the
    unfused run's keeps the fused block's K/V dtype)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    block.set_enabled(on)
    if cache is None and not on and block.kv_dtype() == "float16":
        cache = [_half(KVCache)() for _ in model.layers]
    cache = make_prompt_cache(model) if cache is None else cache
    logits = [model(mx.array(prompt), cache=cache)]
    tokens = []
    for _ in range(steps):
        tok = mx.argmax(logits[-1][:, -1:], axis=-1)
        tokens.append(np.array(tok))
        logits.append(model(tok, cache=cache))
    mx.eval(logits)
    return [np.array(a) for a in logits], np.concatenate(tokens, 1), cache


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _cache_arrays(cache):
    out = []
    for c in cache:
        k, v = c.state[:2]
        n = c._idx if hasattr(c, "_idx") else c.offset
        out += [np.array(k[..., :n, :]), np.array(v[..., :n, :])]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_fused_block_matches_mlx_lm_block(tmp_path, on_cpu, fused_calls, case):
    model = _model(tmp_path, case)
    assert block.routed(model)
    fused, fused_tokens, fused_cache = _decode(model, True)
    n = len(model.model.layers)
    assert fused_calls == {"attn_in": 9 * n, "attn_out": 9 * n, "mlp": 9 * n}
    ref, ref_tokens, ref_cache = _decode(model, False)
    assert fused_calls["attn_in"] == 9 * n  # the unfused run called no fused op
    for a, r in zip(fused, ref):
        assert _rel(a, r) <= 1e-5
    np.testing.assert_array_equal(fused_tokens, ref_tokens)
    for a, r in zip(_cache_arrays(fused_cache), _cache_arrays(ref_cache)):
        assert a.shape == r.shape and _rel(a, r) <= 1e-5


def test_kv_dtype_float32_keeps_float32_caches_and_float16_halves_them(
    tmp_path, on_cpu, fused_calls
):
    """MLX_TERNARY_KV_DTYPE / set_kv_dtype: float32 gives mlx-lm's block's own cache and
    logits; the float16 cache holds half the bytes; a bad name is refused."""
    from mlx_ternary.errors import TernaryError

    model = _model(tmp_path, "bitnet")
    half = _decode(model, True, steps=2)
    block.set_kv_dtype("float32")
    try:
        full = _decode(model, True, steps=2)
        ref = _decode(model, False, steps=2)
    finally:
        block.set_kv_dtype(None)
    for a, r in zip(full[0], ref[0]):
        assert _rel(a, r) <= 1e-5
    assert {a.dtype for a in _cache_arrays(full[2])} == {np.dtype(np.float32)}
    assert {a.dtype for a in _cache_arrays(half[2])} == {np.dtype(np.float16)}
    assert half[2][0].nbytes * 2 == full[2][0].nbytes
    assert max(_rel(a, r) for a, r in zip(half[0], ref[0])) > 1e-6  # float16 K/V differ
    with pytest.raises(TernaryError, match="bfloat16"):
        block.set_kv_dtype("bfloat16")


def test_negative_controls_are_detected(tmp_path, on_cpu, monkeypatch):
    """A RoPE offset off by one for decode steps (RoPE is relative: a shift of every position
    would change nothing) or a perturbed norm weight, in the fused path alone, shows up."""
    model = _model(tmp_path, "int8-fast-row")
    ref = _decode(model, False, steps=2)[0]
    real_kind = block.cache_kind

    def off_by_one(cache, tokens):
        offset, offsets = real_kind(cache, tokens)
        return (offset + 1 if offset else 0), offsets

    monkeypatch.setattr(block, "cache_kind", off_by_one)
    shifted = _decode(model, True, steps=2)[0]
    assert _rel(shifted[0], ref[0]) <= 1e-5  # the prefill (offset 0) is untouched
    assert max(_rel(a, r) for a, r in zip(shifted[1:], ref[1:])) > 1e-3
    monkeypatch.setattr(block, "cache_kind", real_kind)
    real_norm = block.norm_args
    monkeypatch.setattr(block, "norm_args", lambda n: (lambda w: (w[0] * 1.01, w[1]))(real_norm(n)))
    (tmp_path / "fresh").mkdir()  # a model whose blocks have no plan yet (the norms: planned)
    perturbed = _decode(_model(tmp_path / "fresh", "int8-fast-row"), True, steps=2)[0]
    assert max(_rel(a, r) for a, r in zip(perturbed, ref)) > 1e-3
    monkeypatch.setattr(block, "norm_args", real_norm)
    (tmp_path / "bitnet").mkdir()  # BitNet's block with silu in place of relu2
    model = _model(tmp_path / "bitnet", "bitnet")
    ref = _decode(model, False, steps=2)[0]
    real_subs = block.sub_norms
    silu = cpu.require().MLP_SILU
    monkeypatch.setattr(block, "sub_norms", lambda *a: real_subs(*a)[:2] + (silu,))
    swapped = _decode(model, True, steps=2)[0]
    assert max(_rel(a, r) for a, r in zip(swapped, ref)) > 1e-3


def test_block_plan_is_made_once_and_dropped_by_what_changes_it(
    tmp_path, on_cpu, fused_calls, monkeypatch
):
    """A decode step derives nothing: the projections' specs are read when a block is first
    called (7 a block), then never in 10 steps. A replaced weight, a setting assigned, a
    norm weight updated and LoRA-wrapped layers each make that block plan again, once, and
    its output stays mlx-lm's block's (a stale plan would keep the old weight's)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from mlx_ternary.runtime.layers import TernaryLinear

    model = _model(tmp_path, "int8-fast-row")
    n, specs = len(model.model.layers), [0]
    real = TernaryLinear.kernel_spec

    def counting(layer):
        specs[0] += 1
        return real(layer)

    monkeypatch.setattr(TernaryLinear, "kernel_spec", counting)
    block.set_enabled(True)
    cache, tok, derived = make_prompt_cache(model), mx.array(PROMPT), []
    for _ in range(11):  # the prompt, then 10 decode steps
        before = specs[0]
        logits = model(tok, cache=cache)
        tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(tok)
        derived.append(specs[0] - before)
    assert derived == [7 * n] + [0] * 10
    assert fused_calls["attn_in"] == 11 * n

    layer = model.model.layers[0]
    x = mx.random.normal((1, 5, 64), key=mx.random.key(2))

    def run(on: bool):
        block.set_enabled(on)
        with cpu.enabled():
            out = np.array(layer(x, "causal", None))
        return out

    def replanned(change) -> tuple:
        """(kernel_spec calls of the next fused call after `change`, of the one after it,
        the fused output, mlx-lm's)."""
        change()
        before = specs[0]
        fused = run(True)
        first = specs[0] - before
        np.testing.assert_array_equal(run(True), fused)
        return first, specs[0] - before - first, fused, run(False)

    base = run(True)
    q = layer.self_attn.q_proj
    first, again, fused, ref = replanned(lambda: setattr(q, "scales", q.scales * 2))
    assert (first, again) == (7, 0) and _rel(fused, ref) <= 1e-5 and _rel(fused, base) > 1e-3
    first, again, same, ref = replanned(lambda: setattr(q, "activation_bits", 8))
    assert (first, again) == (7, 0) and np.array_equal(same, fused)
    norm = layer.input_layernorm
    first, again, fused2, ref = replanned(
        lambda: layer.update({"input_layernorm": {"weight": norm.weight * 1.5}})
    )
    assert (first, again) == (7, 0) and _rel(fused2, ref) <= 1e-5 and _rel(fused2, fused) > 1e-3
    ran = fused_calls["attn_in"]
    config = {"rank": 4, "dropout": 0.0, "scale": 10.0, "keys": ["self_attn.q_proj"]}
    linear_to_lora_layers(model, n, config)  # mlx-lm's own wrapping: not fused
    model.eval()
    first, again, out, ref = replanned(lambda: None)
    assert fused_calls["attn_in"] == ran and np.array_equal(out, ref)
    assert again == 0  # not fused is planned too: nothing derived per call


def test_batched_left_padded_decode_is_fused_and_matches(tmp_path, on_cpu, fused_calls):
    """BatchKVCache (array offsets, left-padding bool masks): fused and unfused agree, and each
    row matches its sequence decoded alone."""
    from mlx_lm.models.cache import BatchKVCache

    model = _model(tmp_path, "int8-fast-row")
    n = len(model.model.layers)
    short = PROMPT[0][3:]
    prompt = [[0, 0, 0] + short, PROMPT[0]]
    runs = {}
    for on in (True, False):
        cache = [(BatchKVCache if on else _half(BatchKVCache))([3, 0]) for _ in range(n)]
        runs[on] = _decode(model, on, steps=4, cache=cache, prompt=prompt)
    assert fused_calls["attn_in"] == 5 * n
    for a, r in zip(runs[True][0], runs[False][0]):
        assert _rel(a, r) <= 1e-5
    np.testing.assert_array_equal(runs[True][1], runs[False][1])
    alone, tokens, _ = _decode(model, True, steps=4, prompt=[short])
    np.testing.assert_array_equal(runs[True][1][:1], tokens)
    for a, b in zip(runs[True][0][1:], alone[1:]):
        assert _rel(a[:1], b) <= 1e-5


def test_unsupported_cases_take_mlx_lm_path(tmp_path, on_cpu, fused_calls, monkeypatch):
    """LoRA-wrapped projections, a quantized KV cache, an additive float mask, training mode
    and the off switch run mlx-lm's own block, with its result."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from mlx_ternary.runtime.cpu import enabled

    model = _model(tmp_path, "q8k-fast-group256")  # head_dim 64: a quantized cache takes it
    layer = model.model.layers[0]
    x = mx.random.normal((1, 6, 256), key=mx.random.key(1))

    def both(fn, ref=None):
        block.set_enabled(True)
        before = fused_calls["attn_in"]
        with enabled():
            a = fn()
        ran = fused_calls["attn_in"] - before
        block.set_enabled(False)
        with enabled():
            r = (ref or fn)()
        return ran, np.array(a), np.array(r)

    ran, a, r = both(
        lambda: layer(x, "causal", KVCache()), lambda: layer(x, "causal", _half(KVCache)())
    )
    assert ran == 1 and _rel(a, r) <= 1e-5  # the positive case runs fused

    ran, a, r = both(lambda: layer(x, "causal", QuantizedKVCache(group_size=32, bits=8)))
    assert ran == 0 and np.array_equal(a, r)

    def filled(cls=KVCache):  # 252 of its 256 slots used: 6 more tokens grow it, 4 do not
        cache = cls()
        kv = mx.zeros((1, 2, 252, 64))
        cache.update_and_fetch(kv, kv)
        return cache

    for tokens in (6, 4):  # float16 K/V: a call that grows the cache is fused too
        ran, a, r = both(
            lambda: layer(x[:, :tokens], "causal", filled()),
            lambda: layer(x[:, :tokens], "causal", filled(_half(KVCache))),
        )
        assert ran == 1 and _rel(a, r) <= 1e-5
    grown = filled(_half(KVCache))
    block.set_enabled(True)
    with enabled():
        mx.eval(layer(x, "causal", grown))
    assert grown.keys.dtype == mx.float16 and grown.keys.shape[2] > 256  # still 16 bits
    block.set_kv_dtype("float32")  # float32 K/V: a growing call keeps mlx-lm's block
    try:
        ran, a, r = both(lambda: layer(x, "causal", filled()))
    finally:
        block.set_kv_dtype(None)
    assert ran == 0 and np.array_equal(a, r)

    additive = mx.triu(mx.full((6, 6), -1e9), k=1)
    ran, a, r = both(lambda: layer(x, additive, None))
    assert ran == 0 and np.array_equal(a, r)

    layer.train()
    ran, a, r = both(lambda: layer(x, "causal", None))
    layer.eval()
    assert ran == 0 and np.array_equal(a, r)

    calls = fused_calls["attn_in"]
    monkeypatch.setenv(block.ENV_FUSED, "0")
    block.set_enabled(None)
    with enabled():
        layer(x, "causal", None)
    assert fused_calls["attn_in"] == calls

    monkeypatch.delenv(block.ENV_FUSED)
    block.set_enabled(None)
    with enabled():
        layer(x, "causal", None)  # outside enabled(): never fused (the next lines)
    assert fused_calls["attn_in"] == calls + 1
    layer(x, "causal", None)
    assert fused_calls["attn_in"] == calls + 1

    from mlx_ternary.runtime.lora import TernaryLoRALinear

    layer.self_attn.q_proj = TernaryLoRALinear.from_base(layer.self_attn.q_proj, r=4)
    ran, a, r = both(lambda: layer(x, "causal", None))
    assert ran == 0 and np.array_equal(a, r)


def test_gradients_through_the_model_are_mlx_lm_own(tmp_path, on_cpu, fused_calls):
    """mlx-lm's LoRA training runs in train mode: the fused ops are never traced."""
    import mlx.nn as nn
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = _model(tmp_path, "int8-fast-row")
    model.freeze()  # as mlx-lm's trainer does
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    model.train()
    ids = mx.array(PROMPT)

    def loss(m):
        return nn.losses.cross_entropy(m(ids[:, :-1]), ids[:, 1:]).mean()

    value, grads = nn.value_and_grad(model, loss)(model)
    mx.eval(value, grads)
    assert fused_calls["attn_in"] == 0 and np.isfinite(value.item())


def test_gradients_in_eval_mode_are_the_unfused_blocks(tmp_path, on_cpu, fused_calls):
    """A gradient through a model in eval mode (no train(), which mlx-lm's trainer sets) runs
    the fused ops, whose vjp is MLX's ops composing the same function: the unfused block's
    gradient."""
    model = _model(tmp_path, "qwen3")  # head norms too
    ids = mx.array(PROMPT)
    emb = model.model.embed_tokens(ids)

    def loss(e):
        return model(ids, input_embeddings=e)[0, -1].sum()

    grads = []
    for on in (True, False):
        block.set_enabled(on)
        grads.append(np.array(mx.grad(loss)(emb)))
    assert fused_calls["attn_in"] == len(model.model.layers)
    assert np.abs(grads[1]).max() > 0
    assert _rel(grads[0], grads[1]) <= 1e-5


def test_residual_none_returns_the_partial_projection(tmp_path, on_cpu):
    """attn_out / mlp with residual=None (tensor parallelism: all_sum, then the residual)
    return the projection alone: adding the residual gives the fused result."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    model = _model(tmp_path, "int8-fast-row")
    layer, m = model.model.layers[0], cpu.require()
    parts = block.parts(layer, llama)
    (w1, eps1), (w2, eps2), qkv, gate_up, o, down, rope, norms = parts
    attn = layer.self_attn
    x = mx.random.normal((1, 5, 64), key=mx.random.key(3))
    q, k, v = m.attn_in(x, w1, eps1, *qkv[:3], *qkv[3], 4, 2, 16, *rope, 0, None, *norms)
    k, v = KVCache().update_and_fetch(k, v)
    full = m.attn_out(q, k, v, attn.scale, True, None, *o[:3], *o[3], x)
    part = m.attn_out(q, k, v, attn.scale, True, None, *o[:3], *o[3], None)
    np.testing.assert_array_equal(np.array(part + x), np.array(full))
    full = m.mlp(x, w2, eps2, *gate_up[:3], *gate_up[3], *down[:3], *down[3], x)
    part = m.mlp(x, w2, eps2, *gate_up[:3], *gate_up[3], *down[:3], *down[3], None)
    np.testing.assert_array_equal(np.array(part + x), np.array(full))
    block.set_enabled(False)
    with cpu.enabled():
        ref = layer(x, "causal", None)  # and the three ops are the block
    h = m.attn_out(q, k, v, attn.scale, True, None, *o[:3], *o[3], x)
    out = m.mlp(h, w2, eps2, *gate_up[:3], *gate_up[3], *down[:3], *down[3], h)
    assert _rel(np.array(out), np.array(ref)) <= 1e-5
