"""The native attention for models that run on the native backend.

MLX's CPU `scaled_dot_product_attention` falls back to matmuls on the reference BLAS the
mlx[cpu] wheel links: about half of a prefill and a tenth of a decode step of a 12-layer
model (docs/NATIVE.md). mlx-lm's attention modules call `scaled_dot_product_attention` from
their own module's namespace; `install(model)` puts a pass-through there that, **only while
this model runs** (a thread-local flag set around the model's `__call__`) and only for what
the native kernel does exactly (float32 queries on the CPU, float32 or float16 keys and
values; no mask, "causal" or a boolean mask; no
attention sinks, no quantized KV cache), calls the native kernel; every other call - other
models, additive float masks, GPUs - goes to mlx-lm's own function unchanged. Boolean masks
are what mlx-lm's batches use (causal plus left padding): the kernel never reads the keys
they drop, so each row of a batch gets the bits of its sequence run alone (mlx-lm's batch
tests compare them); were they sent to MLX's attention instead, batched and single decoding
would differ in the last bits. Gradients are the vjp of MLX's own attention
(`mx.custom_function`), so training through it is unchanged too.
"""

from functools import lru_cache

import mlx.core as mx

from .. import patches
from . import active, enabled, require

# The keys' and values' dtypes the kernel reads (float16: the fused block's KV cache)
KV_DTYPES = (mx.float32, mx.float16)


@lru_cache(maxsize=None)
def attention_kernel(scale: float, causal: bool):
    mask = "causal" if causal else None

    @mx.custom_function
    def attention(q, k, v):
        return require().attention(q, k, v, scale, causal)

    @attention.vjp
    def attention_vjp(primals, cotangent, output):
        def reference(q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

        return tuple(mx.vjp(reference, list(primals), [cotangent])[1])

    return attention


@lru_cache(maxsize=None)
def _masked_attention(scale: float):
    @mx.custom_function
    def attention(q, k, v, mask):
        return require().attention(q, k, v, scale, False, mask)

    @attention.vjp
    def attention_vjp(primals, cotangent, output):
        q, k, v, mask = primals

        def reference(q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

        return (*mx.vjp(reference, [q, k, v], [cotangent])[1], mx.zeros_like(mask))

    return attention


def _native_mask(mask, queries, keys) -> bool:
    """Whether the native kernel takes `mask`: None, "causal", or a bool array that broadcasts
    to (B, H, Lq, Lk)."""
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim > 4:
        return False
    full = (*queries.shape[:3], keys.shape[2])
    padded = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    return all(m in (1, f) for m, f in zip(padded, full))


def scaled_dot_product_attention(queries, keys, values, *, scale: float, mask=None):
    """The native attention, or None where it does not apply (the caller falls back)."""
    if (
        mx.default_device() != mx.cpu
        or any(a.ndim != 4 for a in (queries, keys, values))
        or queries.dtype != mx.float32
        or keys.dtype != values.dtype
        or keys.dtype not in KV_DTYPES
        or not _native_mask(mask, queries, keys)
    ):
        return None
    if isinstance(mask, mx.array):
        return _masked_attention(float(scale))(queries, keys, values, mask)
    return attention_kernel(float(scale), mask is not None)(queries, keys, values)


def _dispatcher(original):
    def scaled_dot_product_attention_(queries, keys, values, cache, scale, mask, **kwargs):
        # Keywords are passed on as given (mlx-lm versions differ in them, e.g. `sinks`);
        # any that is set, attention sinks included, keeps mlx-lm's own attention.
        if active() and all(v is None for v in kwargs.values()) and not hasattr(cache, "bits"):
            out = scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
            if out is not None:
                return out
        return original(queries, keys, values, cache, scale=scale, mask=mask, **kwargs)

    return scaled_dot_product_attention_


def install(model) -> bool:
    """Route `model`'s mlx-lm attention to the native kernel; False if its modules call no
    mlx-lm `scaled_dot_product_attention` (then nothing changes)."""
    return patches.route_attention(model, _dispatcher, enabled)


def routed(model) -> bool:
    """Whether `install` routed `model`'s attention (float32 calls on the CPU then run the
    native kernel, which builds no score matrix)."""
    return patches.attention_routed(model, enabled)
