"""TernaryLinear's launch plan: refreshed when its arrays change, the straight-through input
gradient on every path, the first-use check with its fallback, self-tuning with its cache,
the <8-element guard, and greedy generation through the emulated kernels.

"Metal" here is faked: mx.metal.is_available() reports True and mx.fast.metal_kernel is the
emulator (a correct kernel), or a kernel that raises, or one that returns wrong numbers.
"""

import copy
import json
import warnings

import mlx.core as mx
import numpy as np
import pytest
from tiny import FIXTURES

from mlx_ternary import format as fmt
from mlx_ternary.emulator import MetalCompileError, metal_kernel
from mlx_ternary.runtime import dispatch, probe, reference, tune
from mlx_ternary.runtime.layers import TernaryLinear
from mlx_ternary.runtime.metal import launch

FIXTURES = FIXTURES


def make_layer(
    n=24,
    k=96,
    packing="fast",
    scale="row",
    group_size=None,
    act=None,
    bias=False,
    backend=None,
    seed=0,
):
    """A TernaryLinear with random trits and scales, and its float64 weight (N, K)."""
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    s = rng.uniform(0.5, 1.5, size=fmt.scales_shape(scale, n, k, group_size)).astype(np.float32)
    pt = fmt.PackedTernary.from_trits(t, s, packing, group_size)
    b = mx.array(rng.normal(size=(n,)).astype(np.float32)) if bias else None
    layer = TernaryLinear.from_packed(pt, b, activation_bits=act, backend=backend)
    return layer, pt.dequantize(np.float64)


def forward_np(x, w, act, bias=None):
    """float64 numpy forward, activation quantization in float32 as the kernels do it."""
    x32 = np.array(x.astype(mx.float32))
    if act:
        sc = np.float32(127) / np.maximum(np.abs(x32).max(-1, keepdims=True), np.float32(1e-5))
        y = (np.clip(np.rint(x32 * sc), -128, 127).astype(np.float64) @ w.T) / sc
    else:
        y = x32.astype(np.float64) @ w.T
    return y if bias is None else y + np.array(bias).astype(np.float64)


def rel_err(y, want):
    got = np.array(y.astype(mx.float32)).astype(np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


class Counting:
    """A kernel factory that wraps another and counts launches."""

    def __init__(self, factory, transform=None):
        self.factory, self.transform, self.launches = factory, transform, 0

    def __call__(self, **kw):
        kernel = self.factory(**kw)

        def launch(**call):
            self.launches += 1
            out = kernel(**call)
            return [self.transform(o) for o in out] if self.transform else out

        return launch


class RaisingKernel:
    """What a kernel Apple's compiler rejects looks like from Python."""

    def __init__(self, **kw):
        self.name = kw["name"]

    def __call__(self, **call):
        raise RuntimeError(
            f"[metal::Device] Unable to build metal library from source\n"
            f"custom_kernel_{self.name}: error: no matching function"
        )


@pytest.fixture
def fake_metal(monkeypatch, tmp_path):
    """Metal reported available, caches in tmp_path, fresh probe and tuning state."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    # On a Mac the GPU is the default device, so the native CPU kernel is not chosen.
    monkeypatch.setattr(dispatch.cpu, "available", lambda: False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(tune.ENV_TUNE, "0")
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    monkeypatch.delenv(dispatch.ENV_EMULATE, raising=False)
    probe.reset()
    tune.reset()
    yield monkeypatch
    probe.reset()
    tune.reset()


def reference_output(layer, x):
    return reference.ternary_matmul(
        x,
        layer.packed,
        layer.scales,
        layer.get("bias"),
        packing=layer.packing,
        in_features=layer.in_features,
        group_size=layer.group_size,
        activation_bits=layer.activation_bits,
    )


# --------------------------------------------------------------------------- #
# The plan follows the layer's arrays and settings
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("backend", ["reference", "emulate"])
def test_plan_follows_load_weights_update_and_assignment(backend):
    layer, w = make_layer(act=None, backend=backend)
    layer.eval()
    x = mx.array(np.random.default_rng(1).normal(size=(2, 96)).astype(np.float32))
    assert rel_err(layer(x), forward_np(x, w, None)) < 1e-5
    old_plan = layer.plan()

    other, w2 = make_layer(seed=5)
    layer.load_weights([("packed", other.packed), ("scales", other.scales)], strict=False)
    assert rel_err(layer(x), forward_np(x, w2, None)) < 1e-5
    # Negative control: the plan made for the old arrays still computes the old layer.
    assert rel_err(old_plan(x), forward_np(x, w, None)) < 1e-5

    layer.update({"scales": layer.scales * 2})
    assert rel_err(layer(x), forward_np(x, 2 * w2, None)) < 1e-5
    layer.bias = mx.ones((24,))
    assert rel_err(layer(x), forward_np(x, 2 * w2, None, mx.ones((24,)))) < 1e-5
    del layer.bias
    layer.activation_bits = 8
    assert rel_err(layer(x), forward_np(x, 2 * w2, 8)) < 1e-5
    layer.repack("compact")
    assert layer.packing == "compact" and rel_err(layer(x), forward_np(x, 2 * w2, 8)) < 1e-5


def test_plan_is_per_shape_and_dtype():
    layer, w = make_layer(act=8, backend="emulate")
    layer.eval()
    for shape, dtype in [
        ((1, 96), mx.float32),
        ((1, 1, 96), mx.float16),
        ((3, 96), mx.float32),
        ((2, 3, 96), mx.bfloat16),
        ((0, 96), mx.float32),
    ]:
        x = mx.array(np.random.default_rng(2).normal(size=shape).astype(np.float32)).astype(dtype)
        y = layer(x)
        assert y.shape == (*shape[:-1], 24) and y.dtype == dtype
        if x.size:
            assert rel_err(y, forward_np(x, w, 8)) < {mx.float32: 1e-5}.get(dtype, 2e-2)
    assert len(layer.plan().calls) == 5
    with pytest.raises(ValueError, match="in_features = 96"):
        layer(mx.zeros((1, 95)))


# --------------------------------------------------------------------------- #
# Gradients: BitNet's straight-through estimator, grad_x = g @ W
# --------------------------------------------------------------------------- #


def input_grad(layer, x, c):
    return mx.grad(lambda x_: (layer(x_) * c).sum())(x)


@pytest.mark.parametrize(
    "packing,scale,group,act,bias",
    [
        ("fast", "row", None, None, True),
        ("fast", "tensor", None, 8, False),
        ("fast", "group", 64, 8, True),
        ("compact", "group", 64, None, False),
        ("compact", "row", None, 8, True),
    ],
)
def test_emulated_kernels_have_the_straight_through_gradient(packing, scale, group, act, bias):
    layer, w = make_layer(
        n=20,
        k=128,
        packing=packing,
        scale=scale,
        group_size=group,
        act=act,
        bias=bias,
        backend="emulate",
    )
    rng = np.random.default_rng(3)
    x = mx.array(rng.normal(size=(3, 128)).astype(np.float32))
    c = mx.array(rng.normal(size=(3, 20)).astype(np.float32))
    want = np.array(c).astype(np.float64) @ w
    for train in (True, False):  # emulated outputs are eager: always wrapped
        layer.train(train)
        assert rel_err(input_grad(layer, x, c), want) < 1e-5
    # Negative control: a wrong W (rows reversed) is caught.
    assert rel_err(input_grad(layer, x, c), np.array(c).astype(np.float64) @ w[::-1]) > 1e-2


def test_metal_kernels_are_differentiable_in_training_mode(fake_metal):
    fake_metal.setattr(mx.fast, "metal_kernel", metal_kernel)  # the emulator as "Metal"
    layer, w = make_layer(n=20, k=128, act=8)
    assert layer.plan().backend == "metal"
    rng = np.random.default_rng(4)
    x = mx.array(rng.normal(size=(2, 128)).astype(np.float32))
    c = mx.array(rng.normal(size=(2, 20)).astype(np.float32))
    layer.train()
    assert rel_err(input_grad(layer, x, c), np.array(c).astype(np.float64) @ w) < 1e-5
    # In eval mode the launch carries no VJP: here (the emulator's eager outputs) no gradient
    # reaches x; on a Mac MLX refuses to differentiate a custom kernel.
    layer.eval()
    assert np.abs(np.array(input_grad(layer, x, c))).max() == 0


def test_the_remembered_last_call_follows_dtype_mode_and_copies(fake_metal):
    # TernaryLinear checks its latest inference call's (shape, dtype) before the plan's dict.
    fake_metal.setattr(mx.fast, "metal_kernel", metal_kernel)
    layer, w = make_layer(n=20, k=128, act=8)
    layer.eval()
    rng = np.random.default_rng(6)
    x = mx.array(rng.normal(size=(2, 128)).astype(np.float32))
    c = mx.array(rng.normal(size=(2, 20)).astype(np.float32))
    for dtype in (mx.float32, mx.float16, mx.float32, mx.bfloat16):  # same shape, new dtype
        y = layer(x.astype(dtype))
        assert y.dtype == dtype
        assert rel_err(y, forward_np(x.astype(dtype), w, 8)) < {mx.float32: 1e-5}.get(dtype, 2e-2)
        # The repeat launches the one GEMV from the remembered pieces (launch.py's
        # run.direct), not through the closure: the same output.
        assert layer._last[3] is not None and layer._last[:2] == (x.shape, dtype)
        assert mx.array_equal(layer(x.astype(dtype)), y).item()
    x3 = x[None]  # a new shape: planned, remembered, then launched directly
    for _ in range(2):
        y3 = layer(x3)
        assert y3.shape == (1, 2, 20) and rel_err(y3[0], forward_np(x, w, 8)) < 1e-5
    assert np.abs(np.array(input_grad(layer, x, c))).max() == 0  # eval: no VJP (control)
    layer.train()  # after eval calls of this very shape: the training call, with its VJP
    assert rel_err(input_grad(layer, x, c), np.array(c).astype(np.float64) @ w) < 1e-5
    layer.eval()
    assert np.abs(np.array(input_grad(layer, x, c))).max() == 0
    twin = copy.deepcopy(layer)  # plans again: nothing of the original's plan is kept
    assert twin.plan() is not layer.plan()
    assert rel_err(twin(x), forward_np(x, w, 8)) < 1e-5


def test_reference_path_gradient_without_activation_quantization():
    layer, w = make_layer(n=20, k=128, act=None, bias=True, backend="reference")
    rng = np.random.default_rng(5)
    x = mx.array(rng.normal(size=(2, 128)).astype(np.float32))
    c = mx.array(rng.normal(size=(2, 20)).astype(np.float32))
    assert rel_err(input_grad(layer, x, c), np.array(c).astype(np.float64) @ w) < 1e-5


# --------------------------------------------------------------------------- #
# Safe first use: a failing variant warns once and runs the reference path
# --------------------------------------------------------------------------- #


def test_a_correct_kernel_passes_its_check_and_runs(fake_metal):
    factory = Counting(metal_kernel)
    fake_metal.setattr(mx.fast, "metal_kernel", factory)
    layer, w = make_layer(act=8)
    layer.eval()
    x = mx.array(np.random.default_rng(7).normal(size=(1, 96)).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", probe.KernelCheckWarning)
        y = layer(x)
        assert factory.launches == 2  # the probe's GEMV, then the layer's (int8 x inside)
        assert rel_err(layer(x), forward_np(x, w, 8)) < 1e-5
    assert factory.launches == 3  # checked once: later calls launch only their own
    assert rel_err(y, forward_np(x, w, 8)) < 1e-5 and not probe.failures()


@pytest.mark.parametrize("fake", ["raises", "wrong numbers"])
def test_a_failing_kernel_warns_once_and_falls_back_to_the_reference(fake_metal, fake):
    if fake == "raises":
        factory = Counting(RaisingKernel)
    else:
        factory = Counting(metal_kernel, transform=lambda a: mx.zeros_like(a))
    fake_metal.setattr(mx.fast, "metal_kernel", factory)
    layer, w = make_layer(act=8, bias=True)
    layer.eval()
    x = mx.array(np.random.default_rng(8).normal(size=(1, 96)).astype(np.float32))
    with pytest.warns(
        probe.KernelCheckWarning,
        match=r"kernel gemv_fast .*TM=1.*ACTQ=True.*failed its "
        r"first-use check on .*reference path",
    ) as record:
        y = layer(x)
    assert len(record) == 1
    np.testing.assert_array_equal(np.array(y), np.array(reference_output(layer, x)))
    assert rel_err(y, forward_np(x, w, 8, layer.bias)) < 1e-5
    launches = factory.launches
    with warnings.catch_warnings():
        warnings.simplefilter("error", probe.KernelCheckWarning)
        twin, _ = make_layer(act=8, bias=True, seed=3)  # same variant, another layer
        twin.eval()
        twin(x), layer(x)
    assert factory.launches == launches  # no kernel ran again: the variant stays off
    # Another variant (4 tokens) is checked on its own first use.
    with pytest.warns(probe.KernelCheckWarning, match="TM=4"):
        layer(mx.concatenate([x] * 4))
    assert len(probe.failures()) == 2


def test_a_kernel_that_cannot_be_constructed_warns_once_and_falls_back(fake_metal):
    """mx.fast.metal_kernel(...) itself raising (not the launch): one warning, the
    reference path's exact numbers, and no second try for another shape of the layer."""
    built = []

    def refusing(**kw):
        built.append(kw["name"])
        raise RuntimeError("[metal_kernel] Unable to build metal library")

    fake_metal.setattr(mx.fast, "metal_kernel", refusing)
    layer, w = make_layer(act=8)
    layer.eval()
    x = mx.array(np.random.default_rng(9).normal(size=(1, 96)).astype(np.float32))
    with pytest.warns(probe.KernelCheckWarning, match="could not be constructed") as record:
        y = layer(x)
        y4 = layer(mx.concatenate([x] * 4))
    assert len(record) == 1 and built
    np.testing.assert_array_equal(np.array(y), np.array(reference_output(layer, x)))
    assert rel_err(y, forward_np(x, w, 8)) < 1e-5
    assert rel_err(y4[:1], forward_np(x, w, 8)) < 1e-5
    assert [k for k in probe.failures() if k[0] == "construct"]


# --------------------------------------------------------------------------- #
# Self-tuning: a fake timer decides; the choice is cached per chip and MLX version
# --------------------------------------------------------------------------- #


def fake_timer(times, calls):
    def timer(name, fn, x):
        calls.append(name)
        return times[name]

    return timer


def tuned_layer(fake_metal, times, calls):
    factory = Counting(metal_kernel)
    fake_metal.setattr(mx.fast, "metal_kernel", factory)
    fake_metal.setenv(tune.ENV_TUNE, "1")
    fake_metal.setattr(tune, "time_candidate", fake_timer(times, calls))
    layer, w = make_layer(act=8)
    layer.eval()
    return layer, w, factory


def test_tuning_runs_the_faster_candidate_and_caches_it(fake_metal, tmp_path):
    x = mx.array(np.random.default_rng(9).normal(size=(1, 96)).astype(np.float32))
    calls = []
    layer, w, factory = tuned_layer(fake_metal, {"kernel": 2e-3, "stock": 1e-3}, calls)
    y = layer(x)
    assert sorted(calls) == ["kernel", "stock"]
    launches = factory.launches
    y2 = layer(x)
    assert factory.launches == launches  # stock won: no kernel launch
    np.testing.assert_array_equal(np.array(y2), np.array(reference_output(layer, x)))
    path = tune.cache_path()
    assert path.is_relative_to(tmp_path / "mlx_ternary" / "tune")
    choices = json.loads(path.read_text())["choices"]
    assert list(choices.values()) == ["stock"] and "96" in next(iter(choices))
    assert rel_err(y, forward_np(x, w, 8)) < 1e-5

    # A new process: the cached choice decides without timing.
    tune.reset()
    calls.clear()
    layer2, _, _ = tuned_layer(fake_metal, {"kernel": 1e-3, "stock": 2e-3}, calls)
    layer2(x)
    assert calls == []
    # A corrupt cache is ignored and rewritten.
    path.write_text("{not json")
    tune.reset()
    layer3, _, factory3 = tuned_layer(fake_metal, {"kernel": 1e-3, "stock": 2e-3}, calls)
    with pytest.warns(UserWarning, match="tuning cache is damaged") as record:
        layer3(x)
    assert len([r for r in record if "tuning cache" in str(r.message)]) == 1
    launches = factory3.launches
    layer3(x)
    assert sorted(calls) == ["kernel", "stock"] and factory3.launches == launches + 1
    assert list(json.loads(path.read_text())["choices"].values()) == ["kernel"]


def test_tuning_off_runs_the_kernel_without_timing(fake_metal):
    calls = []
    layer, _, factory = tuned_layer(fake_metal, {"kernel": 2e-3, "stock": 1e-3}, calls)
    fake_metal.setenv(tune.ENV_TUNE, "0")
    x = mx.ones((1, 96))
    layer(x)
    launches = factory.launches
    layer(x)
    assert calls == [] and factory.launches == launches + 1  # one launch per int8 call
    assert not tune.cache_path().exists()


def test_tuning_stops_at_its_time_budget(fake_metal):
    calls = []
    layer, _, _ = tuned_layer(fake_metal, {"kernel": 2e-3, "stock": 1e-3}, calls)
    fake_metal.setattr(tune, "TIME_BUDGET_S", 0.0)
    layer(mx.ones((1, 96)))
    assert calls == []


# --------------------------------------------------------------------------- #
# Inputs MLX binds as `constant`
# --------------------------------------------------------------------------- #


def test_layers_under_8_packed_elements_run_the_reference_path(fake_metal):
    factory = Counting(metal_kernel)
    fake_metal.setattr(mx.fast, "metal_kernel", factory)
    small, w_small = make_layer(n=1, k=12, packing="compact", scale="row")
    assert small.packed.size < launch.MIN_DEVICE_ELEMENTS
    small.eval()
    x = mx.array(np.random.default_rng(10).normal(size=(2, 12)).astype(np.float32))
    assert rel_err(small(x), forward_np(x, w_small, None)) < 1e-5
    assert factory.launches == 0
    # Negative control: the kernel itself, given the 4-byte weight, does not compile (its
    # `(const device uint*)` cast of a `constant` buffer), as on Apple's compiler.
    with pytest.raises(MetalCompileError):
        launch.ternary_matmul(
            x, small.packed, small.scales, packing="compact", in_features=12, backend="emulate"
        )


# --------------------------------------------------------------------------- #
# Greedy generation through the emulated kernels equals the reference path
# --------------------------------------------------------------------------- #


def greedy(model, prompt, n):
    from mlx_lm.generate import generate_step

    return [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt), model, max_tokens=n, sampler=lambda lp: mx.argmax(lp, axis=-1)
        )
    ]


@pytest.mark.parametrize("source", ["embedded", "hf bitnet"])
def test_greedy_generation_under_emulate_equals_reference(monkeypatch, source):
    from mlx_ternary import generate as gen
    from mlx_ternary.checkpoint.load import load_model

    path = (
        gen.EMBEDDED_MODEL
        if source == "embedded"
        else (FIXTURES / "hf" / "bitnet_offline_autobitlinear")
    )
    prompt = [5, 17, 40, 3, 99, 12, 7, 64, 21]
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    monkeypatch.setenv(dispatch.ENV_EMULATE, "1")
    emulated, config = load_model(path)
    packing = config["quantization"]["packing"]
    assert {m.plan().backend for m in _layers(emulated)} == {"emulate"}
    got = greedy(emulated, prompt, 5)
    monkeypatch.delenv(dispatch.ENV_EMULATE)
    reference_model, _ = load_model(path, backend="reference")
    assert got == greedy(reference_model, prompt, 5)
    assert packing == "compact"  # both kept compact under emulation (fast on the reference)


def _layers(model):
    from mlx_ternary.runtime.layers import ternary_layers

    return [m for _, m in ternary_layers(model)]


def test_a_host_backend_slots_in_through_host_matmul(monkeypatch):
    """Where another backend (the CPU extension, "native") joins: resolve_backend accepts its
    name, host_matmul returns its function, called with reference.ternary_matmul's signature."""
    calls = []

    def native(x, packed, scales, bias, *, packing, in_features, group_size, activation_bits):
        calls.append((packing, in_features, group_size, activation_bits))
        return reference.ternary_matmul(
            x,
            packed,
            scales,
            bias,
            packing=packing,
            in_features=in_features,
            group_size=group_size,
            activation_bits=activation_bits,
        )

    real = dispatch.host_matmul
    monkeypatch.setattr(dispatch, "BACKENDS", dispatch.BACKENDS + ("native",))
    monkeypatch.setattr(dispatch, "host_matmul", lambda b: native if b == "native" else real(b))
    layer, w = make_layer(act=8, bias=True, backend="native")
    layer.eval()
    x = mx.array(np.random.default_rng(11).normal(size=(2, 96)).astype(np.float32))
    assert rel_err(layer(x), forward_np(x, w, 8, layer.bias)) < 1e-5
    layer(x)
    assert calls == [("fast", 96, None, 8)] * 2


def test_first_use_check_inside_mx_compile(fake_metal):
    """The check evaluates only its own arrays, which MLX allows while tracing: a variant
    first met inside mx.compile is checked there, and its fallback compiles."""
    fake_metal.setattr(
        mx.fast, "metal_kernel", Counting(metal_kernel, transform=lambda a: mx.zeros_like(a))
    )
    layer, w = make_layer(act=None)
    layer.eval()
    x = mx.array(np.random.default_rng(12).normal(size=(1, 96)).astype(np.float32))
    with pytest.warns(probe.KernelCheckWarning):
        y = mx.compile(lambda x_: layer(x_) * 1.0)(x)
    assert rel_err(y, forward_np(x, w, None)) < 1e-5


def _run_in_thread(fn):
    """fn() in a new thread on that thread's own stream (as serve's engine runs the model)."""
    import threading

    out = {}

    def run():
        try:
            with mx.stream(mx.default_stream(mx.default_device())):
                out["y"] = np.array(fn())
        except Exception as e:  # reported to the test below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


@pytest.mark.parametrize("backend", ["reference", "emulate"])
def test_a_plan_made_in_one_thread_runs_in_another(backend):
    """A layer planned (and run) in this thread, then called in a fresh thread: MLX ties an
    unevaluated array to the stream of the thread that made it, so plans keep no lazy ones."""
    w = np.random.default_rng(5).integers(-1, 2, (24, 96)).astype(np.int8)
    layer = TernaryLinear.from_packed(
        fmt.PackedTernary.from_trits(w, np.float32(0.5), "fast"), activation_bits=8, backend=backend
    )
    x = mx.array(np.random.default_rng(6).normal(size=(1, 3, 96)).astype(np.float32))
    want = np.array(layer(x))
    out = _run_in_thread(lambda: layer(x))
    assert "error" not in out, out.get("error")
    np.testing.assert_array_equal(out["y"], want)


def test_cross_thread_negative_control(monkeypatch):
    """Without evaluating the plan's arrays up front, the same call fails in the new thread."""
    monkeypatch.setattr(reference, "materialize", lambda *a: None)
    monkeypatch.setattr(reference, "_UNIT_AFFINE", {})
    w = np.random.default_rng(7).integers(-1, 2, (24, 96)).astype(np.int8)
    layer = TernaryLinear.from_packed(
        fmt.PackedTernary.from_trits(w, np.float32(0.5), "fast"),
        activation_bits=8,
        backend="reference",
    )
    x = mx.array(np.random.default_rng(8).normal(size=(1, 3, 96)).astype(np.float32))
    mx.eval(layer(x))
    out = _run_in_thread(lambda: layer(x))
    assert "Stream" in str(out.get("error")), out
