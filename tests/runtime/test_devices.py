"""The device tiers: TernaryLinear on a real GPU equals float64 numpy. Skipped (with the
reason) where the machine has no such device; the same kernels run through the CPU emulator
and the pure-MLX twins in the ordinary tests."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_ternary import format as fmt
from mlx_ternary.runtime.layers import TernaryLinear


def _case(packing, backend, m=3, n=96, k=320, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    s = rng.uniform(0.5, 1.5, size=(n, 1)).astype(np.float32)
    x = rng.normal(size=(m, k)).astype(np.float32)
    layer = TernaryLinear(k, n, bias=False, packing=packing, backend=backend)
    layer.packed = fmt.pack_mx(mx.array(t), packing)
    layer.scales = mx.array(s)
    return layer, x, x.astype(np.float64) @ (t * s).astype(np.float64).T


def _check_on(device, backend, packing):
    layer, x, want = _case(packing, backend)
    with mx.stream(mx.default_stream(device)):
        y = np.array(layer(mx.array(x)), dtype=np.float64)
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-4
    # Negative control: one trit changed moves its row's outputs far past that bound.
    t = np.array(fmt.unpack_mx(layer.packed, packing, layer.in_features))
    t[0, 0] = 1 if t[0, 0] != 1 else -1
    bad = x.astype(np.float64) @ (t * np.array(layer.scales)).astype(np.float64).T
    assert np.abs(y - bad).max() / np.abs(want).max() > 1e-3


@pytest.mark.metal
@pytest.mark.parametrize("packing", fmt.PACKINGS)
def test_metal_kernels_on_the_gpu(packing):
    _check_on(mx.gpu, "metal", packing)


@pytest.mark.cuda
@pytest.mark.parametrize("packing", fmt.PACKINGS)
def test_reference_twins_on_cuda(packing):
    _check_on(mx.gpu, "reference", packing)


@pytest.mark.native
@pytest.mark.parametrize("packing", fmt.PACKINGS)
def test_native_kernel_on_the_cpu(packing):
    _check_on(mx.cpu, "native", packing)
