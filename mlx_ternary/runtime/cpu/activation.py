"""The native SwiGLU for models that run on the native backend.

mlx-lm's llama-style MLPs compute `swiglu(gate, x)` = silu(gate) * x. MLX's CPU build
evaluates exp one element at a time: for a 128-token prefill of a 5632-wide MLP that costs
more than the layer's attention. `install(model)` routes mlx-lm's `swiglu` in the modules of
the model's classes the way attention.py routes its attention: **only while this model runs**
(the scope `cpu.enabled()` the routed model's calls run in) and only float32 arrays of one shape on the CPU go to the native
kernel (a vectorized exp, within 2 ulp of float64 - not bit-equal to MLX's); every other call
goes to mlx-lm's own function unchanged. Gradients are the vjp of silu(gate) * x in MLX.
"""

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from .. import patches
from . import active, enabled, swiglu


def _reference(gate, x):
    return nn.silu(gate) * x


@lru_cache(maxsize=None)
def swiglu_kernel():
    @mx.custom_function
    def native_swiglu(gate, x):
        return swiglu(gate, x)

    @native_swiglu.vjp
    def native_swiglu_vjp(primals, cotangent, output):
        return tuple(mx.vjp(_reference, list(primals), [cotangent])[1])

    return native_swiglu


def _dispatcher(original):
    def swiglu_(gate, x, *args, **kwargs):
        if (
            active()
            and not args
            and not kwargs
            and mx.default_device() == mx.cpu
            and gate.dtype == mx.float32
            and x.dtype == mx.float32
            and gate.shape == x.shape
        ):
            return swiglu_kernel()(gate, x)
        return original(gate, x, *args, **kwargs)

    return swiglu_


def install(model) -> bool:
    """Route `model`'s mlx-lm `swiglu` to the native kernel; False if its modules call none."""
    return patches.route_swiglu(model, _dispatcher, enabled)


def routed(model) -> bool:
    """Whether `install` routed `model`'s `swiglu` (float32 calls on the CPU run natively)."""
    return patches.swiglu_routed(model, enabled)
