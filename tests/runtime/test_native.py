"""The native CPU kernel (mlx_ternary.runtime.cpu): a sweep against the reference twin and float64
numpy, its gradient, the float16 tables, the dispatch, and the build's cache and fallbacks."""

import os
import subprocess
import textwrap

import mlx.core as mx
import numpy as np
import pytest
from tiny import PYTHON, ROOT

from mlx_ternary import format as fmt
from mlx_ternary.paths import CACHE_ENV
from mlx_ternary.runtime import cpu, dispatch, reference
from mlx_ternary.runtime.cpu import build

# pytest.mark.native (conftest.py): skipped only where no C++ compiler can build the extension
# (never on the project's machines).
needs_native = pytest.mark.native


@pytest.fixture
def cpu_default():
    """Tests of the automatic choice run with the CPU as default device (as on Linux)."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
TOL = {"f32": 2e-6, "f16": 2e-3, "bf16": 1.6e-2}  # vs float64, relative to max |y|


def make_case(m, n, k, packing, scale, group, dtype, act, bias, seed=0, lead=()):
    """Random trits, scales, x (and bias) and the float64 answer computed in numpy."""
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    gs = group if scale == "group" else None
    s = rng.uniform(0.5, 1.5, size=fmt.scales_shape(scale, n, k, gs)).astype(np.float32)
    pt = fmt.PackedTernary.from_trits(t, s, packing, gs)
    x32 = rng.normal(size=(*lead, m, k)) * rng.uniform(0.5, 4, size=(*lead, m, 1))
    x = mx.array(x32.astype(np.float32)).astype(dtype)
    b = mx.array(rng.normal(size=(n,)).astype(np.float32)) if bias else None
    xf = np.array(x.astype(mx.float32))
    if act:  # BitNet per-token int8, in float32 like the kernels
        sc = np.float32(127) / np.maximum(np.abs(xf).max(-1, keepdims=True), np.float32(1e-5))
        xf = np.clip(np.rint(xf * sc), -128, 127) / sc.astype(np.float64)
    want = xf.astype(np.float64) @ pt.dequantize(np.float64).T
    if bias:
        want = want + np.array(b).astype(np.float64)
    kw = dict(packing=packing, in_features=k, group_size=gs, activation_bits=8 if act else None)
    return (x, mx.array(pt.packed), mx.array(s), b, kw), want


def rel_err(y, want):
    got = np.array(y.astype(mx.float32)).astype(np.float64)
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


# (M, N, K, scale, group): M over the token tiles (1..4) and their remainders, K not a multiple
# of 5, 32, 128 or the group, N not a multiple of the 16-row chunks.
SHAPES = [
    (1, 13, 77, "tensor", None),
    (2, 9, 130, "row", None),
    (3, 17, 200, "group", 64),
    (7, 11, 333, "group", 128),
    (8, 20, 270, "group", 256),
    (9, 40, 601, "row", None),
    (33, 5, 1030, "group", 64),
    (5, 33, 160, "tensor", None),
    (4, 19, 256, "group", 128),
]


@needs_native
@pytest.mark.parametrize("packing", fmt.PACKINGS)
@pytest.mark.parametrize("act", [True, False], ids=["act8", "float"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_sweep_against_reference_and_float64(shape, act, packing):
    m, n, k, scale, g = shape
    (x, p, s, b, kw), want = make_case(
        m, n, k, packing, scale, g, mx.float32, act, bias=m % 2 == 1, seed=m * 7 + k
    )
    y = cpu.ternary_matmul(x, p, s, b, **kw)
    twin = reference.ternary_matmul(x, p, s, b, **kw)
    assert y.shape == (m, n) and y.dtype == mx.float32
    assert rel_err(y, want) < TOL["f32"]
    if act and scale != "group":
        # int8 activations: integer accumulation, then the twin's float32 epilogue: same bits
        assert np.array_equal(np.array(y), np.array(twin))
    else:
        # float activations / group scales: float32 sums in another order than the twin's
        assert rel_err(y, np.array(twin).astype(np.float64)) < TOL["f32"]


@needs_native
@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("packing", fmt.PACKINGS)
@pytest.mark.parametrize("act", [True, False], ids=["act8", "float"])
def test_half_activations(dt, packing, act):
    (x, p, s, b, kw), want = make_case(6, 21, 300, packing, "group", 64, DTYPES[dt], act, True)
    y = cpu.ternary_matmul(x, p, s, b, **kw)
    assert y.dtype == DTYPES[dt]
    assert rel_err(y, want) < TOL[dt]


@needs_native
def test_exact_epilogue_matches_float32_numpy():
    """Row scales + int8 activations: ((sum(q t) * s) * (1 / scale)) + b in float32, exactly."""
    (x, p, s, b, kw), _ = make_case(3, 24, 190, "fast", "row", None, mx.float32, True, True)
    xf = np.array(x)
    sc = np.float32(127) / np.maximum(np.abs(xf).max(-1, keepdims=True), np.float32(1e-5))
    q = np.clip(np.rint(xf * sc), -128, 127).astype(np.int64)
    t = fmt.unpack_fast(np.array(p), 190).astype(np.int64)
    acc = (q @ t.T).astype(np.float32)
    want = (acc * np.array(s).reshape(1, -1)) * (np.float32(1) / sc) + np.array(b)
    assert np.array_equal(np.array(cpu.ternary_matmul(x, p, s, b, **kw)), want)


@needs_native
def test_negative_controls():
    """The sweep's comparisons fail when the scale or the activation mode is wrong."""
    (x, p, s, b, kw), want = make_case(3, 17, 200, "fast", "row", None, mx.float32, True, True)
    assert rel_err(cpu.ternary_matmul(x, p, mx.ones_like(s), b, **kw), want) > 1e-2
    off = dict(kw, activation_bits=None)
    assert not np.array_equal(
        np.array(cpu.ternary_matmul(x, p, s, b, **off)),
        np.array(reference.ternary_matmul(x, p, s, b, **kw)),
    )


@needs_native
def test_leading_dims_strided_input_and_threads():
    (x, p, s, b, kw), want = make_case(
        5, 30, 150, "compact", "row", None, mx.float32, True, True, lead=(2,)
    )
    y = cpu.ternary_matmul(x, p, s, b, **kw)
    assert y.shape == (2, 5, 30) and rel_err(y, want) < TOL["f32"]
    xt = mx.swapaxes(mx.swapaxes(x, 0, 1), 0, 1)  # same values through a strided view
    strided = mx.transpose(
        mx.array(np.ascontiguousarray(np.array(x).transpose(2, 0, 1))), (1, 2, 0)
    )
    assert np.array_equal(np.array(cpu.ternary_matmul(strided, p, s, b, **kw)), np.array(y))
    assert np.array_equal(np.array(cpu.ternary_matmul(xt, p, s, b, **kw)), np.array(y))
    threads = cpu.info()["threads"]
    try:
        cpu.set_num_threads(1)
        one = cpu.ternary_matmul(x, p, s, b, **kw)
        cpu.set_num_threads(3)
        three = cpu.ternary_matmul(x, p, s, b, **kw)
        assert np.array_equal(np.array(one), np.array(y))
        assert np.array_equal(np.array(three), np.array(y))
    finally:
        cpu.set_num_threads(threads)


@needs_native
def test_bad_arguments_name_the_tensor():
    (x, p, s, b, kw), _ = make_case(2, 9, 130, "fast", "row", None, mx.float32, True, False)
    with pytest.raises(ValueError, match="packed"):
        cpu.ternary_matmul(x, p[:, :-1], s, b, **kw)
    with pytest.raises(ValueError, match="in_features"):
        cpu.ternary_matmul(x[:, :-1], p, s, b, **kw)
    with pytest.raises(ValueError, match="group_size"):
        cpu.ternary_matmul(x, p, mx.ones((9, 3)), b, **kw)


@needs_native
@pytest.mark.parametrize("act", [True, False], ids=["act8", "float"])
@pytest.mark.parametrize("scale,group", [("row", None), ("group", 64), ("tensor", None)])
def test_gradients(act, scale, group):
    """dx = g @ (s t) (straight-through), db = sum g, ds = the twin's (same x_hat)."""
    (x, p, s, b, kw), _ = make_case(4, 12, 150, "fast", scale, group, mx.float32, act, True)
    g = mx.array(np.random.default_rng(1).normal(size=(4, 12)).astype(np.float32))
    w = fmt.PackedTernary("fast", np.array(p), np.array(s), 12, 150, group).dequantize(np.float64)

    def loss(fn):
        return lambda x_, s_, b_: (fn(x_, p, s_, b_, **kw) * g).sum()

    dx, ds, db = mx.grad(loss(cpu.ternary_matmul), argnums=(0, 1, 2))(x, s, b)
    assert rel_err(dx, np.array(g).astype(np.float64) @ w) < 1e-6
    assert np.allclose(np.array(db), np.array(g).sum(0), rtol=1e-6, atol=1e-6)
    _, ds_ref, _ = mx.grad(loss(reference.ternary_matmul), argnums=(0, 1, 2))(x, s, b)
    assert rel_err(ds, np.array(ds_ref).astype(np.float64)) < 1e-5
    with pytest.raises(ValueError, match="packed trits"):
        mx.grad(lambda p_: cpu.ternary_matmul(x, p_, s, b, **kw).sum())(p)


@needs_native
@pytest.mark.parametrize("wdt", ["f32", "f16", "bf16"])
def test_dense_matmul(wdt):
    rng = np.random.default_rng(2)
    for m, n, k in [(1, 37, 77), (2, 64, 256), (5, 19, 2050), (33, 8, 40)]:
        w = mx.array(rng.normal(size=(n, k)).astype(np.float32)).astype(DTYPES[wdt])
        x = mx.array(rng.normal(size=(m, k)).astype(np.float32))
        want = np.array(x).astype(np.float64) @ np.array(w.astype(mx.float32)).astype(np.float64).T
        y = cpu.dense_matmul(x, w)
        assert y.dtype == mx.float32 and rel_err(y, want) < 2e-6
    g = mx.ones((33, 8))
    dx = mx.grad(lambda x_: (cpu.dense_matmul(x_, w) * g).sum())(x)
    assert rel_err(dx, np.array(g) @ np.array(w.astype(mx.float32)).astype(np.float64)) < 1e-6


@needs_native
@pytest.mark.parametrize("wdt", ["f32", "f16", "bf16"])
def test_dense_matmul_rows_do_not_depend_on_the_batch(wdt):
    """A token's row of y is the same bits whatever tokens share the call, so batched decoding
    gives the single sequence's logits (mlx-lm's test_many_batches compares them)."""
    rng = np.random.default_rng(3)
    for n, k in [(37, 77), (64, 256), (19, 2050)]:
        w = mx.array(rng.normal(size=(n, k)).astype(np.float32)).astype(DTYPES[wdt])
        x = mx.array(rng.normal(size=(9, k)).astype(np.float32))
        alone = np.concatenate([np.array(cpu.dense_matmul(x[i : i + 1], w)) for i in range(9)])
        for m in range(2, 10):
            assert np.array_equal(np.array(cpu.dense_matmul(x[:m], w)), alone[:m]), (m, n, k)
        shifted = np.array(cpu.dense_matmul(x[1:4], w))  # negative control: other tokens
        assert not np.array_equal(shifted, alone[:3])


@needs_native
def test_ternary_weight_is_the_dequantized_matrix():
    (x, p, s, b, kw), _ = make_case(1, 10, 333, "compact", "group", 128, mx.float32, False, False)
    w = cpu.ternary_weight(p, s, packing="compact", in_features=333, group_size=128)
    pt = fmt.PackedTernary("compact", np.array(p), np.array(s), 10, 333, 128)
    assert np.array_equal(np.array(w), pt.dequantize(np.float32))


@needs_native
def test_backend_dispatch(monkeypatch, cpu_default):
    assert dispatch.resolve_backend() == "native"  # CPU default device, extension built
    monkeypatch.setenv(dispatch.ENV_BACKEND, "reference")
    assert dispatch.resolve_backend() == "reference"
    monkeypatch.setenv(dispatch.ENV_BACKEND, "native")
    (x, p, s, b, kw), want = make_case(2, 9, 130, "compact", "row", None, mx.float32, True, True)
    assert rel_err(dispatch.ternary_matmul(x, p, s, b, **kw), want) < TOL["f32"]


@needs_native
def test_model_keeps_half_tables_and_matches_reference(tmp_path, cpu_default):
    """load() on the native backend: float16 embedding / lm_head stay float16 (half the
    bytes), the logits match the reference backend's float32 model."""
    from mlx.utils import tree_flatten
    from tiny import float_model

    from mlx_ternary.checkpoint.load import load_model
    from mlx_ternary.checkpoint.writers.ternary import save_model
    from mlx_ternary.runtime.cpu.tables import HalfEmbedding, HalfLinear
    from mlx_ternary.runtime.layers import ternarize_model

    model, config = float_model("llama")
    ternarize_model(model, "fast", "row", None, 8)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight.astype(mx.float16)
    model.lm_head.weight = model.lm_head.weight.astype(mx.float16)
    path = tmp_path / "m"
    save_model(model, config, path)
    nat, _ = load_model(path)
    ref, _ = load_model(path, backend="reference")
    assert isinstance(nat.model.embed_tokens, HalfEmbedding) and isinstance(nat.lm_head, HalfLinear)
    assert nat.lm_head.weight.dtype == mx.float16 and ref.lm_head.weight.dtype == mx.float32
    nbytes = lambda m: sum(v.nbytes for _, v in tree_flatten(m.parameters()))  # noqa: E731
    assert nbytes(nat) < 0.75 * nbytes(ref)
    tokens = mx.array([[1, 5, 9, 33, 70, 2]])
    a, r = np.array(nat(tokens)), np.array(ref(tokens))
    assert np.abs(a - r).max() < 1e-4 * np.abs(r).max()


# --------------------------------------------------------------------------- build & cache


def test_build_key_follows_mlx_version_and_sources(monkeypatch):
    mlx, nb = build.mlx_build(), build.nanobind()
    flags = build.ext_flags(mlx, nb)
    key = build.build_key(mlx, nb, "c++", flags)
    other = build.MlxBuild("0.0.1", mlx.include, mlx.libdir, mlx.library, mlx.core, False)
    assert build.build_key(other, nb, "c++", flags) != key
    assert build.build_key(mlx, nb, "g++", flags) != key
    monkeypatch.setattr(build, "sources", lambda: b"changed")
    assert build.build_key(mlx, nb, "c++", flags) != key


def test_changed_mlx_version_rebuilds_instead_of_loading(monkeypatch, tmp_path):
    """A cached library of this MLX is never loaded for another version: the key differs,
    so load() compiles (recorded here instead of run) a new one."""
    real = build.mlx_build()
    monkeypatch.setenv(CACHE_ENV["native"], str(tmp_path))
    calls = []
    monkeypatch.setattr(build, "compile_library", lambda path, *a, **k: calls.append(path))
    monkeypatch.setattr(
        build,
        "mlx_build",
        lambda: build.MlxBuild(
            "99.0.0", real.include, real.libdir, real.library, real.core, real.stable_abi
        ),
    )
    with pytest.raises(ImportError):
        build.load()  # the recorder wrote no library, so importing it fails
    assert len(calls) == 1 and "99.0.0" not in calls[0].name
    key_now = build.build_key(
        real, build.nanobind(), build.compiler(), build.ext_flags(real, build.nanobind())
    )
    assert key_now not in calls[0].name


@needs_native
def test_verify_refuses_a_library_built_for_another_mlx():
    module = cpu.require()
    build.verify(module, mx.__version__)  # the real one passes
    with pytest.raises(build.NativeBuildError, match="built for mlx"):
        build.verify(module, "99.0.0")


def test_nanobind_abi_mismatch_is_refused(tmp_path):
    mlx, nb = build.mlx_build(), build.nanobind()
    build.check_nanobind_abi(mlx, nb)
    fake = tmp_path / "core.so"
    fake.write_bytes(b"nanobind_system_libstdcpp_a1_v21 built with nanobind 2")
    old = build.MlxBuild(mlx.version, mlx.include, mlx.libdir, mlx.library, fake, False)
    with pytest.raises(build.NativeBuildError, match="nanobind"):
        build.check_nanobind_abi(old, nb)


def test_no_compiler_falls_back_to_reference_with_one_warning(tmp_path):
    """CXX naming a missing compiler and an empty cache: the pure-MLX path runs, one warning."""
    code = textwrap.dedent("""
        import warnings
        warnings.simplefilter("always")
        import mlx.core as mx
        from mlx_ternary.runtime import cpu, dispatch
        from mlx_ternary.checkpoint.load import load
        model, tok = load("mlx_ternary/assets/tiny-shakespeare")
        assert dispatch.resolve_backend() == "reference", dispatch.resolve_backend()
        mx.eval(model(mx.array([[1, 2, 3]])))
        assert not cpu.available() and "compiler" in cpu.unavailable_reason()
        print("ok")
    """)
    env = {**os.environ, CACHE_ENV["native"]: str(tmp_path), "CXX": str(tmp_path / "no-such-c++")}
    env.pop(build.ENV_CXX, None)
    root = str(ROOT)
    out = subprocess.run(
        [*PYTHON, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert out.stderr.count("NativeBackendWarning") == 1, out.stderr
    assert "the native CPU kernel is unavailable" in out.stderr


# --------------------------------------------------------------------------- llama.cpp row


def test_llamacpp_find_and_gguf_bytes(tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quants

    from mlx_ternary.bench import llamacpp
    from mlx_ternary.errors import TernaryError

    monkeypatch.delenv(llamacpp.ENV, raising=False)
    assert llamacpp.find(None) is None
    with pytest.raises(TernaryError, match="no node-llama-cpp"):
        llamacpp.find(str(tmp_path))
    (tmp_path / "node_modules" / "node-llama-cpp" / "dist").mkdir(parents=True)
    (tmp_path / "node_modules" / "node-llama-cpp" / "dist" / "index.js").write_text("")
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: "/bin/node")
    monkeypatch.setenv(llamacpp.ENV, str(tmp_path))
    assert llamacpp.find(None) == tmp_path / "node_modules"
    t = np.random.default_rng(0).integers(-1, 2, (4, 256)).astype(np.float32) * 0.5
    w = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tensor("a.weight", quants.quantize(t, Q.TQ2_0), raw_dtype=Q.TQ2_0)
    w.add_tensor("b.weight", np.ones(8, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert llamacpp.gguf_bytes(tmp_path / "m.gguf") == (4 * 66 + 32, 4 * 66, 1024)


@needs_native
def test_bench_adds_the_llamacpp_row(tmp_path, monkeypatch, cpu_default):
    """The row's runs come from llamacpp.run (faked: the suite never needs Node)."""
    import importlib.util

    from mlx_ternary.bench import formats as B
    from mlx_ternary.bench import llamacpp

    spec = importlib.util.spec_from_file_location(
        "make_synthetic_model", os.path.join(ROOT, "scripts", "fixtures", "make_synthetic_model.py")
    )
    syn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(syn)
    model = syn.write(tmp_path / "tiny", "tiny", seed=1)
    calls = []

    def fake_run(node, gguf, **kw):
        calls.append(kw)
        return {
            "runs": [{"prefill_tps": 100.0 + len(calls), "decode_tps": 40.0, "tokens": 2}],
            "peak_rss": 600_000_000,
            "threads": kw["threads"],
            "system": "",
        }

    monkeypatch.setattr(llamacpp, "find", lambda d=None: tmp_path)
    monkeypatch.setattr(llamacpp, "run", fake_run)
    monkeypatch.setattr(llamacpp, "gguf_bytes", lambda p: (4_000_000, 1_000_000, 3_878_788))
    r = B.run_bench(
        str(model),
        ("fast",),
        prompt_tokens=4,
        gen_tokens=2,
        repeats=2,
        llama_cpp="x",
        gguf=str(tmp_path / "m.gguf"),
        llama_threads=2,
    )
    row = r.formats[-1]
    assert [f.name for f in r.formats] == ["fast", "llama.cpp"] and row.loads
    assert [x.prefill_tps for x in row.runs] == [101.0, 102.0]
    assert all(x.peak_bytes == 600_000_000 for x in row.runs)
    assert calls[0] == dict(threads=2, prompt_tokens=4, gen_tokens=2, seed=0, vocab=256)
    assert row.bits_per_weight == pytest.approx(8 * 1_000_000 / 3_878_788)
    assert any(cells[0] == "llama.cpp" and "2 threads" in cells[2] for cells in B.table_rows(r))
    r = B.run_bench(str(model), ("fast",), prompt_tokens=4, gen_tokens=2, repeats=1, llama_cpp="x")
    assert not r.formats[-1].loads and "--gguf" in r.formats[-1].reason


# --------------------------------------------------------------------------- attention


def _qkv(b, hq, hkv, lq, lk, d, seed=0):
    rng = np.random.default_rng(seed)
    # queries as mlx-lm makes them: (B, L, H, D) transposed, a strided view
    q = mx.array(rng.normal(size=(b, lq, hq, d)).astype(np.float32)).transpose(0, 2, 1, 3)
    k = mx.array(rng.normal(size=(b, hkv, lk + 3, d)).astype(np.float32))[:, :, :lk]
    v = mx.array(rng.normal(size=(b, hkv, lk, d)).astype(np.float32))
    return q, k, v


@needs_native
@pytest.mark.parametrize(
    "shape",
    [
        (1, 8, 2, 7, 7, 64),
        (2, 4, 4, 3, 11, 40),
        (1, 6, 3, 1, 9, 128),
        (1, 4, 1, 33, 40, 64),
        (1, 16, 2, 1, 100, 64),
    ],
    ids=lambda s: "-".join(map(str, s)),
)
@pytest.mark.parametrize("mask", [None, "causal"])
def test_attention_matches_mlx_and_float64(shape, mask):
    from mlx_ternary.runtime.cpu.attention import scaled_dot_product_attention as sdpa

    b, hq, hkv, lq, lk, d = shape
    q, k, v = _qkv(*shape)
    y = sdpa(q, k, v, scale=d**-0.5, mask=mask)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask)
    qn, kn, vn = (np.array(a).astype(np.float64) for a in (q, k, v))
    kn, vn = np.repeat(kn, hq // hkv, axis=1), np.repeat(vn, hq // hkv, axis=1)
    s = qn @ kn.transpose(0, 1, 3, 2) * d**-0.5
    if mask == "causal":  # query i sees keys j <= i + lk - lq
        s = np.where(np.arange(lk)[None] <= np.arange(lq)[:, None] + lk - lq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vn
    assert np.abs(np.array(y) - want).max() < 1e-5
    assert np.abs(np.array(y) - np.array(ref)).max() < 1e-5


@needs_native
@pytest.mark.parametrize(
    "shape",
    [
        (1, 8, 2, 1, 600, 64),
        (1, 32, 4, 1, 300, 64),
        (2, 20, 5, 1, 300, 128),
        (1, 8, 2, 40, 600, 64),
        (3, 4, 4, 2, 9, 40),
    ],
    ids=lambda s: "-".join(map(str, s)),
)
def test_attention_reads_float16_keys_and_values(shape):
    """The fused block's 16-bit cache: float16 K/V against MLX's attention and float64 on the
    same values widened, across chunks of keys (decode: chunks on several tasks; prefill:
    chunks merged in each task); a left-padded row over a chunk boundary keeps the bits of
    its sequence alone."""
    from mlx_ternary.runtime.cpu.attention import scaled_dot_product_attention as sdpa

    b, hq, hkv, lq, lk, d = shape
    q, k, v = _qkv(*shape, seed=7)
    kh, vh = k.astype(mx.float16), v.astype(mx.float16)
    y = sdpa(q, kh, vh, scale=d**-0.5, mask="causal")
    kf, vf = kh.astype(mx.float32), vh.astype(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, kf, vf, scale=d**-0.5, mask="causal")
    assert y.dtype == mx.float32
    assert np.abs(np.array(y) - np.array(ref)).max() < 1e-5
    assert (
        np.abs(np.array(y) - np.array(sdpa(q, kf, vf, scale=d**-0.5, mask="causal"))).max() < 1e-5
    )
    assert np.abs(np.array(y) - np.array(sdpa(q, k, v, scale=d**-0.5, mask="causal"))).max() > 1e-5
    pad = lk // 2 + 1  # row 0 left-padded past the first chunk boundary
    causal = np.arange(lk)[None] <= np.arange(lq)[:, None] + lk - lq
    padded = mx.array((causal & (np.arange(lk) >= pad))[None, None])
    rows = sdpa(q[:1], kh[:1], vh[:1], scale=d**-0.5, mask=padded)
    alone = sdpa(q[:1], kh[:1, :, pad:], vh[:1, :, pad:], scale=d**-0.5, mask="causal")
    assert np.array_equal(np.array(rows), np.array(alone))
    assert sdpa(q, kh, v, scale=d**-0.5) is None  # mixed K/V dtypes: MLX's


@needs_native
def test_attention_gradient_is_mlx_own_and_arrays_masks_fall_back():
    from mlx_ternary.runtime.cpu.attention import scaled_dot_product_attention as sdpa

    q, k, v = _qkv(1, 4, 2, 5, 5, 64, seed=1)
    g = mx.array(np.random.default_rng(2).normal(size=(1, 4, 5, 64)).astype(np.float32))

    def loss(fn):
        return lambda q_, k_, v_: (fn(q_, k_, v_) * g).sum()

    ours = mx.grad(loss(lambda *a: sdpa(*a, scale=0.125, mask="causal")), argnums=(0, 1, 2))(
        q, k, v
    )
    mlxs = mx.grad(
        loss(lambda *a: mx.fast.scaled_dot_product_attention(*a, scale=0.125, mask="causal")),
        argnums=(0, 1, 2),
    )(q, k, v)
    for a, b in zip(ours, mlxs):
        assert np.allclose(np.array(a), np.array(b), atol=1e-5)
    assert sdpa(q, k, v, scale=0.125, mask=mx.zeros((5, 5))) is None  # array masks: MLX's


@needs_native
@pytest.mark.parametrize("n, pad", [(41, 5), (64, 13), (300, 37)])
def test_a_left_padded_prefill_row_is_its_sequence_alone(n, pad):
    """Prefill (Lq = Lk) long enough for the vector softmax and (300) for two chunks of keys:
    each row's keys after its own are masked too, its task's other rows differ from those it
    has alone, and none of it may change the row's bits against the sequence run alone; in a
    batch with the unpadded sequence (bool mask against "causal") and under a sliding window
    (every row its own first key) too. A row that sees one key more differs (the control)."""
    from mlx_ternary.runtime.cpu.attention import scaled_dot_product_attention as sdpa

    hq, hkv, d = 4, 2, 64
    qp, kp, vp = _qkv(1, hq, hkv, n, n, d, seed=6)
    alone = sdpa(qp[:, :, pad:], kp[:, :, pad:], vp[:, :, pad:], scale=0.125, mask="causal")
    i, j = np.arange(n)[:, None], np.arange(n)[None]
    padded = mx.array((j <= i) & (j >= pad))[None, None]
    rows = sdpa(qp, kp, vp, scale=0.125, mask=padded)
    assert np.abs(np.array(rows[:, :, pad:]) - np.array(alone)).max() < 1e-5  # close: always
    assert np.array_equal(np.array(rows[:, :, pad:]), np.array(alone)), (n, pad)

    m = n - pad  # a batch: the sequence left-padded, and the same sequence unpadded
    q2, k2, v2 = (
        mx.concatenate([a, mx.pad(a[:, :, pad:], [(0, 0), (0, 0), (0, pad), (0, 0)])])
        for a in (qp, kp, vp)
    )
    both = mx.concatenate([padded, mx.array((j <= i) & (j < m))[None, None]])
    two = sdpa(q2, k2, v2, scale=0.125, mask=both)
    assert np.array_equal(np.array(two[:1, :, pad:]), np.array(alone))
    assert np.array_equal(np.array(two[1:, :, :m]), np.array(alone))

    w = 19  # a sliding window: each row's first key is its own
    window = (j <= i) & (j > i - w)
    slid = sdpa(qp, kp, vp, scale=0.125, mask=mx.array(window & (j >= pad))[None, None])
    slid_alone = sdpa(
        qp[:, :, pad:],
        kp[:, :, pad:],
        vp[:, :, pad:],
        scale=0.125,
        mask=mx.array(window[pad:, pad:])[None, None],
    )
    assert np.array_equal(np.array(slid[:, :, pad:]), np.array(slid_alone))

    more = sdpa(qp, kp, vp, scale=0.125, mask=mx.array((j <= i) & (j >= pad - 1))[None, None])
    assert not np.array_equal(np.array(more[:, :, pad:]), np.array(alone))


def test_attention_bool_masks_drop_keys_and_a_padded_row_is_its_sequence_alone():
    """mlx-lm's batches mask causal + left padding with a bool array: the kernel matches MLX and
    float64 on a random mask, gives a left-padded batch row the bits of the sequence run
    alone (causal), 0 for a row with no key, and MLX's gradient."""
    from mlx_ternary.runtime.cpu.attention import scaled_dot_product_attention as sdpa

    b, hq, hkv, lq, lk, d = 2, 4, 2, 6, 9, 64
    q, k, v = _qkv(b, hq, hkv, lq, lk, d, seed=3)
    mask = mx.array(np.random.default_rng(4).random((b, 1, lq, lk)) < 0.6)
    mask[:, :, :, 0] = True
    y = sdpa(q, k, v, scale=0.125, mask=mask)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    kn = np.repeat(np.array(k).astype(np.float64), hq // hkv, axis=1)
    vn = np.repeat(np.array(v).astype(np.float64), hq // hkv, axis=1)
    s = np.array(q).astype(np.float64) @ kn.transpose(0, 1, 3, 2) * 0.125
    p = np.exp(np.where(np.array(mask), s, -np.inf) - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vn
    assert np.abs(np.array(y) - want).max() < 1e-5
    assert np.abs(np.array(y) - np.array(ref)).max() < 1e-5
    assert np.abs(np.array(y) - np.array(sdpa(q, k, v, scale=0.125))).max() > 1e-3  # it masks

    pad = 3  # batch row 1 = the 6-key sequence of row 0's last keys, left-padded by 3 keys
    alone = sdpa(q[:1, :, 3:], k[:1, :, pad:], v[:1, :, pad:], scale=0.125, mask="causal")
    causal = np.arange(lk)[None] <= np.arange(lq)[:, None] + lk - lq
    padded = mx.array((causal & (np.arange(lk) >= pad))[None, None])
    rows = sdpa(q[:1], k[:1], v[:1], scale=0.125, mask=padded)
    assert np.array_equal(np.array(rows[:, :, 3:]), np.array(alone))
    none = mx.zeros((1, 1, lq, lk), dtype=mx.bool_)
    assert not np.array(sdpa(q[:1], k[:1], v[:1], scale=0.125, mask=none)).any()
    g = mx.array(np.random.default_rng(5).normal(size=y.shape).astype(np.float32))
    grads = [
        mx.grad(lambda q_, k_, v_: (fn(q_, k_, v_) * g).sum(), argnums=(0, 1, 2))(q, k, v)
        for fn in (
            lambda *a: sdpa(*a, scale=0.125, mask=mask),
            lambda *a: mx.fast.scaled_dot_product_attention(*a, scale=0.125, mask=mask),
        )
    ]
    for a, r in zip(*grads):
        assert np.allclose(np.array(a), np.array(r), atol=1e-5)


@needs_native
def test_attention_is_routed_only_while_the_model_runs(tmp_path, monkeypatch, cpu_default):
    """install(): the model's own calls use the native kernel; the same mlx-lm function called
    outside the model (another model, user code) stays MLX's."""
    import mlx_lm.models.llama as llama
    from tiny import ternary_checkpoint

    from mlx_ternary.checkpoint.load import load_model
    from mlx_ternary.runtime.cpu import attention, block

    monkeypatch.setenv(block.ENV_FUSED, "0")  # the fused block has its own (test_block.py)
    path, _ = ternary_checkpoint(tmp_path, "llama", "fast", "row", activation_bits=8)
    model, _ = load_model(path)
    ref, _ = load_model(path, backend="reference")
    calls = []
    real = attention.attention_kernel
    monkeypatch.setattr(
        attention,
        "attention_kernel",
        lambda scale, causal: calls.append(causal) or real(scale, causal),
    )
    ids = mx.array([[1, 5, 9, 33, 70, 2, 4]])
    a, r = np.array(model(ids)), np.array(ref(ids))
    assert calls == [True, True]  # two layers, causal prefill
    assert np.abs(a - r).max() < 1e-4 * np.abs(r).max()
    assert attention.routed(model) and not attention.routed(ref)  # what the memory plan reads
    q, k, v = _qkv(1, 4, 2, 3, 3, 16)
    llama.scaled_dot_product_attention(q, k, v, cache=None, scale=0.25, mask="causal")
    assert calls == [True, True]  # not routed outside the model's call


# --------------------------------------------------------------------------- SwiGLU


@needs_native
def test_swiglu_matches_float64_and_mlx():
    """The native silu(g) * x: within 2 ulp of float64 over the float range (big, tiny, zero
    and odd-length inputs), close to MLX's own; the gradient is MLX's."""
    import mlx.nn as nn

    from mlx_ternary.runtime.cpu import activation

    rng = np.random.default_rng(3)
    g = np.concatenate([rng.normal(0, 4, 4099), np.linspace(-90, 90, 2001), [0.0, -0.0, 1e-30]])
    g = g.astype(np.float32)
    x = rng.normal(size=g.shape).astype(np.float32)
    y = np.array(cpu.swiglu(mx.array(g), mx.array(x)))
    g64, x64 = g.astype(np.float64), x.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * x64
    big = np.abs(want) > 1e-30
    assert (np.abs(y - want)[big] / np.abs(want)[big]).max() < 4e-7
    assert np.abs(y - want)[~big].max() < 1e-30
    mlx = np.array(nn.silu(mx.array(g)) * mx.array(x))
    assert np.abs(y - mlx).max() <= 4e-7 * np.abs(mlx).max()
    assert np.abs(y - g * x).max() > 1.0  # negative control: the gate matters
    gm, xm = mx.array(g[:64].reshape(8, 8)), mx.array(x[:64].reshape(8, 8))
    ours = mx.grad(lambda a, b: activation.swiglu_kernel()(a, b).sum(), argnums=(0, 1))(gm, xm)
    mlxs = mx.grad(lambda a, b: (nn.silu(a) * b).sum(), argnums=(0, 1))(gm, xm)
    for a, b in zip(ours, mlxs):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    with pytest.raises(ValueError, match="swiglu takes two float32 arrays of one shape"):
        cpu.swiglu(mx.array(g), mx.array(x[:-1]))


@needs_native
def test_swiglu_is_routed_only_while_the_model_runs(tmp_path, monkeypatch, cpu_default):
    """install(): the model's MLPs call the native SwiGLU; mlx-lm's `swiglu` called outside
    the model stays MLX's."""
    import mlx_lm.models.llama as llama
    from tiny import ternary_checkpoint

    from mlx_ternary.checkpoint.load import load_model
    from mlx_ternary.runtime import cpu as cpu_pkg
    from mlx_ternary.runtime.cpu import activation, block

    monkeypatch.setenv(block.ENV_FUSED, "0")  # the fused block has its own (test_block.py)
    path, _ = ternary_checkpoint(tmp_path, "llama", "fast", "row", activation_bits=8)
    model, _ = load_model(path)
    ref, _ = load_model(path, backend="reference")
    calls = []
    real = cpu_pkg.swiglu
    monkeypatch.setattr(activation, "swiglu", lambda g, x: calls.append(g.shape) or real(g, x))
    ids = mx.array([[1, 5, 9, 33, 70, 2, 4]])
    a, r = np.array(model(ids)), np.array(ref(ids))
    assert len(calls) == 2  # two layers
    assert np.abs(a - r).max() < 1e-4 * np.abs(r).max()
    assert activation.routed(model) and not activation.routed(ref)
    g = mx.array(np.linspace(-3, 3, 12, dtype=np.float32))
    out = llama.swiglu(g, g)
    assert len(calls) == 2  # not routed outside the model's call
    np.testing.assert_allclose(np.array(out), np.array(g * mx.sigmoid(g) * g), rtol=1e-6)
