"""The fused native decoder block: a llama-family layer in three native ops.

A decode step of mlx-lm's llama block on MLX's CPU backend is ~25 small ops (two RMSNorms
and two RoPEs are MLX fallbacks of 5-15 ops each, the projections, transposes, adds), each
~30 us of MLX's per-op cost plus the Python that builds them. `install(model)` swaps the
class of each of the model's supported blocks (mlx-lm's llama, qwen2 and qwen3
TransformerBlock: ARCHS) for a subclass of the same name whose
`__call__` runs, where it computes exactly what mlx-lm's block computes:

    q, k, v = attn_in(x)        RMSNorm, one activation preparation for q/k/v, their rows in
                                one parallel_for, RoPE, the (B, H, L, D) layout
    k, v = cache.update_and_fetch(k, v)      mlx-lm's own cache (trim, save, batch: as ever)
    h = attn_out(q, k, v, residual=x)        the native attention, o_proj
    out = mlp(h, residual=h)                 RMSNorm, gate+up sharing their activations,
                                             the native SwiGLU, down

(csrc/block.h). The ops reproduce MLX's CPU arithmetic step by step (its RMSNorm and RoPE
fallbacks, with MLX's own sin/cos/exp) and use the kernels the unfused path routes to, so a
fused block returns the unfused block's bits (tests/runtime/test_block.py).

The fused path runs only when all of this holds, else mlx-lm's own `__call__` runs:
inside the model's `enabled()` scope (cpu/__init__.py), the setting on (`MLX_TERNARY_FUSED`,
`set_enabled`), the CPU, float32 input, the block not training, its attention and MLP the
module's own classes, each projection a plain TernaryLinear on the native kernel
(`TernaryLinear.native_spec`: no LoRA/DoRA wrapper, no sharded layer), q/k/v (and gate/up)
sharing one activation preparation, the norms (qwen3's head norms too) nn.RMSNorm with
float32 weights, a RoPE whose arithmetic the op reproduces (nn.RoPE,
Llama3RoPE, YarnRoPE with mscale 1), the cache None, a KVCache or a BatchKVCache (so
quantized and rotating caches keep mlx-lm's path) that the call does not grow past its
filled buffers (once every 256 tokens: see `_cache_kind`), the mask None, "causal" or a bool array.
Gradients: a block in training mode (mlx-lm's trainer sets it) runs mlx-lm's block; elsewhere
(mx.grad of a model in eval mode) the ops' vjp is that of MLX's own ops composing the same
function, with the layers' straight-through vjp: the unfused block's gradient.

Tensor parallelism: `attn_out` and `mlp` take `residual=None` and then return the partial
projection, for an all_sum before the residual is added: a tensor-parallel block runs so
through FORMS (runtime/shard_block.py).
"""

import os
from functools import lru_cache, partial
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ...format import Q8K, packing_code
from .. import patches
from . import active, require

ENV_FUSED = "MLX_TERNARY_FUSED"
# mlx-lm's modules whose TransformerBlock is the llama block (qwen2: q/k/v biases; qwen3:
# an RMSNorm of each q and k head before RoPE), all with `swiglu` MLPs
ARCHS = ("llama", "qwen2", "qwen3")
_state = {"on": None}  # None: $MLX_TERNARY_FUSED decides (default on)
# Other forms of a block's layers, tried in turn where they are not the plain ones: each
# (block, x, cache, mod, offset, how) -> the block's output, or None where it does not
# apply (runtime/shard_block.py adds the tensor-parallel block)
FORMS = []


def set_enabled(on: Optional[bool]) -> None:
    """Turn the fused block on or off for this process (None: back to $MLX_TERNARY_FUSED)."""
    _state["on"] = on


def is_enabled() -> bool:
    """Whether routed blocks take the fused path (where it applies): `set_enabled`, else
    $MLX_TERNARY_FUSED (0/false/off turns it off; default on)."""
    on = _state["on"]
    if on is None:
        return os.environ.get(ENV_FUSED, "1").lower() not in ("0", "false", "off")
    return on


def _spec(layer):
    """The native kernel's arguments for a projection, or None (see native_spec)."""
    spec = getattr(layer, "native_spec", None)
    if spec is None:
        return None
    s = spec()
    if s is None:
        return None
    packed, scales, bias, packing, k, group, bits = s
    act = require().ACT_Q8K if bits == Q8K else bits or 0
    group = group or 0 if scales.shape[1] > 1 else 0
    return packed, scales, bias, (packing_code(packing), k, group, act)


def _group(specs):
    """(packed, scales, biases, geometry) of projections sharing one activation preparation."""
    if any(s is None for s in specs) or len({s[3] for s in specs}) != 1:
        return None
    return [s[0] for s in specs], [s[1] for s in specs], [s[2] for s in specs], specs[0][3]


def _norm(norm):
    if type(norm) is not nn.RMSNorm or norm.weight.dtype != mx.float32:
        return None
    return norm.weight, float(norm.eps)


def _rope(rope):
    """(dims, traditional, base, scale, freqs) the op reproduces for `rope`, or None."""
    if type(rope) is nn.RoPE:
        return rope.dims, bool(rope.traditional), float(rope.base), float(rope.scale), None
    from mlx_lm.models import rope_utils

    if type(rope) is rope_utils.Llama3RoPE or (
        type(rope) is rope_utils.YarnRoPE and rope.mscale == 1.0
    ):
        return rope.dims, bool(rope.traditional), None, 1.0, rope._freqs
    return None


def _cache_kind(cache, tokens: int):
    """The cache's offset as (int, None) or (0, array), or None for an unsupported cache and
    for a call that grows a filled cache: mlx-lm concatenates the old buffers with a new
    step, and the fused layers' fewer, larger tasks let MLX run ~4 layers ahead, so ~4
    layers' old and new buffers would be live at once (memory.py plans for one)."""
    if cache is None:
        return 0, None
    from mlx_lm.models.cache import BatchKVCache, KVCache

    kind = type(cache)
    if kind not in (KVCache, BatchKVCache):
        return None
    used = cache.offset if kind is KVCache else cache._idx
    if cache.keys is not None and used + tokens > cache.keys.shape[2]:
        return None
    return (int(cache.offset), None) if kind is KVCache else (0, cache.offset)


def _mask(mask):
    """(causal, mask array) for the native attention, or None."""
    if mask is None:
        return False, None
    if isinstance(mask, str):
        return (True, None) if mask == "causal" else None
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim <= 4:
        return False, mask
    return None


def _plain_projections(attn, mlp):
    """(qkv, gate_up, o, down) native specs of plain TernaryLinear projections."""
    qkv = _group([_spec(attn.q_proj), _spec(attn.k_proj), _spec(attn.v_proj)])
    gate_up = _group([_spec(mlp.gate_proj), _spec(mlp.up_proj)])
    return qkv, gate_up, _spec(attn.o_proj), _spec(mlp.down_proj)


def parts(block, mod, projections=_plain_projections):
    """What the fused ops need of a block of mlx-lm's module `mod`, or None; `projections`
    (attn, mlp) -> (qkv, gate_up, o, down) or None reads the layers (shard_block.py reads
    sharded ones)."""
    attn, mlp = block.self_attn, block.mlp
    if type(attn) is not mod.Attention or type(mlp) is not mod.MLP:
        return None
    proj = projections(attn, mlp)
    if proj is None:
        return None
    qkv, gate_up, o, down = proj
    n1, n2 = _norm(block.input_layernorm), _norm(block.post_attention_layernorm)
    rope = _rope(attn.rope)
    if None in (n1, n2, qkv, gate_up, o, down, rope):
        return None
    head_norms = (None, None, 0.0)
    if "q_norm" in attn:  # qwen3: RMSNorm of each q and k head before RoPE
        qn, kn = _norm(attn.q_norm), _norm(attn.k_norm)
        if qn is None or kn is None or qn[1] != kn[1]:
            return None
        head_norms = (qn[0], kn[0], qn[1])
    return n1, n2, qkv, gate_up, o, down, rope, head_norms


def _fused(block, x, mask, cache, mod):
    """mlx-lm's `mod`.TransformerBlock.__call__ in three native ops, or None."""
    if (
        not (active() and is_enabled())
        or block.training
        or mx.default_device() != mx.cpu
        or not isinstance(x, mx.array)
        or x.dtype != mx.float32
        or x.ndim != 3
    ):
        return None
    found = parts(block, mod)
    offset = _cache_kind(cache, x.shape[1])
    how = _mask(mask)
    if found is None and offset is not None and how is not None:
        for form in FORMS:
            out = form(block, x, cache, mod, offset, how)
            if out is not None:
                return out
    if found is None or offset is None or how is None:
        return None
    (w1, eps1), (w2, eps2), qkv, gate_up, o, down, rope, head_norms = found
    attn = block.self_attn
    n_heads, n_kv_heads = attn.n_heads, attn.n_kv_heads
    head_dim = qkv[0][0].shape[0] // n_heads
    m = require()
    q, k, v = m.attn_in(
        x, w1, eps1, *qkv[:3], *qkv[3], n_heads, n_kv_heads, head_dim, *rope, *offset,
        *head_norms,
    )  # fmt: skip
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    causal, mask_array = how  # a bool mask that does not fit raises, as mlx-lm's would
    h = m.attn_out(q, k, v, attn.scale, causal, mask_array, *o[:3], *o[3], x)
    return m.mlp(h, w2, eps2, *gate_up[:3], *gate_up[3], *down[:3], *down[3], h)


@lru_cache(maxsize=None)
def _blocks():
    """mlx-lm's block classes the fused path computes, each with its call."""
    import importlib

    out = {}
    for name in ARCHS:
        mod = importlib.import_module(f"mlx_lm.models.{name}")
        out[mod.TransformerBlock] = partial(_fused, mod=mod)
    return out


def install(model) -> bool:
    """Route `model`'s supported mlx-lm blocks (ARCHS' TransformerBlock) through the fused
    path; False if it has none (then nothing changes)."""
    return patches.route_blocks(model, _blocks())


def routed(model) -> bool:
    """Whether `install` routed any of `model`'s blocks."""
    return patches.blocks_routed(model)
