"""The packing code table (format.PACKING_CODES) is the one both kernel families read: the
Metal kernels' PACKING template constant and the native CPU backend's packing argument."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_ternary import format as F
from mlx_ternary.runtime import cpu, reference
from mlx_ternary.runtime.metal import launch

K, N = 96, 8


def _layer(packing):
    rng = np.random.default_rng(0)
    t = rng.integers(-1, 2, size=(N, K)).astype(np.int8)
    s = rng.uniform(0.5, 1.5, size=(N, 1)).astype(np.float32)
    pt = F.PackedTernary.from_trits(t, s, packing)
    return mx.array(pt.packed), mx.array(pt.scales)


def _gemm_packing_constant(packing) -> str:
    packed, scales = _layer(packing)
    spec = launch.check_layer(
        packed, scales, None, packing=packing, in_features=K, group_size=None, activation_bits=None
    )
    _, variant = launch.prepare(spec, packed, scales, None, mx.float32, (64, K), "emulate")
    name, template, _ = variant[-1]
    assert name == "gemm"
    return dict(template)["PACKING"]


def test_both_launchers_take_the_code_from_format():
    assert launch.packing_code is F.packing_code
    assert cpu.packing_code is F.packing_code
    for packing, code in F.PACKING_CODES.items():
        assert _gemm_packing_constant(packing) == str(code)


def test_a_changed_table_changes_what_metal_is_given(monkeypatch):
    monkeypatch.setitem(F.PACKING_CODES, "compact", 7)
    assert _gemm_packing_constant("compact") == "7"


@pytest.mark.native
def test_native_enum_is_the_table():
    m = cpu.require()
    assert {"compact": m.PACKING_COMPACT, "fast": m.PACKING_FAST} == F.PACKING_CODES


@pytest.mark.native
@pytest.mark.parametrize("packing", F.PACKINGS)
def test_native_reads_the_table(packing, monkeypatch):
    packed, scales = _layer(packing)
    x = mx.array(np.random.default_rng(1).normal(size=(3, K)).astype(np.float32))
    kw = dict(packing=packing, in_features=K)
    want = reference.ternary_matmul(x, packed, scales, **kw)
    np.testing.assert_allclose(
        np.array(cpu.ternary_matmul(x, packed, scales, **kw)), np.array(want), rtol=1e-5, atol=1e-4
    )
    # Negative control: the other packing's code makes the C++ expect the other layout.
    other = {"compact": "fast", "fast": "compact"}[packing]
    monkeypatch.setitem(F.PACKING_CODES, packing, F.PACKING_CODES[other])
    with pytest.raises(ValueError, match=f"{other} \\("):
        mx.eval(cpu.ternary_matmul(x, packed, scales, **kw))
