"""The project's Metal kernels, run through the CPU emulator, against float64 numpy and the
reference twins; dispatch; the packed-weight read ratios; a tiny model's greedy tokens."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_ternary import format as fmt
from mlx_ternary.runtime import dispatch
from mlx_ternary.runtime.metal import geometry, launch, sources
from mlx_ternary.runtime.metal.sources import kernel_source, metal_dir, read_source

# Max |kernel - float64 reference| / max |reference|, per activation dtype: the output's own
# rounding plus float32 accumulation (the "offset" fast decode adds ~1e-4).
TOL = {mx.float32: 2e-4, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}
DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


def make_case(m, n, k, packing, scale, group_size, dtype, act, bias, seed=0):
    """Random trits, scales, x (and bias) plus the float64 answer computed in numpy."""
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    gs = group_size if scale == "group" else None
    s = rng.uniform(0.5, 1.5, size=fmt.scales_shape(scale, n, k, gs)).astype(np.float32)
    pt = fmt.PackedTernary.from_trits(t, s, packing, gs)
    x = mx.array(rng.normal(size=(m, k)).astype(np.float32)).astype(dtype)
    b = mx.array(rng.normal(size=(n,)).astype(np.float32)) if bias else None
    x64 = np.array(x.astype(mx.float32)).astype(np.float64)
    if act:
        # float32 arithmetic, as the kernels do it: 127 / absmax, round half to even.
        x32 = x64.astype(np.float32)
        sc = np.float32(127) / np.maximum(np.abs(x32).max(-1, keepdims=True), np.float32(1e-5))
        xq = np.clip(np.rint(x32 * sc), -128, 127).astype(np.float64)
        want = (xq @ pt.dequantize(np.float64).T) / sc.astype(np.float64)
    else:
        want = x64 @ pt.dequantize(np.float64).T
    if bias:
        want = want + np.array(b).astype(np.float64)
    return dict(
        x=x,
        packed=mx.array(pt.packed),
        scales=mx.array(s),
        bias=b,
        packing=packing,
        in_features=k,
        group_size=gs,
        activation_bits=8 if act else None,
    ), want


def rel_err(y, want):
    got = np.array(y.astype(mx.float32)).astype(np.float64)
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


# (M, N, K, scale, group, dtype, act, bias): K not a multiple of 32, 5 or the group, or a
# multiple of 16 (the KALIGN/vector-load variant); N not a multiple of the row tiles; every
# token split of the GEMV (1-4 tokens per threadgroup, 2-4 threadgroups deep up to M = 16)
# and the scale granularities.
GEMV_CASES = [
    (1, 13, 77, "tensor", None, "f32", False, False),
    (2, 9, 130, "row", None, "f16", False, True),
    (3, 17, 200, "group", 64, "bf16", False, False),
    (7, 11, 333, "group", 128, "f32", True, True),
    (8, 20, 270, "group", 256, "f16", True, False),
    (1, 40, 601, "row", None, "bf16", True, False),
    (4, 5, 1030, "group", 64, "f32", False, True),
    (1, 24, 256, "row", None, "f16", False, False),
    (5, 19, 640, "group", 128, "f32", False, True),
    (2, 16, 512, "tensor", None, "bf16", True, True),
    (12, 21, 384, "row", None, "f16", True, False),
    (16, 10, 176, "group", 64, "bf16", False, False),
]


@pytest.mark.parametrize("decode", launch.FAST_DECODES)
@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gemv_fast(case, decode):
    m, n, k, scale, g, dt, act, bias = case
    kw, want = make_case(m, n, k, "fast", scale, g, DTYPES[dt], act, bias)
    y = launch.ternary_matmul(**kw, backend="emulate", decode=decode)
    tol = TOL[DTYPES[dt]] * (5 if decode == "offset" and dt == "f32" and not act else 1)
    assert rel_err(y, want) < tol
    assert y.dtype == DTYPES[dt] and y.shape == (m, n)


@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gemv_compact(case):
    m, n, k, scale, g, dt, act, bias = case
    kw, want = make_case(m, n, k, "compact", scale, g, DTYPES[dt], act, bias, seed=1)
    y = launch.ternary_matmul(**kw, backend="emulate")
    assert rel_err(y, want) < TOL[DTYPES[dt]]


# gemv_compact's lanes per row (geometry.compact_unit_lanes): K chosen so each WL runs, with
# several super-steps and a partial last unit (group 64: 4 blocks per unit, edges inside words).
COMPACT_LANE_CASES = [  # (WL, m, K, scale, group)
    (8, 3, 1800, "group", 64),
    (4, 16, 1000, "row", None),
    (2, 2, 1030, "group", 128),
]


@pytest.mark.parametrize("case", COMPACT_LANE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gemv_compact_at_every_unit_lane_count(case):
    wl, m, k, scale, g = case
    kw, want = make_case(m, 70, k, "compact", scale, g, mx.float32, False, True, seed=3)
    tb = fmt.TRITS_PER_BYTE  # valid bytes per row: whole blocks of ceil(G / 5) bytes
    valid = math.ceil(k / g) * math.ceil(g / tb) if g else math.ceil(k / tb)
    assert geometry.compact_layout(valid) == (wl, 2 * wl)
    y = launch.ternary_matmul(**kw, backend="emulate")
    assert rel_err(y, want) < TOL[mx.float32]


GEMM_CASES = [
    (9, 33, 77, "tensor", None, "f32", False, True),
    (16, 31, 130, "group", 64, "f16", True, False),
    (33, 20, 150, "row", None, "bf16", False, False),
    (64, 45, 260, "group", 256, "f32", True, True),
    (70, 12, 200, "group", 128, "f16", False, False),
    (17, 40, 256, "row", None, "f16", False, True),
]


@pytest.mark.parametrize("kernel", ["gemm", "gemm_fma"])
@pytest.mark.parametrize("packing", fmt.PACKINGS)
@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gemm(case, packing, kernel):
    m, n, k, scale, g, dt, act, bias = case
    kw, want = make_case(m, n, k, packing, scale, g, DTYPES[dt], act, bias, seed=2)
    y = launch.ternary_matmul(**kw, backend="emulate", kernel=kernel)
    assert rel_err(y, want) < TOL[DTYPES[dt]]


@pytest.mark.parametrize("kernel", ["gemm", "gemm_fma"])
def test_gemm_half_tiles_with_fp16_group_scales(kernel):
    """float16 x and float16 group scales: t * s is exact in half, so the tiles are half."""
    kw, _ = make_case(40, 24, 256, "fast", "group", 64, mx.float16, False, True, seed=8)
    kw["scales"] = kw["scales"].astype(mx.float16)
    spec = launch.check_layer(
        kw["packed"],
        kw["scales"],
        kw["bias"],
        packing="fast",
        in_features=256,
        group_size=64,
        activation_bits=None,
    )
    gemm = launch.gemm_launch(
        spec,
        kw["packed"],
        kw["scales"],
        kw["bias"],
        mx.float16,
        mx.float16,
        40,
        kernel == "gemm",
        "emulate",
    )
    assert ("TT", mx.float16) in gemm.template
    t = fmt.unpack_fast(np.array(kw["packed"]), 256).astype(np.float64)
    w = t * np.repeat(np.array(kw["scales"].astype(mx.float32)), 64, axis=1)
    want = np.array(kw["x"].astype(mx.float32)).astype(np.float64) @ w.T + np.array(kw["bias"])
    y = launch.ternary_matmul(**kw, backend="emulate", kernel=kernel)
    assert rel_err(y, want) < TOL[mx.float16]


@pytest.mark.parametrize("packing", fmt.PACKINGS)
def test_gemm_small_m_matches_gemv(packing):
    kw, want = make_case(3, 19, 150, packing, "group", 64, mx.float32, False, True, seed=3)
    a = launch.ternary_matmul(**kw, backend="emulate", kernel="gemm")
    b = launch.ternary_matmul(**kw, backend="emulate", kernel="gemv")
    assert rel_err(a, want) < 2e-4 and rel_err(b, want) < 2e-4


@pytest.mark.parametrize("packing", fmt.PACKINGS)
def test_kernel_matches_reference_twin(packing):
    kw, want = make_case(2, 24, 190, packing, "group", 128, mx.float32, True, True, seed=4)
    y = dispatch.ternary_matmul(**kw, backend="emulate")
    twin = dispatch.ternary_matmul(**kw, backend="reference")
    assert rel_err(twin, want) < 2e-4
    assert rel_err(y, np.array(twin).astype(np.float64)) < 2e-4


def test_negative_control_detects_a_wrong_weight():
    kw, want = make_case(1, 16, 100, "fast", "row", None, mx.float32, False, False, seed=5)
    t = fmt.unpack_fast(np.array(kw["packed"]), 100)
    t[3, 7] = -1 if t[3, 7] != -1 else 1
    kw["packed"] = mx.array(fmt.pack_fast(t))
    y = launch.ternary_matmul(**kw, backend="emulate")
    assert rel_err(y, want) > 1e-2


@pytest.mark.parametrize("decode", launch.FAST_DECODES)
def test_int8_activations_are_exact(decode):
    # Integer activations and unit scales: every product and sum is an integer in float32,
    # with either decode (the offset decode's 2^(10-2p) terms cancel exactly).
    kw, want = make_case(2, 8, 96, "fast", "tensor", None, mx.float32, True, False, seed=6)
    kw["scales"] = mx.ones((1, 1))
    x32 = np.array(kw["x"])
    sc = np.float32(127) / np.abs(x32).max(-1, keepdims=True)
    xq = np.clip(np.rint(x32 * sc), -128, 127)
    t = fmt.unpack_fast(np.array(kw["packed"]), 96).astype(np.float64)
    exact = (xq @ t.T) * (np.float32(1) / sc)
    y = np.array(launch.ternary_matmul(**kw, backend="emulate", decode=decode))
    np.testing.assert_allclose(y, exact, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_prepass_matches_numpy(dtype):
    """The prefill pre-pass's quantized x and inverse scale, exactly."""
    m, k = 3, 200
    rng = np.random.default_rng(9)
    x = mx.array(rng.normal(size=(m, k)).astype(np.float32) * 3).astype(DTYPES[dtype])
    kw, _ = make_case(m, 8, k, "fast", "row", None, DTYPES[dtype], True, False)
    spec = launch.check_layer(
        kw["packed"],
        kw["scales"],
        None,
        packing="fast",
        in_features=k,
        group_size=None,
        activation_bits=8,
    )
    pre = launch.prepass_launch(spec, x.dtype, m, "emulate")
    xq, aux = pre(x, [(m, k), (m, 1)])
    x32 = np.array(x.astype(mx.float32))
    sc = np.float32(127) / np.maximum(np.abs(x32).max(-1, keepdims=True), np.float32(1e-5))
    want = np.clip(np.rint(x32 * sc), -128, 127)
    np.testing.assert_array_equal(np.array(xq.astype(mx.float32)), want)
    np.testing.assert_array_equal(np.array(aux), np.float32(1) / sc)


# --------------------------------------------------------------------------- #
# Validation and dispatch (no emulator launches)
# --------------------------------------------------------------------------- #


def test_validation_names_the_rule():
    kw, _ = make_case(1, 8, 64, "fast", "row", None, mx.float32, False, False)
    with pytest.raises(ValueError, match="in_features"):
        launch.ternary_matmul(**{**kw, "x": mx.zeros((1, 63))}, backend="emulate")
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        launch.ternary_matmul(**{**kw, "x": mx.zeros((1, 64), mx.int32)}, backend="emulate")
    with pytest.raises(ValueError, match="uint32 of shape"):
        launch.ternary_matmul(**{**kw, "packed": kw["packed"].astype(mx.uint8)}, backend="emulate")
    with pytest.raises(ValueError, match="scales must be"):
        launch.ternary_matmul(**{**kw, "scales": mx.ones((8, 3))}, backend="emulate")
    with pytest.raises(ValueError, match="bias must be"):
        launch.ternary_matmul(**{**kw, "bias": mx.ones((7,))}, backend="emulate")
    with pytest.raises(ValueError, match="at most 16 tokens"):
        launch.ternary_matmul(**{**kw, "x": mx.zeros((17, 64))}, backend="emulate", kernel="gemv")
    with pytest.raises(ValueError, match="decode must be one of"):
        launch.ternary_matmul(**kw, backend="emulate", decode="table")


def test_dispatch(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    monkeypatch.delenv(dispatch.ENV_EMULATE, raising=False)
    assert dispatch.resolve_backend("emulate") == "emulate"
    monkeypatch.setenv(dispatch.ENV_BACKEND, "emulate")
    assert dispatch.resolve_backend() == "emulate"
    assert dispatch.resolve_backend("reference") == "reference"
    monkeypatch.setenv(dispatch.ENV_BACKEND, "reference")
    monkeypatch.setenv(dispatch.ENV_EMULATE, "1")
    assert dispatch.resolve_backend() == "emulate"
    assert dispatch.DEFAULT_PACKING in fmt.PACKINGS


def test_every_source_states_its_mapping_and_splits():
    names = sorted(p.name for p in metal_dir().glob("*.metal") if p.name != sources.COMMON)
    assert names == ["gemm.metal", "gemv_compact.metal", "gemv_fast.metal", "prepass.metal"]
    assert sources.BODY_MARKER not in read_source(sources.COMMON)
    for name in names:
        text = read_source(name)
        header, body = launch.split_source(text)
        assert header.startswith("//") and "Thread mapping" in header
        assert "[[kernel]]" not in body and body.strip()


def test_geometry_is_named_once_in_python():
    # The tile sizes and TERNARY_UNROLL reach the sources only through the generated prelude:
    # no .metal file defines a macro, and every prelude macro is used by some kernel.
    texts = {p.name: p.read_text() for p in metal_dir().glob("*.metal")}
    used = set()
    for name, text in texts.items():
        assert "#define" not in text, name
        used |= {m for m in geometry.macro_names() if m in text}
        if name != sources.COMMON:
            header, _ = kernel_source(name[: -len(".metal")])
            assert header.startswith(geometry.prelude() + read_source(sources.COMMON))
    assert used == set(geometry.macro_names())
    for tm in geometry.GEMV_TOKEN_TILES:  # every GEMV layout covers GEMV_TG_ROWS rows
        rl, nsg = geometry.gemv_layout(tm)
        assert nsg * rl * geometry.SIMD_WIDTH // geometry.GEMV_WORD_LANES == geometry.GEMV_TG_ROWS
        assert rl * tm <= geometry.GEMV_LANE_ACCUMULATORS
    # gemv_compact: one row per lane; a unit is whole words and whole blocks of every group.
    unit = geometry.COMPACT_UNIT_BYTES
    assert unit % fmt.ROW_ALIGN_BYTES == 0
    assert all(unit % -(-g // fmt.TRITS_PER_BYTE) == 0 for g in fmt.TERNARY_GROUP_SIZES)
    for vb in range(1, 40 * unit, 7):
        wl, nsg = geometry.compact_layout(vb)
        assert wl in geometry.COMPACT_UNIT_LANES
        assert nsg * geometry.SIMD_WIDTH // wl == geometry.GEMV_TG_ROWS


# --------------------------------------------------------------------------- #
# Packed-weight bytes read per token, from the emulator's counters
# --------------------------------------------------------------------------- #


def weight_read_ratio(packing, m, decode=None, kernel=None, n=64, k=640):
    """Packed-weight bytes the kernel read / (tokens * packed bytes)."""
    kw, want = make_case(m, n, k, packing, "row", None, mx.float32, False, False, seed=7)
    kernel = launch.choose_kernel(m, kernel)
    kernel_obj = launch.get_kernel(
        "gemm" if kernel.startswith("gemm") else f"gemv_{packing}", "emulate"
    )
    y = launch.ternary_matmul(**kw, backend="emulate", decode=decode, kernel=kernel)
    assert rel_err(y, want) < 2e-4
    read = kernel_obj.last_stats["wq"]["read"]
    return read / (m * kw["packed"].nbytes)


@pytest.mark.parametrize(
    "packing,decode", [("fast", "offset"), ("fast", "exact"), ("compact", "fraction")]
)
def test_decode_reads_weights_once_at_every_m(packing, decode):
    # One threadgroup holds every token: each packed byte is read once per call, M = 1...16.
    for m in range(1, launch.MAX_GEMV_TOKENS + 1):
        r = weight_read_ratio(packing, m, decode, n=70, k=330) * m
        assert math.isclose(r, 1.0, rel_tol=1e-9), (packing, decode, m, r)


@pytest.mark.parametrize("kernel", ["gemm", "gemm_fma"])
@pytest.mark.parametrize("packing", fmt.PACKINGS)
def test_prefill_reads_weights_once_per_64_tokens(packing, kernel):
    r = weight_read_ratio(packing, 64, kernel=kernel)
    assert r <= 1 / 32
    assert math.isclose(r, 1 / 64, rel_tol=1e-6), r
    assert math.isclose(weight_read_ratio(packing, 33, kernel=kernel), 1 / 33, rel_tol=1e-6)


def call_reads(packing, act, m, k, n, dtype=mx.float16, seed=12):
    """(packed-weight bytes, all device bytes, launches) of one call, summed over its
    launches, from the emulator's counters."""
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    pt = fmt.PackedTernary.from_trits(t, np.ones((n, 1), np.float32), packing, None)
    packed, scales = mx.array(pt.packed), mx.ones((n, 1), dtype=mx.float16)
    x = mx.array(rng.normal(size=(m, k)).astype(np.float32)).astype(dtype)
    spec = launch.check_layer(
        packed, scales, None, packing=packing, in_features=k, group_size=None, activation_bits=act
    )
    run, variants = launch.prepare(spec, packed, scales, None, dtype, (m, k), "emulate")
    run(x)
    stats = [launch.get_kernel(v[0], "emulate").last_stats for v in variants]  # one per launch
    weights = sum(st["wq"]["read"] for st in stats if "wq" in st)
    total = sum(v["read"] for st in stats for v in st.values())
    return weights, total, len(variants)


@pytest.mark.parametrize("act", [None, 8])
@pytest.mark.parametrize("packing", fmt.PACKINGS)
def test_decode_bytes_against_the_gemm_and_the_old_gemv(packing, act):
    """Issue 30's byte targets, emulator counts (fp16 x): the packed weights are read once at
    M = 1 and 16 alike; a 16-token call reads no more than the 17-token GEMM call; and a
    1-token call reads less than the old GEMV's floor (every SIMD group of 4 rows read all
    of x: >= ceil(N / 4) K 2 bytes of x besides the weights). The 2560 x 2560, 2560 -> 6912
    and 4096 x 4096 figures: scripts/bench/kernel_bytes.py --check."""
    k, n = 640, 192
    w1, t1, l1 = call_reads(packing, act, 1, k, n)
    w16, t16, l16 = call_reads(packing, act, 16, k, n)
    w17, t17, l17 = call_reads(packing, act, 17, k, n)
    assert w1 == w16 == w17  # one pass over the weights (the GEMM's 64-token tile too)
    assert t16 <= t17, (t16, t17)
    assert t1 < w1 + math.ceil(n / 4) * k * 2, (t1, w1)
    assert l1 == l16 == 1 and l17 == (2 if act else 1)  # the pre-pass only for prefill


def test_one_launch_per_decode_call_at_every_m(monkeypatch):
    """M <= 16: one kernel launch per call, int8 activations included (counted on the
    kernels' own calls); M = 17 with int8 activations: the pre-pass and the GEMM."""
    calls = []

    class Counting:
        def __init__(self, factory):
            self.factory = factory

        def __call__(self, **kw):
            kernel = self.factory(**kw)

            def run(**call):
                calls.append(kw["name"])
                return kernel(**call)

            return run

    counting = Counting(launch.kernel_factory("emulate"))
    monkeypatch.setattr(launch, "kernel_factory", lambda backend: counting)
    for packing in fmt.PACKINGS:
        for m in (1, 2, 5, 16, 17):
            kw, want = make_case(m, 20, 96, packing, "row", None, mx.float32, True, False)
            del calls[:]
            y = launch.ternary_matmul(**kw, backend="emulate")
            assert rel_err(y, want) < 2e-4
            assert len(calls) == (1 if m <= 16 else 2), (packing, m, calls)


TWIN_CASES = [  # (packing, scale, group, act, K odd)
    ("fast", "row", None, True, 331),
    ("fast", "group", 64, False, 333),
    ("compact", "row", None, False, 331),
    ("compact", "group", 128, True, 333),
    # compact: block edges inside a unit word at G = 128 and 64 (two chains; gemv_compact.metal)
    ("compact", "group", 64, False, 333),
    ("compact", "group", 256, True, 601),
]


@pytest.mark.parametrize("case", TWIN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gemv_equals_its_twin_at_every_m(case):
    """Every M = 1...16 through the one-launch GEMV against the pure-MLX twin (reference.py)
    on the same inputs, odd K, row and group scales, int8 and float activations."""
    packing, scale, g, act, k = case
    for m in range(1, launch.MAX_GEMV_TOKENS + 1):
        kw, want = make_case(m, 37, k, packing, scale, g, mx.float32, act, True, seed=m)
        y = dispatch.ternary_matmul(**kw, backend="emulate")
        twin = dispatch.ternary_matmul(**kw, backend="reference")
        assert rel_err(twin, want) < 2e-4
        assert rel_err(y, np.array(twin).astype(np.float64)) < 2e-4, (case, m)


@pytest.mark.parametrize("packing", fmt.PACKINGS)
def test_int8_gemv_is_bit_identical_to_its_twin(packing):
    """float32 x, row scales, int8 activations: the in-kernel quantization and the integer
    sums are exact, so the GEMV's output equals the twin's bit for bit at every M <= 16
    (a flipped trit, the negative control, does not)."""
    k = 301
    for m in (1, 3, 8, 16):
        kw, _ = make_case(m, 45, k, packing, "row", None, mx.float32, True, True, seed=20 + m)
        y = np.array(dispatch.ternary_matmul(**kw, backend="emulate"))
        twin = np.array(dispatch.ternary_matmul(**kw, backend="reference"))
        np.testing.assert_array_equal(y, twin)
    t = np.array(fmt.unpack_mx(kw["packed"], packing, k, None)).astype(np.int8)
    t[5, 100] = 1 if t[5, 100] != 1 else -1
    pt = fmt.PackedTernary.from_trits(t, np.array(kw["scales"]), packing, None)
    y = dispatch.ternary_matmul(**{**kw, "packed": mx.array(pt.packed)}, backend="emulate")
    assert not np.array_equal(np.array(y), twin)


# --------------------------------------------------------------------------- #
# A tiny model through the emulated kernels
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "arch,packing,scale,group,act",
    [("llama", "compact", "group", 64, None), ("bitnet", "fast", "row", None, 8)],
)
def test_tiny_model_greedy_tokens_match_reference(tmp_path, arch, packing, scale, group, act):
    from mlx_lm.generate import generate_step

    from mlx_ternary.checkpoint.load import load_model
    from tests.tiny import ternary_checkpoint

    path, _ = ternary_checkpoint(tmp_path, arch, packing, scale, group, act)
    prompt = mx.array([5, 17, 40, 3, 99, 12, 7, 64, 21, 33, 2, 8])

    def greedy(backend):
        model, config = load_model(path, backend=backend)
        assert config["quantization"]["packing"] == (packing if backend == "emulate" else "fast")
        toks = []
        for tok, _ in generate_step(
            prompt, model, max_tokens=6, sampler=lambda lp: mx.argmax(lp, axis=-1)
        ):
            toks.append(int(tok))
        return toks

    assert greedy("emulate") == greedy("reference")
