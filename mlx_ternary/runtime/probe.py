"""Safe first use: every Metal kernel variant is checked against its reference twin once.

No kernel here has been through Apple's compiler on every chip, so the first call of each
variant (kernel, template arguments, which inputs MLX binds as `constant`) in a process
compiles it and runs it on a small probe layer of the same variant, against
reference.ternary_matmul on the same inputs. A compile error, any other exception or a
wrong result logs one warning naming the kernel, the variant and the chip, and that
variant runs the reference path for the rest of the process. The probe evaluates only its
own arrays, which MLX allows inside mx.compile, gradients and export tracing too.
"""

import warnings
from contextlib import contextmanager
from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from .. import format as fmt
from . import reference
from .metal import launch

# Max |kernel - twin| / max |twin| a probe accepts, per activation dtype: the output's own
# rounding plus the offset decode (docs/KERNELS.md), with room for another summation order.
PROBE_TOL = {mx.float32: 1e-3, mx.float16: 1e-2, mx.bfloat16: 6e-2}
PROBE_ROWS = 24
PROBE_TOKENS_GEMM = 70  # two 64-token tiles, the second partial

_STATUS: Dict[tuple, bool] = {}  # variant -> passed
_FAILURES: Dict[tuple, str] = {}  # variant -> why
trusting = False


class KernelCheckWarning(RuntimeWarning):
    """A Metal kernel variant failed its first-use check and was replaced by the reference."""


@contextmanager
def trusted():
    """Within the block, variants are not probed (benchmark stubs whose output is not real)."""
    global trusting
    old, trusting = trusting, True
    try:
        yield
    finally:
        trusting = old


def chip() -> str:
    """The GPU's name and architecture, as MLX reports them."""
    try:
        info = mx.device_info()
    except (RuntimeError, ValueError):  # no device information on this backend
        return "unknown device"
    name = str(info.get("device_name", "unknown device"))
    arch = info.get("architecture")
    return f"{name} ({arch})" if arch else name


def failures() -> Dict[tuple, str]:
    """{variant: reason} of the variants that failed in this process."""
    return dict(_FAILURES)


def reset() -> None:
    """Forget every result (tests; a process normally keeps them)."""
    _STATUS.clear()
    _FAILURES.clear()


def probe_shape(spec: launch.LayerSpec) -> tuple:
    """(N, K) of a small layer with the same template arguments as `spec`: K keeps its
    residue mod 32 (alignment variants), N stays under 8 only if it was."""
    n = min(spec.n, PROBE_ROWS)
    k = spec.k if spec.k <= 544 else 512 + spec.k % 32
    return n, k


def _probe_layer(spec: launch.LayerSpec, n: int, k: int, seed: int = 0):
    """(spec, packed, scales, bias) of a random layer shaped (n, k) like `spec`."""
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    kind = fmt.SCALE_KINDS[spec.mode]
    s = rng.uniform(0.5, 1.5, size=fmt.scales_shape(kind, n, k, spec.group_size))
    pt = fmt.PackedTernary.from_trits(t, s.astype(np.float32), spec.packing, spec.group_size)
    packed = mx.array(pt.packed)
    scales = mx.array(s.astype(np.float32)).astype(spec.scale_dtype)
    bias = (
        mx.array(rng.normal(size=(n,)).astype(np.float32)).astype(spec.bias_dtype)
        if spec.has_bias
        else None
    )
    small = launch.check_layer(
        packed,
        scales,
        bias,
        packing=spec.packing,
        in_features=k,
        group_size=spec.group_size,
        activation_bits=8 if spec.act else None,
    )
    return small, packed, scales, bias


def _run_probe(spec, dtype, m, backend, variant) -> Optional[str]:
    """None when the variant matches its twin on a probe input, else the reason."""
    n, k = probe_shape(spec)
    m = m if m <= launch.MAX_GEMV_TOKENS else PROBE_TOKENS_GEMM  # one GEMM variant
    small, packed, scales, bias = _probe_layer(spec, n, k)
    run, got_variant = launch.prepare(small, packed, scales, bias, dtype, (m, small.k), backend)
    if got_variant != variant:  # a probe shape of another binding class: use the real one
        small, packed, scales, bias = _probe_layer(spec, spec.n, spec.k)
        run, got_variant = launch.prepare(small, packed, scales, bias, dtype, (m, small.k), backend)
    rng = np.random.default_rng(1)
    x = mx.array(rng.normal(size=(m, small.k)).astype(np.float32)).astype(dtype)
    twin = reference.ternary_matmul(
        x,
        packed,
        scales,
        bias,
        packing=small.packing,
        in_features=small.k,
        group_size=small.group_size,
        activation_bits=8 if small.act else None,
    )
    y = run(x)
    mx.eval(y, twin)
    got = np.array(y.astype(mx.float32)).astype(np.float64)
    want = np.array(twin.astype(mx.float32)).astype(np.float64)
    if got.shape != want.shape:
        return f"output shape {got.shape}, expected {want.shape}"
    if not np.isfinite(got).all():
        return "non-finite output"
    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))
    if err > PROBE_TOL[dtype]:
        return (
            f"max relative error {err:.3g} against the reference twin (limit {PROBE_TOL[dtype]:g})"
        )
    return None


def construction_failed(spec: launch.LayerSpec, error: Exception) -> None:
    """A kernel whose construction (`mx.fast.metal_kernel(...)` itself) raised: warns once
    per kind of layer and remembers it; the caller runs the reference path."""
    key = ("construct", spec.packing, spec.mode, spec.group_size, spec.act, spec.has_bias)
    if key in _FAILURES:
        return
    first = str(error).splitlines()[0] if str(error) else ""
    _FAILURES[key] = f"{type(error).__name__}: {first}"
    warnings.warn(
        f"mlx-ternary: the Metal kernel for {spec.packing} layers (scale {spec.mode}) could "
        f"not be constructed on {chip()} ({_FAILURES[key]}); these layers run the reference "
        "path (exact, slower) for the rest of the process",
        KernelCheckWarning,
        stacklevel=4,
    )


def check(spec: launch.LayerSpec, dtype, m: int, backend: str, variant: tuple) -> bool:
    """True when the variant may run: checked now on first use, remembered after.

    On failure, warns once (KernelCheckWarning) and returns False from then on.
    """
    if trusting:
        return True
    status = _STATUS.get(variant)
    if status is not None:
        return status
    try:
        why = _run_probe(spec, dtype, m, backend, variant)
    except Exception as e:  # noqa: BLE001 - any failure of an unchecked kernel means fallback
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    _STATUS[variant] = why is None
    if why is not None:
        _FAILURES[variant] = why
        name = "+".join(v[0] for v in variant)
        templates = "; ".join(", ".join(f"{k}={val}" for k, val in v[1]) for v in variant)
        warnings.warn(
            f"mlx-ternary: Metal kernel {name} [{templates}] failed its first-use check on "
            f"{chip()} ({why}); calls of this variant run the reference path (exact, slower) "
            "for the rest of the process",
            KernelCheckWarning,
            stacklevel=3,
        )
    return why is None
