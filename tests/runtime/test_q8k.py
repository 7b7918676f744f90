"""llama.cpp's activation numerics (activations="q8k"): the pure-MLX twin (runtime/q8k.py) and
the native kernel against a numpy transcription of ggml's Q8_K quantizer and its TQ x Q8_K
integer dot product, bit for bit; the routing; the settings."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_ternary import format as fmt
from mlx_ternary.errors import FormatError
from mlx_ternary.runtime import cpu, dispatch, q8k, reference

needs_native = pytest.mark.native
F32 = np.float32


# ---- numpy transcription of ggml (ggml-quants.c quantize_row_q8_K_ref; ggml-cpu quants.c
# ggml_vec_dot_tq2_0_q8_K_generic), one token at a time, float32 scalars as C computes them


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: add 1.5 * 2**23 in float32 and read the low mantissa bits."""
    val = (v.astype(F32) + F32(12582912.0)).astype(F32)
    return (val.view(np.int32) & 0x007FFFFF) - 0x00400000


def ggml_q8k(x: np.ndarray):
    """One token (K,) float32, K a multiple of 256 -> (q (nb, 256) int8, d (nb,) float32)."""
    nb = x.size // 256
    q, d = np.zeros((nb, 256), np.int8), np.zeros(nb, F32)
    for b in range(nb):
        blk = x[b * 256 : (b + 1) * 256].astype(F32)
        amax, top = F32(0), F32(0)
        for v in blk:
            if abs(v) > amax:
                amax, top = F32(abs(v)), v
        if amax == 0:
            continue
        iscale = F32(F32(-127.0) / top)
        q[b] = np.minimum(127, nearest_int((iscale * blk).astype(F32)))
        d[b] = F32(F32(1.0) / iscale)
    return q, d


def ggml_dot(t: np.ndarray, s_blocks: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """All rows of trits t (N, nb*256) with a scale per row and block s_blocks (N, nb):
    sumf += (float)sumi * (d_q8 * d_tq), block by block."""
    n, nb = s_blocks.shape
    sumf = np.zeros(n, F32)
    for b in range(nb):
        sumi = t[:, b * 256 : (b + 1) * 256].astype(np.int64) @ q[b].astype(np.int64)
        coef = (F32(d[b]) * s_blocks[:, b].astype(F32)).astype(F32)
        sumf = (sumf + (sumi.astype(F32) * coef).astype(F32)).astype(F32)
    return sumf


def ggml_layer(x: np.ndarray, t: np.ndarray, s_blocks: np.ndarray) -> np.ndarray:
    """(M, K) activations, zero-padded to whole blocks -> (M, N), as llama.cpp computes it."""
    kp = s_blocks.shape[1] * 256
    out = []
    for row in x.astype(F32):
        xp = np.zeros(kp, F32)
        xp[: row.size] = row
        tp = np.zeros((t.shape[0], kp), np.int8)
        tp[:, : t.shape[1]] = t
        out.append(ggml_dot(tp, s_blocks, *ggml_q8k(xp)))
    return np.stack(out)


# ---- cases


def tricky_x(rng, m: int, k: int) -> np.ndarray:
    """Activations with what the rules single out: a zero block, ties at .5 after scaling,
    two entries of the largest magnitude with opposite signs, a negative largest."""
    x = (rng.normal(size=(m, k)) * rng.uniform(0.2, 5, size=(m, 1))).astype(F32)
    if k > 256:
        x[0, :256] = 0.0
    if m > 1:
        x[1, :4] = [-2.0, 2.0, 1.0, 0.5]  # first largest is -2: iscale = 63.5
        x[1, 4:256] = np.clip(x[1, 4:256], -1.9, 1.9)
    if m > 2 and k > 256:
        x[2, 256:512] = np.round(x[2, 256:512] * 2) / 2
        x[2, 300] = -127.0 / 63.5 * 2  # a negative largest
    return x


def tq_layer(rng, n: int, k: int, packing: str, scale: str):
    """A TQ-like layer: trits and fp16 scales (per 256-block as a TQ2_0 file, or coarser)."""
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    nb = -(-k // 256)
    if scale == "group":
        s = rng.uniform(0.01, 0.05, size=(n, nb)).astype(np.float16)
        gs = 256
    else:
        s = rng.uniform(0.01, 0.05, size=(1, 1) if scale == "tensor" else (n, 1))
        s, gs = s.astype(np.float16), None
    pt = fmt.PackedTernary.from_trits(t, s, packing, gs)
    s_blocks = np.broadcast_to(s.astype(F32), (n, nb)) if s.shape[1] == 1 else s.astype(F32)
    kw = dict(packing=packing, in_features=k, group_size=gs)
    return (mx.array(pt.packed), mx.array(s), kw), t, np.ascontiguousarray(s_blocks)


def test_quantize_is_ggml_q8k():
    rng = np.random.default_rng(0)
    x = tricky_x(rng, 3, 768)
    q, d = q8k.quantize(mx.array(x))
    for m in range(3):
        wq, wd = ggml_q8k(x[m])
        np.testing.assert_array_equal(np.array(q[m]).astype(np.int8), wq)
        np.testing.assert_array_equal(np.array(d[m]), wd)
    assert np.array(d[0, 0]) == 0 and not np.array(q[0, 0]).any()  # the zero block
    assert np.array(d[1, 0]) > 0 and np.array(q[1, 0, 0]) == -127  # ggml's sign convention


@pytest.mark.parametrize("packing", ["fast", "compact"])
@pytest.mark.parametrize("scale,k", [("group", 512), ("group", 704), ("row", 768), ("tensor", 256)])
def test_reference_is_llamacpp_bit_for_bit(packing, scale, k):
    rng = np.random.default_rng(k)
    (packed, s, kw), t, s_blocks = tq_layer(rng, 24, k, packing, scale)
    x = tricky_x(rng, 3, k)
    want = ggml_layer(x, t, s_blocks)
    y = reference.ternary_matmul(mx.array(x), packed, s, activation_bits=fmt.Q8K, **kw)
    np.testing.assert_array_equal(np.array(y), want)
    # negative control: BitNet's per-token int8 is a different computation
    other = reference.ternary_matmul(mx.array(x), packed, s, activation_bits=8, **kw)
    assert not np.array_equal(np.array(other), want)


def test_segments_with_small_groups_follow_the_definition():
    """Groups of 64 cut each block: segment sums scaled by their group, in column order."""
    rng = np.random.default_rng(3)
    t = rng.integers(-1, 2, size=(8, 512)).astype(np.int8)
    s = rng.uniform(0.5, 1.5, size=(8, 8)).astype(F32)
    pt = fmt.PackedTernary.from_trits(t, s, "fast", 64)
    x = tricky_x(rng, 2, 512)
    want = np.zeros((2, 8), F32)
    for m in range(2):
        q, d = ggml_q8k(x[m])
        for j in range(8):
            sumi = t[:, 64 * j : 64 * j + 64].astype(np.int64) @ q.reshape(-1)[64 * j : 64 * j + 64]
            want[m] = want[m] + sumi.astype(F32) * (d[j // 4] * s[:, j])
    y = reference.ternary_matmul(
        mx.array(x),
        mx.array(pt.packed),
        mx.array(s),
        packing="fast",
        in_features=512,
        group_size=64,
        activation_bits=fmt.Q8K,
    )
    np.testing.assert_array_equal(np.array(y), want)


def test_layer_activation_bits_and_config():
    assert fmt.layer_activation_bits("model", 8) == 8
    assert fmt.layer_activation_bits("model", None) is None
    assert fmt.layer_activation_bits("float", 8) is None
    assert fmt.layer_activation_bits("q8k", None) == fmt.Q8K
    with pytest.raises(FormatError, match="expected one of model, q8k, float"):
        fmt.layer_activation_bits("int4", None)
    q = fmt.QuantizationConfig(packing="fast", scale="group", group_size=256, activations="q8k")
    d = q.to_dict()
    assert d["activations"] == "q8k"
    assert fmt.QuantizationConfig.from_dict(d).activations == "q8k"
    assert "activations" not in fmt.QuantizationConfig().to_dict()  # older files unchanged
    with pytest.raises(FormatError, match="config.json: quantization.activations is 'int4'"):
        fmt.QuantizationConfig.from_dict({**d, "activations": "int4"})


@needs_native
@pytest.mark.parametrize("packing", ["fast", "compact"])
@pytest.mark.parametrize("scale,k", [("group", 512), ("group", 704), ("row", 768), ("tensor", 256)])
# token tiles (4, compact 8), short tiles, remainders; prefill's row panels (9, 13); 8: one
# token tile of AVX-512's panels, gathered pass by pass (AVX2: its 1 x 8 tiles)
@pytest.mark.parametrize("m", [1, 3, 7, 8, 9, 13])
def test_native_is_llamacpp_bit_for_bit(packing, scale, k, m):
    rng = np.random.default_rng(k + m)
    (packed, s, kw), t, s_blocks = tq_layer(rng, 40, k, packing, scale)
    x = tricky_x(rng, m, k)
    want = ggml_layer(x, t, s_blocks)
    native = cpu.q8k_supported(s, **kw)
    # compact rows of one scale are cut in 160-column steps that straddle the blocks
    assert native == (packing == "fast" or scale == "group" or k <= 320)
    y = dispatch.ternary_matmul(
        mx.array(x), packed, s, activation_bits=fmt.Q8K, backend="native", **kw
    )
    np.testing.assert_array_equal(np.array(y), want)
    if native:
        direct = cpu.ternary_matmul(mx.array(x), packed, s, activation_bits=fmt.Q8K, **kw)
        np.testing.assert_array_equal(np.array(direct), want)
        per_token = cpu.ternary_matmul(mx.array(x), packed, s, activation_bits=8, **kw)
        assert not np.array_equal(np.array(per_token), want)  # negative control
    else:
        with pytest.raises(ValueError, match="q8k activations need steps"):
            cpu.ternary_matmul(mx.array(x), packed, s, activation_bits=fmt.Q8K, **kw)


@needs_native
@pytest.mark.parametrize(
    "n,scale,k",
    [
        (203, "group", 768),
        (1000, "group", 768),
        (37, "row", 768),
        (24, "tensor", 768),
        (21, "group", 2304),  # one row at a time (AVX2): segments in a group of 8 and one more
        (11, "group", 16640),  # 65 segments: longer than that kernel's buffer, the 8-row blocks
    ],
)
def test_native_decode_blocks_chunks_and_threads_are_the_same_bits(n, scale, k):
    """Decode runs 8-row blocks (a tail of n % 8 rows through the row kernel; AVX2 without VNNI:
    one row at a time, 8 segments' sums reduced together) in chunks sized by the thread count; a
    few tokens run 4 x 4 tiles in 16-row chunks, prefill 16-row panels in chunks sized by the
    thread count. Every row of every token must be ggml's, whatever the tokens per call, the
    chunking or the threads."""
    rng = np.random.default_rng(n)
    (packed, s, kw), t, s_blocks = tq_layer(rng, n, k, "fast", scale)
    x = tricky_x(rng, 14, k)
    want = ggml_layer(x, t, s_blocks)
    threads = cpu.info()["threads"]
    try:
        for nt in (1, 2, 3):
            cpu.set_num_threads(nt)
            for m0, m1 in ((0, 1), (1, 2), (2, 4), (1, 4), (0, 5), (0, 6), (0, 13), (1, 14)):
                y = cpu.ternary_matmul(mx.array(x[m0:m1]), packed, s, activation_bits=fmt.Q8K, **kw)
                np.testing.assert_array_equal(np.array(y), want[m0:m1], err_msg=f"{nt} {m0}:{m1}")
    finally:
        cpu.set_num_threads(threads)
    wrong = t.copy()
    wrong[n - 1, 300] = -wrong[n - 1, 300] if wrong[n - 1, 300] else 1  # the tail row: a control
    assert not np.array_equal(ggml_layer(x[:1], wrong, s_blocks), want[:1])


@needs_native
def test_native_prefill_at_the_largest_segment_sums():
    """Rows of all +1 and all -1 trits against tokens of one value each: every Q8_K code is
    +-127, so a +1 row's block sums (codes c = t + 1 = 2) reach 2 * 127 * 256 = 65024, which
    AVX2's row panels add up as two int16 lanes of 32512 (their bound) before widening."""
    n, k, m = 24, 768, 12
    t = np.repeat(np.where(np.arange(n) % 2, -1, 1)[:, None], k, axis=1).astype(np.int8)
    s = np.random.default_rng(3).uniform(0.01, 0.05, size=(n, k // 256)).astype(np.float16)
    pt = fmt.PackedTernary.from_trits(t, s, "fast", 256)
    sign = np.where(np.arange(m) % 2, -1.0, 1.0) * (1 + np.arange(m))
    x = np.repeat(sign[:, None], k, axis=1).astype(F32)
    q = np.stack([ggml_q8k(row)[0] for row in x]).astype(np.int64)  # (m, blocks, 256)
    csum = np.einsum("nbc,mbc->nmb", (t.reshape(n, -1, 256) + 1).astype(np.int64), q)
    assert np.abs(csum).max() == 2 * 127 * 256  # the sums the kernel adds up do reach the bound
    y = cpu.ternary_matmul(
        mx.array(x),
        mx.array(pt.packed),
        mx.array(s),
        activation_bits=fmt.Q8K,
        packing="fast",
        in_features=k,
        group_size=256,
    )
    np.testing.assert_array_equal(np.array(y), ggml_layer(x, t, s.astype(F32)))


@needs_native
@pytest.mark.parametrize("bad", [None, 3, 9, 17])  # no, a first, a middle, the last 8 segments
def test_native_decode_block_scales_with_a_non_finite_scale(bad):
    """The 8-row decode blocks convert their float16 block scales 8 segments at a time (19
    segments a row here: two whole groups of 8, then the last 8 again); a non-finite scale
    takes the scalar conversion for the segments from its group on. Every row is ggml's, inf
    and NaN as the reference twin gives them."""
    rng = np.random.default_rng(19)
    k = 19 * 256
    (packed, s, kw), t, s_blocks = tq_layer(rng, 16, k, "fast", "group")
    if bad is not None:
        sn = np.array(s)
        sn[5, bad] = np.inf
        sn[12, bad] = np.nan
        s = mx.array(sn)
    x = mx.array(tricky_x(rng, 2, k))
    args = dict(activation_bits=fmt.Q8K, **kw)
    y = np.array(cpu.ternary_matmul(x[:1], packed, s, **args))
    want = np.array(reference.ternary_matmul(x[:1], packed, s, **args))
    np.testing.assert_array_equal(y, want)
    if bad is None:
        np.testing.assert_array_equal(want, ggml_layer(np.array(x[:1]), t, s_blocks))
    else:
        assert not np.isfinite(y[0, [5, 12]]).any() and np.isfinite(np.delete(y[0], [5, 12])).all()
    moved = np.array(s).copy()  # a control: another row's scale of a later segment
    moved[7, 18] *= 2
    assert not np.array_equal(
        np.array(cpu.ternary_matmul(x[:1], packed, mx.array(moved), **args)), y
    )


@needs_native
@pytest.mark.parametrize("m", [2, 13])  # tiles; prefill's row panels
def test_native_q8k_bias_dtypes_and_gradient(m):
    rng = np.random.default_rng(7)
    (packed, s, kw), t, s_blocks = tq_layer(rng, 16, 512, "fast", "group")
    x = mx.array(tricky_x(rng, m, 512))
    b = mx.array(rng.normal(size=16).astype(F32))
    args = dict(activation_bits=fmt.Q8K, **kw)
    want = reference.ternary_matmul(x, packed, s, b, **args)
    np.testing.assert_array_equal(
        np.array(cpu.ternary_matmul(x, packed, s, b, **args)), np.array(want)
    )
    xh = x.astype(mx.float16)
    np.testing.assert_array_equal(
        np.array(cpu.ternary_matmul(xh, packed, s, b, **args)),
        np.array(reference.ternary_matmul(xh, packed, s, b, **args)),
    )
    g = mx.grad(lambda v: cpu.ternary_matmul(v, packed, s, **args).sum())(x)
    w = t.astype(F32) * np.repeat(s_blocks, 256, axis=1)  # straight-through: g @ (s t)
    np.testing.assert_allclose(np.array(g), np.ones((m, 16), F32) @ w, rtol=1e-6, atol=1e-6)


@needs_native
def test_load_activations_on_the_embedded_model():
    """load(activations=) sets every layer, records the choice beside the model's own
    definition, and the native model agrees with the reference twin's (the layers are
    bit-exact above; attention and the tables differ between backends by float rounding)."""
    import mlx_ternary
    from mlx_ternary import generate as gen
    from mlx_ternary.runtime.layers import ternary_layers

    path = str(gen.EMBEDDED_MODEL)
    model, _, config = mlx_ternary.load(path, activations="q8k", return_config=True)
    layers = [m for _, m in ternary_layers(model)]
    assert {m.activation_bits for m in layers} == {fmt.Q8K}
    assert config["quantization"]["activations"] == "q8k"
    assert config["quantization"]["activation_bits"] == 8  # the model's own, kept
    # compact rows of 704 columns and one scale cannot run natively as stored: fast-packed
    assert {m.packing for m in layers if m.in_features == 704} == {"fast"}
    twin, _ = mlx_ternary.load(path, activations="q8k", backend="reference")
    tokens = mx.array([[0, 5, 17, 99, 3, 250, 7]])
    np.testing.assert_allclose(np.array(model(tokens)), np.array(twin(tokens)), atol=1e-4)
    own, _ = mlx_ternary.load(path)
    assert {m.activation_bits for _, m in ternary_layers(own)} == {8}
    assert not np.array_equal(np.array(own(tokens)), np.array(model(tokens)))


def test_sharded_to_all_keeps_q8k_local_on_each_rank():
    """Row-parallel layers run llama.cpp's blocks on each rank's columns, not the shared
    per-token quantization; a split that cuts a block quantizes the gathered row instead
    (its numerics under mlx.launch: tests/test_parallel.py, the embedded-q8k case)."""
    from mlx_ternary.runtime.layers import TernaryLinear
    from mlx_ternary.runtime.shard import ShardedToAllTernaryLinear, TernaryParts

    class TwoRanks:  # enough of a group for the split (from_parts runs no collective)
        def size(self):
            return 2

        def rank(self):
            return 0

    rng = np.random.default_rng(11)
    (packed, s, kw), t, s_blocks = tq_layer(rng, 8, 320, "fast", "row")
    layer = TernaryLinear.from_packed(
        fmt.PackedTernary("fast", packed, s, 8, 320), activation_bits=fmt.Q8K
    )
    parts = TernaryParts.of(layer, "down_proj")
    sharded = ShardedToAllTernaryLinear.from_parts(parts)  # one rank: every column local
    assert sharded.activation_bits is None and sharded.linear.activation_bits == fmt.Q8K
    x = tricky_x(rng, 2, 320)
    np.testing.assert_array_equal(np.array(sharded(mx.array(x))), ggml_layer(x, t, s_blocks))
    cut = ShardedToAllTernaryLinear.from_parts(parts, group=TwoRanks())  # 160 columns each
    assert cut.activation_bits == fmt.Q8K and cut.linear.activation_bits is None
