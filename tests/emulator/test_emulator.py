"""Tests of the Metal emulator against references computed with numpy and MLX
ops: kernels known to run on Macs (mlx-lm's BitNet kernel and fused kernels),
then one small kernel per Metal feature."""

import importlib.util
import sys
import types
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_ternary import emulator as emu
from mlx_ternary.emulator import (
    KernelCrashError,
    KernelOutOfBoundsError,
    MetalCompileError,
    metal_kernel,
    use_emulator,
)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# mlx-lm's files are loaded by path into a stand-in package: importing
# mlx_lm itself pulls in transformers (~5 s).
MLX_LM = Path(importlib.util.find_spec("mlx_lm").submodule_search_locations[0])


def load_mlx_lm_file(relative_path: str):
    """A fresh copy of an mlx-lm source file whose kernels run in the emulator."""
    path = MLX_LM / relative_path
    package = "_emulated_mlx_lm_" + path.parent.name
    if package not in sys.modules:
        stand_in = types.ModuleType(package)
        stand_in.__path__ = [str(path.parent)]
        sys.modules[package] = stand_in
    spec = importlib.util.spec_from_file_location(f"{package}.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    with use_emulator():
        spec.loader.exec_module(module)
    return module


def emulated_module(name):
    return load_mlx_lm_file(f"kernels/{name}.py")


def as_f32(a):
    return np.array(a.astype(mx.float32)) if isinstance(a, mx.array) else np.asarray(a, np.float32)


def close(a, b, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(as_f32(a), as_f32(b), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------
# The generated source is MLX's, character for character.

SOURCE_CASES = [
    (
        dict(
            name="sig",
            input_names=["a", "s", "small", "b"],
            output_names=["o"],
            source="uint i = thread_position_in_grid.x; uint l = thread_index_in_simdgroup;\n"
            "o[i] = a[i] * s + small[0] + b_shape[0] + b_strides[1] + b_ndim + l;",
        ),
        dict(template=[("T", mx.float16), ("N", 3), ("flag", True)], output_dtypes=[mx.bfloat16]),
        lambda: [mx.zeros((8,)), mx.array(2.0), mx.array([1, 2], mx.int16), mx.zeros((3, 4))],
    ),
    (
        dict(
            name="atomics",
            input_names=["a"],
            output_names=["o1", "o2"],
            source="atomic_store_explicit(&o1[0], a[0], memory_order_relaxed); (void)o2;",
            atomic_outputs=True,
            header="// a helper header\n",
        ),
        dict(output_dtypes=[mx.float32, mx.uint32]),
        lambda: [mx.zeros((10,))],
    ),
]


@pytest.mark.parametrize("kw,call,make_inputs", SOURCE_CASES, ids=["template", "atomic"])
def test_generated_source_matches_mlx(tmp_path, capfd, kw, call, make_inputs):
    inputs = make_inputs()
    n_out = len(kw["output_names"])
    common = dict(grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)] * n_out, **call)
    real = mx.fast.metal_kernel(**kw)
    # Without Metal, MLX still writes the source while exporting a graph.
    mx.export_function(
        str(tmp_path / "f.mlxfn"), lambda *a: real(inputs=list(a), verbose=True, **common), *inputs
    )
    expected = capfd.readouterr().out
    mine = metal_kernel(**kw).metal_source(inputs, call["output_dtypes"], call.get("template"))
    assert expected == f"Generated source code for `{kw['name']}`:\n```\n{mine}\n```\n"


# ---------------------------------------------------------------------------
# mlx-lm's BitNet kernel


def bitnet_reference(x, packed, scale, invert):
    """y = x @ W.T * scale with W's rows unpacked from 2-bit codes 0,1,2 -> -1,0,1;
    row r + k * out/4 of W sits in bits 2k..2k+1 of packed row r."""
    trits = [((packed >> (2 * k)) & 3).astype(mx.float32) - 1 for k in range(4)]
    w = mx.concatenate(trits, axis=0)
    s = 1 / scale[0] if invert else scale[0]
    return (x.astype(mx.float32) @ w.T) * s.astype(mx.float32)


@pytest.fixture(scope="module")
def bitnet_kernel():
    bitlinear_layers = load_mlx_lm_file("models/bitlinear_layers.py")
    with use_emulator():
        return bitlinear_layers.make_bitlinear_kernel()


@pytest.mark.parametrize(
    "dtype,batch,in_f,out_f,invert",
    [
        (mx.float32, 1, 256, 32, False),
        (mx.float32, 3, 384, 64, True),
        (mx.float16, 2, 128, 16, False),
        (mx.bfloat16, 1, 128, 8, True),
    ],
)
def test_bitnet_kernel_matches_mlx_ops(bitnet_kernel, rng, dtype, batch, in_f, out_f, invert):
    x = mx.array(rng.standard_normal((batch, in_f)), dtype)
    packed = mx.array(rng.integers(0, 255, (out_f // 4, in_f)), mx.uint8)
    scale = mx.array([0.37], dtype)
    out = bitnet_kernel(
        inputs=[x, packed, scale],
        template=[
            ("T", dtype),
            ("invert_weight_scales", invert),
            ("in_features", in_f),
            ("out_features", out_f),
        ],
        grid=(32, batch * out_f // 4, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(batch, out_f)],
        output_dtypes=[dtype],
    )[0]
    ref = bitnet_reference(x, packed, scale, invert)
    tol = {mx.float32: 1e-4, mx.float16: 5e-2, mx.bfloat16: 2.5e-1}[dtype]
    close(out, ref, atol=tol, rtol=1e-2)


def test_bitnet_decode_reads_packed_weights_once(bitnet_kernel, rng):
    in_f, out_f = 1024, 256
    x = mx.array(rng.standard_normal((1, in_f)), mx.float32)
    packed = mx.array(rng.integers(0, 255, (out_f // 4, in_f)), mx.uint8)
    out = bitnet_kernel(
        inputs=[x, packed, mx.array([1.0])],
        template=[
            ("T", mx.float32),
            ("invert_weight_scales", False),
            ("in_features", in_f),
            ("out_features", out_f),
        ],
        grid=(32, out_f // 4, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(1, out_f)],
        output_dtypes=[mx.float32],
    )[0]
    close(out, bitnet_reference(x, packed, mx.array([1.0]), False), atol=1e-3)
    stats = bitnet_kernel.last_stats
    assert stats["packed_weights"] == {"read": packed.nbytes, "written": 0}
    assert stats["out"] == {"read": 0, "written": out.nbytes}
    # Every row group (threadgroup) reads the whole activation vector.
    assert stats["x"]["read"] == x.nbytes * (out_f // 4)
    launch = bitnet_kernel.last_launch
    assert launch.threads == 32 * out_f // 4 and launch.simd_ops == 4 * out_f // 4


# ---------------------------------------------------------------------------
# mlx-lm's fused kernels


def test_mlx_lm_qk_norm(rng):
    m = emulated_module("qk_norm")
    n, hq, hk, d = 3, 4, 2, 80  # 80: the last of R = 3 rows per lane is partial
    qkvg = mx.array(rng.standard_normal((n, 2 * (hq + hk) * d)), mx.float32)
    q, k = m.qk_norm(qkvg, n_heads=hq, n_kv_heads=hk, head_dim=d, eps=1e-6, query_scale=0.125)
    x = qkvg.reshape(n, 2 * (hq + hk), d)
    close(q, mx.fast.rms_norm(x[:, :hq], None, 1e-6) * 0.125)
    close(k, mx.fast.rms_norm(x[:, hq : hq + hk], None, 1e-6))


def test_mlx_lm_norm_add_norm(rng):
    """Threadgroup memory, barriers and simd_sum across 2 simdgroups."""
    m = emulated_module("norm_add_norm")
    t, d = 3, 512
    branch, stream = (mx.array(rng.standard_normal((t, d)), mx.float32) for _ in range(2))
    alpha, beta, post_w = (mx.array(rng.standard_normal(d), mx.float32) for _ in range(3))
    norm = nn.RMSNorm(d, eps=1e-5)
    norm.weight = mx.array(rng.standard_normal(d), mx.float32)
    new_stream, normed = m.norm_add_norm(
        branch, stream, alpha=alpha, beta=beta, post_weight=post_w, post_eps=1e-6, next_norm=norm
    )
    s = alpha * stream + beta * mx.fast.rms_norm(branch * post_w, None, 1e-6)
    close(new_stream, s)
    close(normed, norm(s), atol=1e-4)
    launch = m._norm_add_norm_kernel.last_launch
    assert launch.barriers == 2 * t and launch.divergent_simd_ops == 0


def test_mlx_lm_expert_routing(rng):
    """simd_max and simd_min to pick the top experts."""
    m = emulated_module("expert_routing")
    e, k = 48, 4
    logits = mx.array(rng.standard_normal((5, e)), mx.float32)
    bias = mx.array(rng.standard_normal(e) * 0.1, mx.float32)
    inds, weights = m.expert_routing(
        logits, bias, top_k=k, multiplier=1.0, score_eps=1e-20, route_scale=2.0
    )
    scores = mx.sigmoid(logits)
    top = mx.argsort(-(scores + bias), axis=-1)[:, :k]
    w = mx.take_along_axis(scores, top, axis=-1)
    assert np.array_equal(np.array(inds), np.array(top))
    close(weights, w / w.sum(-1, keepdims=True) * 2.0)


def test_mlx_lm_rms_norm_sigmoid_gate_strided_input(rng):
    """ensure_row_contiguous=False: the kernel walks x with x_strides."""
    m = emulated_module("rms_norm_sigmoid_gate")
    b, h, l, d = 2, 3, 4, 64
    x = mx.array(rng.standard_normal((b, l, h, d)), mx.float32).transpose(0, 2, 1, 3)
    gate = mx.array(rng.standard_normal((b, l, h * d)), mx.float32)
    out = m.rms_norm_sigmoid_gate(x, gate, eps=1e-5)
    normed = mx.fast.rms_norm(x, None, 1e-5).transpose(0, 2, 1, 3).reshape(b, l, h * d)
    close(out, normed * mx.sigmoid(gate))


def test_mlx_lm_qk_norm_rope(rng):
    """simd_shuffle_xor pairs lanes for the rotation."""
    m = emulated_module("qk_norm_rope")
    n, hq, hk, d = 4, 2, 1, 64
    qkvg = mx.array(rng.standard_normal((1, n, 2 * (hq + hk) * d)), mx.float32)
    q, k = m.qk_norm_rope(
        qkvg,
        n_heads=hq,
        n_kv_heads=hk,
        head_dim=d,
        eps=1e-6,
        query_scale=0.5,
        rope_base=1e4,
        offset=3,
    )
    x = qkvg.reshape(1, n, 2 * (hq + hk), d)

    def rope(v):
        v = v.transpose(0, 2, 1, 3)
        return mx.fast.rope(v, d, traditional=True, base=1e4, scale=1.0, offset=3).transpose(
            0, 2, 1, 3
        )

    close(q, rope(mx.fast.rms_norm(x[:, :, :hq], None, 1e-6) * 0.5), atol=1e-5)
    close(k, rope(mx.fast.rms_norm(x[:, :, hq : hq + hk], None, 1e-6)), atol=1e-5)


# ---------------------------------------------------------------------------
# How inputs reach the kernel


def test_scalars_small_arrays_and_row_contiguous_copies(rng):
    """Python scalars become 0-d constants, arrays under 8 elements constant
    buffers, and a transposed input is copied to row-major first."""
    source = """
        uint i = thread_position_in_grid.x;
        out[i] = x[i] * s + float(n) + small[1] + float(x_strides[0]) + float(x_ndim);
    """
    kernel = metal_kernel("inputs", ["x", "s", "n", "small"], ["out"], source)
    x = mx.array(rng.standard_normal((4, 6)), mx.float32).T  # (6, 4), not row-contiguous
    out = kernel(
        inputs=[x, 0.5, 3, mx.array([1.0, 2.0])],
        grid=(24, 1, 1),
        threadgroup=(24, 1, 1),
        output_shapes=[(6, 4)],
        output_dtypes=[mx.float32],
    )[0]
    close(out, x * 0.5 + 3 + 2 + 4 + 2)
    assert "const constant float& s" in kernel.metal_source(
        [x, 0.5, 3, mx.array([1.0, 2.0])], [mx.float32]
    )
    assert kernel.last_stats["small"] == {"read": 24 * 4, "written": 0}
    assert kernel.last_stats["x_strides"] == {"read": 24 * 8, "written": 0}


def test_vector_loads_from_host_memory_mlx_aligns_to_8_bytes():
    """A float4 load compiles to an aligned 16-byte host move, and MLX's CPU arrays (a slice
    even more so) start only 8-byte aligned: the emulator moves such inputs to an aligned
    buffer first, as Metal buffers are."""
    source = """
        uint i = thread_position_in_grid.x;
        float xv[8];
        const device float4* xp = (const device float4*)(x + 8 * i);
        for (int q = 0; q < 2; q++) {
          const float4 v = xp[q];
          for (int j = 0; j < 4; j++) xv[4 * q + j] = v[j];
        }
        out[i] = xv[0] + xv[7];
    """
    kernel = metal_kernel("host_alignment", ["x"], ["out"], source)
    for x in (mx.arange(256, dtype=mx.float32), mx.arange(257, dtype=mx.float32)[1:]):
        out = kernel(
            inputs=[x],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(32,)],
            output_dtypes=[mx.float32],
        )[0]
        close(out, x.reshape(32, 8)[:, 0] + x.reshape(32, 8)[:, 7])


def test_constant_inputs_cannot_be_cast_to_device():
    """MLX binds an input of fewer than 8 elements as `const constant T*`, and Apple's
    compiler rejects a cast of it to `device`: so does the emulator. The same body compiles
    and runs when the input has 8 elements (a `device` buffer); a cast within the constant
    space stays legal."""
    bad = """
        uint i = thread_position_in_grid.x;
        const device uchar* b = (const device uchar*)w;
        out[i] = float(b[i]);
    """
    kernel = metal_kernel("cast_to_device", ["w"], ["out"], bad)
    call = dict(
        grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)], output_dtypes=[mx.float32]
    )
    big = kernel(inputs=[mx.array([0x04030201] * 8, dtype=mx.uint32)], **call)[0]
    assert big.tolist() == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(MetalCompileError, match="cast_to_device"):
        kernel(inputs=[mx.array([0x04030201] * 7, dtype=mx.uint32)], **call)
    ok = """
        uint i = thread_position_in_grid.x;
        constant uchar* b = (constant uchar*)w;
        out[i] = float(b[i]);
    """
    small = metal_kernel("cast_in_constant", ["w"], ["out"], ok)(
        inputs=[mx.array([0x04030201] * 7, dtype=mx.uint32)], **call
    )[0]
    assert small.tolist() == [1.0, 2.0, 3.0, 4.0]


# ---------------------------------------------------------------------------
# SIMD-group functions, over full and partial simdgroups

SIMD_SOURCE = """
    uint gid = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    float v = x[gid];
    int iv = int(v);
    float p = (iv % 2 == 0) ? 1.0f : 2.0f;
    uint k = 0;
    #define PUT(val) out[gid * NOPS + (k++)] = float(val)
    PUT(simd_sum(v));
    PUT(simd_max(v));
    PUT(simd_min(v));
    PUT(simd_product(p));
    PUT(simd_shuffle(v, (lane * 7 + 3) % 32));
    PUT(simd_shuffle_down(v, 3));
    PUT(simd_shuffle_up(v, 5));
    PUT(simd_shuffle_xor(v, 6));
    PUT(simd_broadcast(v, 4));
    PUT(simd_broadcast_first(v));
    PUT(simd_prefix_exclusive_sum(v));
    PUT(simd_prefix_inclusive_sum(v));
    PUT(simd_prefix_inclusive_product(p));
    PUT(simd_and(iv | 16));
    PUT(simd_or(iv));
    PUT(simd_xor(iv));
    PUT(simd_all(iv > 0));
    PUT(simd_any(iv > 8));
    PUT(simd_is_first());
    uint ballot = uint(static_cast<simd_vote::vote_t>(simd_ballot(iv > 4)));
    PUT(ballot & 0xFFFFu);
    PUT(ballot >> 16);
    PUT(simd_shuffle_rotate_down(v, 5));
    PUT(simd_shuffle_and_fill_down(v, v + 100.0f, 4));
    PUT(simd_shuffle_and_fill_up(v, v + 100.0f, 4));
    PUT(quad_sum(v));
    PUT(quad_shuffle(v, 3));
    PUT(quad_shuffle_xor(v, 1));
    PUT(quad_prefix_exclusive_sum(v));
    float4 s4 = simd_sum(float4(v, 1.0f, 2.0f, v * v));
    PUT(s4.y);
    PUT(s4.w);
    PUT(simd_sum(half(v)));
    PUT(simd_max(int(v) - 5));
"""

SIMD_OPS = [
    "sum",
    "max",
    "min",
    "product",
    "shuffle",
    "down3",
    "up5",
    "xor6",
    "bcast4",
    "first",
    "excl",
    "incl",
    "inclprod",
    "and",
    "or",
    "xor",
    "all",
    "any",
    "is_first",
    "ballot_lo",
    "ballot_hi",
    "rot5",
    "filldown4",
    "fillup4",
    "quad_sum",
    "quad_shuffle3",
    "quad_xor1",
    "quad_excl",
    "v4_count",
    "v4_sq",
    "half_sum",
    "int_max",
]


def simd_reference(x, threads_per_group):
    """Each op per lane over the lanes that exist; NaN where Metal leaves the
    result undefined (reading a lane that does not exist)."""
    n = len(x)
    ref = np.full((n, len(SIMD_OPS)), np.nan)
    starts = [
        s
        for g in range(0, n, threads_per_group)
        for s in range(g, min(n, g + threads_per_group), 32)
    ]
    for s in starts:
        e = min(s + 32, (s // threads_per_group + 1) * threads_per_group, n)
        v = x[s:e]
        w = len(v)
        iv = v.astype(np.int64)
        p = np.where(iv % 2 == 0, 1.0, 2.0)

        def lane(j, fallback=np.nan):
            return v[j] if 0 <= j < w else fallback

        ballot = sum(1 << i for i in range(w) if iv[i] > 4)
        for i in range(w):
            q = i - i % 4
            quad = v[q : min(q + 4, w)]
            row = {
                "sum": v.sum(),
                "max": v.max(),
                "min": v.min(),
                "product": p.prod(),
                "shuffle": lane((i * 7 + 3) % 32),
                "down3": lane(i + 3) if i + 3 < 32 else v[i],
                "up5": lane(i - 5) if i >= 5 else v[i],
                "xor6": lane(i ^ 6),
                "bcast4": lane(4),
                "first": v[0],
                "excl": v[:i].sum(),
                "incl": v[: i + 1].sum(),
                "inclprod": p[: i + 1].prod(),
                "and": np.bitwise_and.reduce(iv | 16),
                "or": np.bitwise_or.reduce(iv),
                "xor": np.bitwise_xor.reduce(iv),
                "all": float((iv > 0).all()),
                "any": float((iv > 8).any()),
                "is_first": float(i == 0),
                "ballot_lo": ballot & 0xFFFF,
                "ballot_hi": ballot >> 16,
                "rot5": lane((i + 5) % 32) if w == 32 else np.nan,
                "filldown4": lane(i + 4)
                if i + 4 < 32
                else (lane(i + 4 - 32) + 100 if w == 32 else np.nan),
                "fillup4": lane(i - 4)
                if i >= 4
                else (lane(i - 4 + 32) + 100 if w == 32 else np.nan),
                "quad_sum": quad.sum(),
                "quad_shuffle3": lane(q + 3),
                "quad_xor1": lane(q + ((i % 4) ^ 1)),
                "quad_excl": v[q:i].sum(),
                "v4_count": w,
                "v4_sq": (v * v).sum(),
                "half_sum": v.sum(),
                "int_max": iv.max() - 5,
            }
            ref[s + i] = [row[k] for k in SIMD_OPS]
    return ref


def test_simd_functions_full_and_partial_simdgroups(rng):
    kernel = metal_kernel("simd_ops", ["x"], ["out"], SIMD_SOURCE)
    n, tg = 70, 64  # threadgroups of 64 and 6 threads: two full simdgroups, one of 6 lanes
    x = rng.integers(0, 10, n).astype(np.float32)
    out = kernel(
        inputs=[mx.array(x)],
        template=[("NOPS", len(SIMD_OPS))],
        grid=(n, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(n, len(SIMD_OPS))],
        output_dtypes=[mx.float32],
    )[0]
    got, ref = np.array(out), simd_reference(x, tg)
    defined = ~np.isnan(ref)
    for j, op in enumerate(SIMD_OPS):
        np.testing.assert_array_equal(got[defined[:, j], j], ref[defined[:, j], j], err_msg=op)
    assert kernel.last_launch.divergent_simd_ops == 0


def test_divergent_simd_sum_runs_the_active_lanes(rng):
    """Lanes leave a loop after different trip counts; each simd_sum in the
    loop counts only the lanes still in it, the one after it all lanes."""
    source = """
        uint lane = thread_index_in_simdgroup;
        float acc = 0.0f;
        for (uint i = lane; i < n; i += 8) {
            acc += simd_sum(1.0f);
        }
        float total = simd_sum(acc);
        out[thread_position_in_grid.x * 2] = acc;
        out[thread_position_in_grid.x * 2 + 1] = total;
    """
    kernel = metal_kernel("divergent", ["n"], ["out"], source)
    out = np.array(
        kernel(
            inputs=[20],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(64,)],
            output_dtypes=[mx.float32],
        )[0]
    ).reshape(32, 2)
    # Trip k (k = 0, 1, 2) keeps the lanes with lane + 8k < 20: 20, 12 and 4 lanes.
    acc = np.array(
        [sum(c for k, c in enumerate([20, 12, 4]) if lane + 8 * k < 20) for lane in range(32)]
    )
    np.testing.assert_array_equal(out[:, 0], acc)
    np.testing.assert_array_equal(out[:, 1], acc.sum())
    assert kernel.last_launch.divergent_simd_ops > 0


DIVERGENT_BRANCHES = """
    uint lane = thread_index_in_simdgroup;
    float a = 0.0f, b = 0.0f;
    if (lane < 10) {
        a = simd_sum(1.0f);
    } else {
        a = simd_sum(2.0f) + simd_max(float(lane));
    }
    if (lane % 3 == 0) {
        b = simd_prefix_exclusive_sum(1.0f);
    }
    float c = simd_sum(a + b);
    if (lane >= 28) {
        return;
    }
    float d = simd_sum(1.0f);
    device float* o = out + lane * 4;
    o[0] = a;
    o[1] = b;
    o[2] = c;
    o[3] = d;
"""


def test_divergent_branches_run_each_side_on_its_own():
    kernel = metal_kernel("branches", [], ["out"], DIVERGENT_BRANCHES)
    call = dict(
        inputs=[],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(128,)],
        output_dtypes=[mx.float32],
        init_value=-1.0,
    )
    out = np.array(kernel(**call)[0]).reshape(32, 4)
    lane = np.arange(32)
    a = np.where(lane < 10, 10, 2 * 22 + 31)  # the else side: 22 lanes, lane 31 the largest
    b = np.where(lane % 3 == 0, np.cumsum(lane % 3 == 0) - 1, 0)
    expected = np.stack([a, b, np.full(32, (a + b).sum()), np.full(32, 28)], axis=1)
    expected[28:] = -1  # those lanes returned before writing
    np.testing.assert_array_equal(out, expected)
    kernel.strict_simd = True
    with pytest.raises(emu.EmulatorError, match="divergent SIMD-group operation.*lanes 0x000003ff"):
        kernel(**call)


# ---------------------------------------------------------------------------
# Threadgroups: memory, barriers, partial groups, attributes


def test_threadgroup_tree_reduction_with_partial_last_group(rng):
    source = """
        threadgroup float buf[TG];
        uint t = thread_position_in_threadgroup.x;
        uint n = threads_per_threadgroup.x;
        buf[t] = x[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint s = TG / 2; s > 0; s >>= 1) {
            if (t < s && t + s < n) {
                buf[t] += buf[t + s];
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        if (t == 0) {
            out[threadgroup_position_in_grid.x] = buf[0];
        }
    """
    kernel = metal_kernel("tree_sum", ["x"], ["out"], source)
    n, tg = 1000, 256
    x = rng.integers(-50, 50, n).astype(np.float32)
    groups = -(-n // tg)
    out = kernel(
        inputs=[mx.array(x)],
        template=[("TG", tg)],
        grid=(n, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(groups,)],
        output_dtypes=[mx.float32],
    )[0]
    np.testing.assert_array_equal(
        np.array(out), [x[g * tg : (g + 1) * tg].sum() for g in range(groups)]
    )
    assert kernel.last_launch.barriers == groups * 9


ATTRIBUTE_SOURCE = """
    uint3 g = thread_position_in_grid;
    device uint* o = out + ((g.z * grid_size.y + g.y) * grid_size.x + g.x) * 16;
    o[0] = thread_position_in_threadgroup.x;
    o[1] = thread_position_in_threadgroup.y;
    o[2] = thread_position_in_threadgroup.z;
    o[3] = threadgroup_position_in_grid.x;
    o[4] = threadgroup_position_in_grid.y;
    o[5] = threadgroup_position_in_grid.z;
    o[6] = threads_per_threadgroup.x;
    o[7] = threads_per_threadgroup.y;
    o[8] = threads_per_threadgroup.z;
    o[9] = thread_index_in_threadgroup;
    o[10] = simdgroup_index_in_threadgroup;
    o[11] = thread_index_in_simdgroup;
    o[12] = simdgroups_per_threadgroup;
    o[13] = threads_per_simdgroup;
    o[14] = threadgroups_per_grid.x * 100 + threadgroups_per_grid.y * 10 + threadgroups_per_grid.z;
    o[15] = dispatch_threads_per_threadgroup.x * 100 + dispatch_threads_per_threadgroup.y;
"""


def test_thread_attributes_with_partial_threadgroups():
    grid, tg = (10, 7, 3), (8, 4, 2)  # partial groups along every axis
    kernel = metal_kernel("attrs", [], ["out"], ATTRIBUTE_SOURCE)
    n = int(np.prod(grid))
    out = np.array(
        kernel(
            inputs=[],
            grid=grid,
            threadgroup=tg,
            output_shapes=[(n * 16,)],
            output_dtypes=[mx.uint32],
        )[0]
    ).reshape(grid[2], grid[1], grid[0], 16)
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                pos, grp = (x, y, z), [c // t for c, t in zip((x, y, z), tg)]
                loc = [c % t for c, t in zip(pos, tg)]
                size = [min(t, g - b * t) for g, t, b in zip(grid, tg, grp)]
                index = loc[0] + size[0] * (loc[1] + size[1] * loc[2])
                expected = [
                    *loc,
                    *grp,
                    *size,
                    index,
                    index // 32,
                    index % 32,
                    -(-int(np.prod(size)) // 32),
                    32,
                    200 + 20 + 2,
                    tg[0] * 100 + tg[1],
                ]
                np.testing.assert_array_equal(out[z, y, x], expected, err_msg=str(pos))


# ---------------------------------------------------------------------------
# Types: half, bfloat16, vectors, swizzles


def test_half_and_bfloat16_io(rng):
    source = """
        uint i = thread_position_in_grid.x;
        out_h[i] = xh[i] * (half)3 - 1.5h;
        out_b[i] = static_cast<bfloat16_t>(static_cast<float>(xb[i]) * 3.0f + 0.25f);
        out_bb[i] = xb[i] * xb[i];
        const device half4* h4 = (const device half4*)xh;
        float4 f = float4(h4[i / 4]);
        out_f[i] = f[i % 4] + float(xb[i]);
    """
    kernel = metal_kernel("half_bf16", ["xh", "xb"], ["out_h", "out_b", "out_bb", "out_f"], source)
    n = 64
    xh = mx.array(rng.standard_normal(n), mx.float16)
    xb = mx.array(rng.standard_normal(n), mx.bfloat16)
    out_h, out_b, out_bb, out_f = kernel(
        inputs=[xh, xb],
        grid=(n, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(n,)] * 4,
        output_dtypes=[mx.float16, mx.bfloat16, mx.bfloat16, mx.float32],
    )
    assert out_h.dtype == mx.float16 and out_b.dtype == mx.bfloat16
    assert np.array_equal(np.array(out_h), np.array(xh * 3 - 1.5))
    assert mx.array_equal(out_b, (xb.astype(mx.float32) * 3 + 0.25).astype(mx.bfloat16))
    assert mx.array_equal(out_bb, xb * xb)
    close(out_f, xh.astype(mx.float32) + xb.astype(mx.float32), atol=0, rtol=0)


def test_vectors_swizzles_and_math(rng):
    source = """
        uint i = thread_position_in_grid.x;
        float4 v = ((const device float4*)x)[i];
        float4 w = v.wzyx;
        w.xy = v.zw * 2.0f;
        w.zw += float2(1.0f, 2.0f);
        float3 c = v.rgb;
        uint bits = as_type<uint>(v.x);
        device float4* o = reinterpret_cast<device float4*>(out) + i * 2;
        o[0] = float4(dot(v, w), c.z + float(bits & 1u), clamp(v.y, -0.5f, 0.5f), select(v.x, v.y, v.z > v.w));
        o[1] = float4(fma(v.x, v.y, v.z), metal::max(v.x, 0.25f), metal::precise::exp(v.w), float(popcount(bits)));
    """
    kernel = metal_kernel("vectors", ["x"], ["out"], source)
    n = 16
    x = rng.standard_normal((n, 4)).astype(np.float32)
    out = np.array(
        kernel(
            inputs=[mx.array(x)],
            grid=(n, 1, 1),
            threadgroup=(8, 1, 1),
            output_shapes=[(n, 8)],
            output_dtypes=[mx.float32],
        )[0]
    )
    v = x
    w = np.stack([v[:, 2] * 2, v[:, 3] * 2, v[:, 1] + 1, v[:, 0] + 2], axis=1)
    bits = v[:, 0].view(np.uint32)
    ref = np.stack(
        [
            (v * w).sum(1),
            v[:, 2] + (bits & 1),
            np.clip(v[:, 1], -0.5, 0.5),
            np.where(v[:, 2] > v[:, 3], v[:, 1], v[:, 0]),
            v[:, 0] * v[:, 1] + v[:, 2],
            np.maximum(v[:, 0], 0.25),
            np.exp(v[:, 3]),
            [bin(b).count("1") for b in bits],
        ],
        axis=1,
    )
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


DIALECT_HEADER = """
#include <metal_stdlib>
using namespace metal;

constant float kTable[4] = {0.5f, 1.0f, 2.0f, 4.0f};
constexpr constant int kShift = 2;

template <typename T>
inline float sum_n(const device T* p, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += static_cast<float>(p[i]);
    return s;
}

inline void accumulate(device float& o, thread const float& v) { o += v; }

template <typename T>
METAL_FUNC T twice(thread T& x) { x = x * T(2); return x; }

struct Pair { float a; uint b; };

inline void stage(threadgroup float* buf, uint t, float v) { buf[t] = v; }
"""

DIALECT_SOURCE = """
    uint i = thread_position_in_grid.x;
    threadgroup float tile[2][16];
    uint t = thread_position_in_threadgroup.x;
    stage(tile[1], t, float(i));
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float r0 = tile[1][(t + 1) % 16];
    const device float* row = x + i * 4;
    float s = sum_n(row, 4) + sum_n(out + i * 8, 0);
    uint4 u = uint4(i, i + 1, i + 2, i + 3) << kShift;
    bool4 m = u > uint4(8);
    half h = 0.5h + half(i);
    half2 hh = as_type<half2>(as_type<uint>(half2(h, h * 2.0h)));
    Pair p = {1.5f, 7u};
    float y = float(i);
    twice(y);
    ulong big = ulong(i) << 40;
    int neg = -int(i);
    device float* o = out + i * 8;
    o[0] = s;
    accumulate(o[0], 1.0f);
    o[1] = r0;
    o[2] = float(all(m)) + 2.0f * float(any(m));
    o[3] = float(hh.y) + kTable[i % 4];
    o[4] = p.a * float(p.b) + y;
    o[5] = float(big >> 38) + float(abs(neg)) + float(clamp(neg, -3, 3));
    o[6] = metal::fast::exp2(1.0f) + float(extract_bits(u.w, 2, 3));
    o[7] = metal::min(uint(3), i) + float(max(1.5h, half(0.25f)));
"""


def test_metal_dialect_helpers_address_spaces_and_literals():
    """Helpers taking device/thread/threadgroup pointers and references,
    program-scope constants, half literals, as_type, 64-bit integers."""
    kernel = metal_kernel("dialect", ["x"], ["out"], DIALECT_SOURCE, header=DIALECT_HEADER)
    n = 16
    x = np.arange(n * 4, dtype=np.float32)
    out = np.array(
        kernel(
            inputs=[mx.array(x)],
            grid=(n, 1, 1),
            threadgroup=(16, 1, 1),
            output_shapes=[(n, 8)],
            output_dtypes=[mx.float32],
            init_value=0.0,
        )[0]
    )
    i = np.arange(n)
    u = (i[:, None] + np.arange(4)) << 2
    expected = np.stack(
        [
            x.reshape(n, 4).sum(1) + 1,
            (i + 1) % 16,
            (u > 8).all(1) + 2 * (u > 8).any(1),
            (0.5 + i) * 2 + np.array([0.5, 1, 2, 4])[i % 4],
            1.5 * 7 + 2 * i,
            (i << 40 >> 38) + i + np.clip(-i, -3, 3),
            2 + ((u[:, 3] >> 2) & 7),
            np.minimum(3, i) + 1.5,
        ],
        axis=1,
    )
    np.testing.assert_array_equal(out, expected)


def test_threadgroup_memory_limit():
    kernel = metal_kernel(
        "too_big",
        [],
        ["out"],
        "threadgroup float a[4096];\nthreadgroup float b[4097];\n"
        "a[0] = 1.0f; b[0] = 2.0f; out[0] = a[0] + b[0];",
    )
    with pytest.raises(
        emu.EmulatorError, match="threadgroup memory of 32772 bytes .*'b'.* exceeds the 32 KB"
    ):
        kernel(
            inputs=[],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
        )


# ---------------------------------------------------------------------------
# Atomics


def test_atomic_outputs(rng):
    source = """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&hist[x[i]], 1u, memory_order_relaxed);
        atomic_fetch_max_explicit(&hist[256], uint(x[i]), memory_order_relaxed);
    """
    kernel = metal_kernel("histogram", ["x"], ["hist"], source, atomic_outputs=True)
    n = 5000
    x = rng.integers(0, 256, n).astype(np.uint8)
    hist = kernel(
        inputs=[mx.array(x)],
        grid=(n, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(257,)],
        output_dtypes=[mx.uint32],
        init_value=0,
    )[0]
    expected = np.append(np.bincount(x, minlength=256), x.max())
    np.testing.assert_array_equal(np.array(hist), expected)
    assert kernel.last_stats["hist"] == {"read": 2 * 4 * n, "written": 2 * 4 * n}

    fsum = metal_kernel(
        "float_sum",
        ["x"],
        ["total"],
        "atomic_fetch_add_explicit(total, x[thread_position_in_grid.x], memory_order_relaxed);",
        atomic_outputs=True,
    )
    xf = rng.standard_normal(n).astype(np.float32)
    total = fsum(
        inputs=[mx.array(xf)],
        grid=(n, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.float32],
        init_value=0.0,
    )[0]
    np.testing.assert_allclose(np.array(total)[0], xf.sum(dtype=np.float64), rtol=1e-4)


def test_threadgroup_atomic_counter():
    source = """
        threadgroup atomic_uint count;
        uint t = thread_position_in_threadgroup.x;
        if (t == 0) {
            atomic_store_explicit(&count, 0u, memory_order_relaxed);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (t % 3 == 0) {
            atomic_fetch_add_explicit(&count, 1u, memory_order_relaxed);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (t == 0) {
            out[threadgroup_position_in_grid.x] = atomic_load_explicit(&count, memory_order_relaxed);
        }
    """
    kernel = metal_kernel("tg_atomic", [], ["out"], source)
    out = kernel(
        inputs=[],
        grid=(300, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(3,)],
        output_dtypes=[mx.uint32],
    )[0]
    np.testing.assert_array_equal(np.array(out), [43, 43, 15])


# ---------------------------------------------------------------------------
# simdgroup matrices

MATMUL_SOURCE = """
    // One simdgroup per 8x8 tile of C = A @ B; A's tiles pass through
    // threadgroup memory, B is read directly (or transposed from Bt).
    threadgroup float As[64];
    uint lane = thread_index_in_simdgroup;
    uint tx = threadgroup_position_in_grid.x, ty = threadgroup_position_in_grid.y;
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_float8x8 a;
    simdgroup_matrix<T, 8, 8> b;
    for (uint k = 0; k < K; k += 8) {
        for (uint e = lane; e < 64; e += 32) {
            As[e] = A[(ty * 8 + e / 8) * K + k + e % 8];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_load(a, As, 8);
        if (TRANSPOSED) {
            simdgroup_load(b, B, K, ulong2(k, tx * 8), true);
        } else {
            simdgroup_load(b, B, N, ulong2(tx * 8, k));
        }
        simdgroup_multiply_accumulate(acc, a, b, acc);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    simdgroup_store(acc, C, N, ulong2(tx * 8, ty * 8));
"""


@pytest.mark.parametrize("transposed,dtype", [(False, mx.float32), (True, mx.float16)])
def test_simdgroup_matrix_multiply(rng, transposed, dtype):
    kernel = metal_kernel("sg_matmul", ["A", "B"], ["C"], MATMUL_SOURCE)
    m, k, n = 16, 24, 32
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    b_in = mx.array(b.T if transposed else b, dtype)
    c = kernel(
        inputs=[mx.array(a), b_in],
        template=[("T", dtype), ("K", k), ("N", n), ("TRANSPOSED", transposed)],
        grid=(32 * n // 8, m // 8, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[mx.float32],
    )[0]
    b_used = np.array(b_in.astype(mx.float32))
    close(c, a @ (b_used.T if transposed else b_used), atol=1e-4, rtol=1e-4)
    assert kernel.last_stats["B"]["read"] == b_in.nbytes * (m // 8)


# ---------------------------------------------------------------------------
# What the emulator catches


@pytest.mark.parametrize(
    "source,message",
    [
        (
            "uint i = thread_position_in_grid.x;\n const device float* p = w + offset;\n out[i] = p[i];",
            "out-of-bounds read of buffer 'w' at index 64",
        ),
        (
            "uint i = thread_position_in_grid.x;\n out[i + 1] = w[i];",
            "out-of-bounds write of buffer 'out' at index 64",
        ),
        (
            "threadgroup float buf[32];\n uint t = thread_position_in_threadgroup.x;\n"
            " buf[t + 1] = w[t];\n out[t] = buf[t];",
            "out-of-bounds access of threadgroup array 'buf' at index 32",
        ),
        (
            "uint i = thread_position_in_grid.x;\n out[i] = ((const device float4*)(w + 1))[0].x;",
            "misaligned read of 16 bytes at byte offset 4 (byte offset 4) of buffer 'w'",
        ),
    ],
    ids=["read-after-pointer-arithmetic", "write", "threadgroup", "misaligned"],
)
def test_out_of_bounds_access_is_reported(source, message):
    kernel = metal_kernel("oob_kernel", ["w", "offset"], ["out"], source)
    with pytest.raises(KernelOutOfBoundsError) as info:
        kernel(
            inputs=[mx.zeros(64), 1],
            grid=(64, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(64,)],
            output_dtypes=[mx.float32],
        )
    text = str(info.value)
    assert "kernel 'oob_kernel'" in text and message in text
    assert "thread_position_in_grid=(" in text


def test_crashes_become_exceptions_and_the_emulator_keeps_working():
    divide = metal_kernel("divide", ["d"], ["out"], "out[thread_position_in_grid.x] = 10 / d[0];")
    with pytest.raises(KernelCrashError, match="SIGFPE"):
        divide(
            inputs=[mx.zeros(8, mx.int32)],
            grid=(8, 1, 1),
            threadgroup=(8, 1, 1),
            output_shapes=[(8,)],
            output_dtypes=[mx.int32],
        )
    deep = metal_kernel(
        "deep",
        ["d"],
        ["out"],
        "float big[1 << 20];\n uint i = thread_position_in_grid.x;\n big[d[0] + i] = 1.0f;\n out[i] = big[d[1] + i];",
    )
    with pytest.raises(KernelCrashError, match="stack overflow"):
        deep(
            inputs=[mx.array([0, 5], mx.int32)],
            grid=(4, 1, 1),
            threadgroup=(4, 1, 1),
            output_shapes=[(4,)],
            output_dtypes=[mx.float32],
        )
    out = divide(
        inputs=[mx.full(8, 5, mx.int32)],
        grid=(8, 1, 1),
        threadgroup=(8, 1, 1),
        output_shapes=[(8,)],
        output_dtypes=[mx.int32],
    )[0]
    np.testing.assert_array_equal(np.array(out), [2] * 8)


def test_compile_errors_point_at_the_metal_line():
    kernel = metal_kernel(
        "typo", ["x"], ["out"], "uint i = thread_position_in_grid.x;\nout[i] = x[i] + missing;"
    )
    with pytest.raises(
        MetalCompileError, match=r"custom_kernel_typo_float_float\.metal:\d+:\d+: error: .*missing"
    ):
        kernel(
            inputs=[mx.zeros(8)],
            grid=(8, 1, 1),
            threadgroup=(8, 1, 1),
            output_shapes=[(8,)],
            output_dtypes=[mx.float32],
        )


def test_unwritten_outputs_are_poisoned_and_init_value_fills():
    kernel = metal_kernel(
        "half_write",
        [],
        ["out"],
        "uint i = thread_position_in_grid.x;\nif (i % 2 == 0) out[i] = 1.0f;",
    )
    call = dict(
        inputs=[],
        grid=(8, 1, 1),
        threadgroup=(8, 1, 1),
        output_shapes=[(8,)],
        output_dtypes=[mx.float32],
    )
    out = np.array(kernel(**call)[0])
    assert np.all(out[::2] == 1) and np.all(np.isnan(out[1::2]))
    assert kernel.last_stats["out"] == {"read": 0, "written": 16}
    out = np.array(kernel(init_value=3.0, **call)[0])
    np.testing.assert_array_equal(out, [1, 3] * 4)


def test_reverse_schedule_exposes_a_missing_barrier(rng):
    source = """
        threadgroup float buf[64];
        uint t = thread_position_in_threadgroup.x;
        buf[t] = x[t];
        if (BARRIER) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        out[t] = buf[(t + 1) % 64];
    """
    kernel = metal_kernel("neighbour", ["x"], ["out"], source)
    x = rng.standard_normal(64).astype(np.float32)
    results = {}
    for barrier in (False, True):
        for schedule in ("forward", "reverse"):
            kernel.schedule = schedule
            results[barrier, schedule] = np.array(
                kernel(
                    inputs=[mx.array(x)],
                    template=[("BARRIER", barrier)],
                    grid=(64, 1, 1),
                    threadgroup=(64, 1, 1),
                    output_shapes=[(64,)],
                    output_dtypes=[mx.float32],
                )[0]
            )
    expected = np.roll(x, -1)
    np.testing.assert_array_equal(results[True, "forward"], expected)
    np.testing.assert_array_equal(results[True, "reverse"], expected)
    # Without the barrier, thread t reads buf[t + 1] before thread t + 1 wrote it.
    assert np.isnan(results[False, "forward"][:63]).all()


def test_call_checks_match_mlx():
    kernel = metal_kernel("k", ["x"], ["out"], "out[0] = x[0];")
    with pytest.raises(ValueError, match="Expected `inputs` to have size 1 but got size 0"):
        kernel(
            inputs=[],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
        )
    with pytest.raises(
        ValueError, match="greater than  the maximum allowed threads per threadgroup"
    ):
        kernel(
            inputs=[mx.zeros(1)],
            grid=(1, 1, 1),
            threadgroup=(64, 32, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
        )
