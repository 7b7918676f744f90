"""The packed layouts: codes, round trips, sizes, the worked examples in docs/FORMAT.md."""

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_ternary import format as F
from mlx_ternary.errors import FormatError
from mlx_ternary.ternarize import ternarize

DOCS = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"
ODD_K = [1, 4, 5, 7, 31, 32, 33, 100, 128, 129, 257, 300]
SCALES = [("tensor", None), ("row", None), ("group", 64), ("group", 128), ("group", 256)]


def test_all_243_byte_codes_decode_to_their_digits():
    v = np.arange(243)
    digits = np.stack([(v // 3 ** (4 - i)) % 3 for i in range(5)], axis=-1)
    q = ((v * 256 + 242) // 243).astype(np.uint8)
    assert len(set(q.tolist())) == 243
    np.testing.assert_array_equal(F.decode_compact_bytes(q), digits)
    # The table index of a byte is recoverable with one multiply and shift.
    np.testing.assert_array_equal((q.astype(np.uint32) * 243) >> 8, v)
    # And pack_compact produces exactly these bytes, one 5-trit column group at a time.
    t = (digits - 1).astype(np.int8)  # (243, 5): one row per code
    np.testing.assert_array_equal(F.pack_compact(t)[:, 0], q)


def test_top_byte_compare_decoder_matches():
    # The GPU decoder keeps q in the top byte of a 32-bit register: x*3 wraps by itself and
    # the digit is two unsigned compares. Check it against the multiply-shift definition.
    q = ((np.arange(243) * 256 + 242) // 243).astype(np.uint64)
    x = (q << 24) & 0xFFFFFFFF
    got = []
    for _ in range(5):
        got.append((x >= 86 << 24).astype(int) + (x >= 171 << 24).astype(int))
        x = (x * 3) & 0xFFFFFFFF
    np.testing.assert_array_equal(np.stack(got, -1), F.decode_compact_bytes(q.astype(np.uint8)))


@pytest.mark.parametrize("packing", F.PACKINGS)
@pytest.mark.parametrize("k", ODD_K)
@pytest.mark.parametrize("scale,group", SCALES)
def test_round_trip_numpy_and_mlx(packing, k, scale, group):
    rng = np.random.default_rng(k)
    t = rng.integers(-1, 2, (3, k)).astype(np.int8)
    packed = F.pack(t, packing, group)
    assert packed.shape == F.packed_shape(packing, 3, k, group)
    np.testing.assert_array_equal(F.unpack(packed, packing, k, group), t)
    packed_mx = F.pack_mx(mx.array(t), packing, group)
    np.testing.assert_array_equal(np.array(packed_mx), packed)  # byte for byte
    np.testing.assert_array_equal(np.array(F.unpack_mx(mx.array(packed), packing, k, group)), t)


def test_padding_trits_are_zero():
    t = np.ones((2, 7), np.int8)
    fast = F.unpack_fast(F.pack_fast(t), 32)
    assert (fast[:, 7:] == 0).all()
    comp = F.unpack_compact(F.pack_compact(t), 10)
    assert (comp[:, 7:] == 0).all()


def test_fast_layout_is_mlx_affine_2bit():
    # mx.dequantize (MLX's own decoder) must read a fast tensor as t * s with bias -s.
    rng = np.random.default_rng(0)
    t = rng.integers(-1, 2, (8, 256)).astype(np.int8)
    s = rng.uniform(0.01, 0.1, (8, 2)).astype(np.float32)
    w = F.pack_fast(t)
    deq = mx.dequantize(mx.array(w), mx.array(s), mx.array(-s), group_size=128, bits=2)
    np.testing.assert_array_equal(np.array(deq), t * np.repeat(s, 128, axis=1))


def test_mx_quantize_2bit_is_lossy_on_ternary():
    # Why the codes are built by hand: MLX's own 2-bit quantizer maps ternary to other levels.
    rng = np.random.default_rng(1)
    w = (rng.integers(-1, 2, (4, 128)) * 0.05).astype(np.float32)
    q = mx.quantize(mx.array(w), group_size=128, bits=2)
    deq = np.array(mx.dequantize(*q, group_size=128, bits=2))
    assert np.abs(deq - w).max() > 1e-3


def _examples():
    text = DOCS.read_text()
    blocks = re.findall(r"```text example=(\w+) K=(\d+)\n(.*?)```", text, re.S)
    assert {b[0] for b in blocks} == {"compact", "fast"}
    return blocks


@pytest.mark.parametrize("example", _examples(), ids=lambda e: e[0])
def test_worked_examples_in_format_md(example):
    packing, k, body = example
    rows = dict(re.findall(r"^(\w+ \d+): (.*)$", body, re.M))
    trits = np.array([[int(v) for v in rows[f"trits {i}"].split()] for i in range(2)], np.int8)
    assert trits.shape == (2, int(k))
    packed = F.pack(trits, packing)
    if packing == "compact":
        want = np.array(
            [[int(b, 16) for b in rows[f"bytes {i}"].split()] for i in range(2)], np.uint8
        )
    else:
        want = np.array(
            [[int(b, 16) for b in rows[f"words {i}"].split()] for i in range(2)], np.uint32
        )
    np.testing.assert_array_equal(packed, want)
    np.testing.assert_array_equal(F.unpack(want, packing, int(k)), trits)


@pytest.mark.parametrize("k", [2560, 5120, 6912, 17408])
def test_bits_per_weight_budgets(k):
    n = 64  # bits per weight depend on K (rows are independent); 64 rows keep it fast
    rng = np.random.default_rng(0)
    t = rng.integers(-1, 2, (n, k)).astype(np.int8)
    budgets = {
        ("compact", "tensor"): 1.70,
        ("compact", "row"): 1.70,
        ("compact", "group"): 1.75,
        ("fast", "tensor"): 2.05,
        ("fast", "row"): 2.05,
        ("fast", "group"): 2.13,
    }
    for (packing, scale), limit in budgets.items():
        g = 128 if scale == "group" else None
        s = np.ones(F.scales_shape(scale, n, k, g), np.float16)
        bpw = F.PackedTernary.from_trits(t, s, packing, g).bits_per_weight
        assert bpw <= limit, (packing, scale, bpw)


def test_unknown_format_version_is_refused_with_file_and_versions():
    with pytest.raises(FormatError, match=r"some/config.json.*format_version 99.*known: 1"):
        F.QuantizationConfig.from_dict(
            {"format": "mlx-ternary", "format_version": 99, "packing": "compact"},
            "some/config.json",
        )


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("packing", "zip", "quantization.packing"),
        ("scale", "col", "quantization.scale"),
        ("activation_bits", 4, "quantization.activation_bits"),
    ],
)
def test_bad_quantization_fields_name_the_field(field, value, msg):
    d = {"format": "mlx-ternary", "format_version": 1, field: value}
    with pytest.raises(FormatError, match=msg):
        F.QuantizationConfig.from_dict(d, "x/config.json")


def test_non_trit_values_are_refused_with_name_and_position():
    t = np.zeros((2, 3), np.int8)
    t[1, 2] = 2
    with pytest.raises(FormatError, match=r"layer\.weight: value 2 at \(1, 2\)"):
        F.PackedTernary.from_trits(t, np.ones((2, 1), np.float32), name="layer.weight")


def test_ternarize_group_scales_use_true_group_counts():
    w = np.zeros((1, 70), np.float32)
    w[0, :64] = 0.5
    w[0, 64:] = -0.25  # a partial last group of 6 columns
    t, s = ternarize(w, "group", 64)
    np.testing.assert_allclose(s, [[0.5, 0.25]])
    np.testing.assert_array_equal(t[0, :64], 1)
    np.testing.assert_array_equal(t[0, 64:], -1)


def test_repack_is_lossless():
    rng = np.random.default_rng(3)
    t = rng.integers(-1, 2, (5, 99)).astype(np.int8)
    s = rng.uniform(0.1, 1, (5, 1)).astype(np.float32)
    pt = F.PackedTernary.from_trits(t, s, "compact")
    back = pt.repack("fast").repack("compact")
    np.testing.assert_array_equal(back.packed, pt.packed)
    np.testing.assert_array_equal(pt.repack("fast").dequantize(), t * s)


def test_affine_tensor_matches_mlx_dequantize():
    # An AffineTensor is mlx-lm's QuantizedLinear triple: its dequantize is mx.dequantize's.
    w = mx.random.normal((8, 128), key=mx.random.key(3))
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    at = F.AffineTensor(q, s, b, bits=4, group_size=64)
    assert at.shape == (8, 128)
    ref = np.array(mx.dequantize(q, s, b, group_size=64, bits=4))
    np.testing.assert_array_equal(np.array(at.dequantize()), ref)
    assert np.abs(ref - np.array(w)).max() < 0.5  # the quantized weight is near the float one
    assert at.nbytes == q.nbytes + s.nbytes + b.nbytes


@pytest.mark.parametrize("bad", ["Fast", "ternary", "", "2bit"])
def test_unknown_packing_is_refused_naming_it_and_the_allowed_ones(bad):
    t = np.zeros((2, 40), np.int8)
    calls = [
        lambda: F.pack_mx(mx.array(t), bad),
        lambda: F.unpack_mx(mx.zeros((2, 4), dtype=mx.uint32), bad, 40),
        lambda: F.pack(t, bad),
        lambda: F.unpack(np.zeros((2, 4), np.uint32), bad, 40),
        lambda: F.packed_shape(bad, 2, 40),
        lambda: F.packed_dtype(bad),
        lambda: F.check_packing(bad),
    ]
    for call in calls:
        with pytest.raises(FormatError) as e:
            call()
        assert repr(bad) in str(e.value) and "'compact', 'fast'" in str(e.value)
    with pytest.raises(FormatError, match="quantization.packing"):
        F.QuantizationConfig(packing=bad)


@pytest.mark.parametrize("packing", F.PACKINGS)
@pytest.mark.parametrize("k", [7, 40, 129])
def test_valid_packings_round_trip_between_mlx_and_numpy(packing, k):
    rng = np.random.default_rng(k)
    t = rng.integers(-1, 2, size=(3, k)).astype(np.int8)
    assert F.check_packing(packing) == packing
    packed = F.pack_mx(mx.array(t), packing, None)
    np.testing.assert_array_equal(np.array(packed), F.pack(t, packing))  # numpy's bytes
    np.testing.assert_array_equal(np.array(F.unpack_mx(packed, packing, k)), t)


def test_packing_codes_are_one_table():
    assert F.PACKINGS == tuple(F.PACKING_CODES) == ("compact", "fast")
    assert sorted(F.PACKING_CODES.values()) == [0, 1]
    assert [F.packing_code(p) for p in F.PACKINGS] == [0, 1]
    # Affine (MLX quantize) and ternary group sizes are different facts with their own names.
    assert F.TERNARY_GROUP_SIZES == (64, 128, 256) and F.AFFINE_GROUP_SIZES == (32, 64, 128)
    assert not hasattr(F, "GROUP_SIZES")  # one name per table: no ambiguous alias
