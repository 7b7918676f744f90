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

(csrc/ops/block.h). The ops reproduce MLX's CPU arithmetic step by step (its RMSNorm and RoPE
fallbacks, with MLX's own sin/cos/exp) and use the kernels the unfused path routes to, so a
fused block returns the unfused block's bits (tests/runtime/test_block.py).

The fused path runs only when all of this holds, else mlx-lm's own `__call__` runs:
inside the model's `enabled()` scope (cpu/__init__.py), the setting on (`MLX_TERNARY_FUSED`,
`set_enabled`), the CPU, float32 input, the block not training, its attention and MLP the
module's own classes, each projection a plain TernaryLinear on the native kernel
(registered: `register_projection`, `TernaryLinear.kernel_spec`; no LoRA/DoRA wrapper, no
sharded layer), q/k/v (and gate/up) sharing one activation preparation, the norms (qwen3's
head norms too) nn.RMSNorm with float32 weights, a RoPE whose arithmetic the op reproduces
(nn.RoPE, Llama3RoPE, YarnRoPE with mscale 1), the cache None, a KVCache or a BatchKVCache (so
quantized and rotating caches keep mlx-lm's path) that the call does not grow past its
filled buffers (once every 256 tokens: see `cache_kind`), the mask None, "causal" or a bool
array.

The plan: what a block's calls need (the projections' kernel arguments, norms, RoPE,
head counts, the ops' bound arguments) is derived on its first call into a `BlockPlan` kept
on the block, as a layer's LayerPlan is (runtime/dispatch.py); a call then checks the
per-call conditions (the device, x, the cache and mask), looks the plan up and runs the
three ops. The plan records what it read (`Reads`) and holds while each of those is the same
object: a projection's LayerPlan (dropped by every TernaryLinear setter: weights, bias,
settings), the block's child modules (adapters swap them) and the norms' weights
(`load_weights`, `update`). The native thread count is read by the ops when they run.
mlx-lm privates read: only `_freqs` of Llama3RoPE and YarnRoPE (no public name holds their
frequencies), once per plan; the cache's filled length is its public `size()`.

Gradients: a block in training mode (mlx-lm's trainer sets it) runs mlx-lm's block; elsewhere
(mx.grad of a model in eval mode) the ops' vjp is that of MLX's own ops composing the same
function, with the layers' straight-through vjp: the unfused block's gradient.

Tensor parallelism: `attn_out` and `mlp` take `residual=None` and then return the partial
projection, for an all_sum before the residual is added: a tensor-parallel block runs so
through FORMS (runtime/shard_block.py).
"""

import os
from functools import lru_cache, partial
from operator import is_
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from ...errors import TernaryError
from ...format import Q8K, packing_code
from .. import patches
from . import active, require

ENV_FUSED = "MLX_TERNARY_FUSED"
# The dtype of the K/V the fused block hands mlx-lm's cache (which keeps what it gets):
# float16 (default: half the bytes of float32, as llama.cpp's f16 cache) or float32
ENV_KV = "MLX_TERNARY_KV_DTYPE"
KV_DTYPES = {"float16": True, "float32": False}  # name -> attn_in's kv_half
# mlx-lm's modules whose TransformerBlock is the llama block (qwen2: q/k/v biases; qwen3:
# an RMSNorm of each q and k head before RoPE), all with `swiglu` MLPs, and BitNet's (an
# RMSNorm before o_proj and before down_proj, relu2 gating: SUB_NORMED)
ARCHS = ("llama", "qwen2", "qwen3", "bitnet")
SUB_NORMED = {"bitnet": ("attn_sub_norm", "ffn_sub_norm")}  # module -> (attention's, MLP's)
_state = {"on": None, "kv": None}  # None: $MLX_TERNARY_FUSED / $MLX_TERNARY_KV_DTYPE decide
# The projections the plain fused block runs: exact class -> layer -> (its kernel arguments
# (packed, scales, bias, packing, in_features, group_size, activation_bits), or None where a
# call of the layer is not the native kernel on its input; mapping, key: see Reads). Filled
# from above (runtime/layers.py registers TernaryLinear), so imports point down the layers;
# a subclass is not registered (it transforms x), nor a wrapper (LoRA, DoRA).
PROJECTIONS: Dict[type, Callable] = {}
# Other forms of a block's layers, tried in turn where they are not the plain ones: each
# (block, mod, reads) -> a run (x, cache, offset, how) -> the block's output, or None where
# it does not apply; what it reads goes through `reads` (runtime/shard_block.py adds the
# tensor-parallel block)
FORMS = []
# mlx-lm's cache classes the native ops take -> whether its offset is an array (one a row):
# filled by _blocks(), which imports mlx-lm once
_CACHES: Dict[type, bool] = {}
_PLAN = "_block_plan"  # where a routed block keeps its BlockPlan (its __dict__, as TernaryLinear)


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


def set_kv_dtype(name: Optional[str]) -> None:
    """The fused block's K/V dtype for this process: "float16" or "float32" (None: back to
    $MLX_TERNARY_KV_DTYPE, default float16). Raises TernaryError for another name."""
    if name is not None:
        _kv_half(name, "set_kv_dtype")
    _state["kv"] = name


def kv_dtype() -> str:
    """The dtype the fused block gives mlx-lm's cache its keys and values in."""
    return _state["kv"] or os.environ.get(ENV_KV, "float16")


def kv_half(cache) -> bool:
    """attn_in's kv_half for a call with `cache`: float16 K/V where a cache keeps them."""
    return cache is not None and _kv_half(kv_dtype())


def _kv_half(name: str, where: str = ENV_KV) -> bool:
    if name not in KV_DTYPES:
        raise TernaryError(f"{where}: {name!r} is not a KV dtype; use one of {sorted(KV_DTYPES)}")
    return KV_DTYPES[name]


def register_projection(cls: type, read: Callable) -> None:
    """Let the plain fused block run layers of exactly `cls`: `read(layer)` gives (the
    kernel arguments or None, mapping, key), the arguments holding while mapping[key] is
    what it is now (TernaryLinear: its launch plan, which every change of them drops)."""
    PROJECTIONS[cls] = read


class Reads:
    """What a block plan was derived from, as (mapping, key, value): the plan holds while
    every mapping[key] is still that value. Modules are dicts of their child modules and
    arrays, so swapping a layer (adapters, `update_modules`), replacing a norm's weight
    (`load_weights`, `update`) or dropping a projection's launch plan (TernaryLinear's
    setters: its arrays, bias, packing, activation mode...) changes one of them."""

    def __init__(self):
        self.maps, self.keys, self.values = [], [], []

    def child(self, mapping, key: str):
        """mapping[key] (a module's child module or array; None if absent), recorded."""
        value = mapping.get(key)
        self.maps.append(mapping)
        self.keys.append(key)
        self.values.append(value)
        return value

    def spec(self, layer, read: Optional[Callable] = None):
        """The fused ops' (packed, scales, bias, geometry) for a projection, or None:
        `read` (as PROJECTIONS' values) or the one registered for the layer's class."""
        read = read or PROJECTIONS.get(type(layer))
        if read is None:
            return None
        s, mapping, key = read(layer)
        self.child(mapping, key)
        if s is None:
            return None
        packed, scales, bias, packing, k, group, bits = s
        act = require().ACT_Q8K if bits == Q8K else bits or 0
        group = group or 0 if scales.shape[1] > 1 else 0
        return packed, scales, bias, (packing_code(packing), k, group, act)

    def holds(self) -> bool:
        """Whether nothing read has been replaced since (one pass, no Python per item)."""
        return all(map(is_, map(dict.get, self.maps, self.keys), self.values))


def grouped(specs):
    """(packed, scales, biases, geometry) of projections sharing one activation preparation."""
    if any(s is None for s in specs) or len({s[3] for s in specs}) != 1:
        return None
    return [s[0] for s in specs], [s[1] for s in specs], [s[2] for s in specs], specs[0][3]


def norm_args(norm):
    if type(norm) is not nn.RMSNorm or norm.weight.dtype != mx.float32:
        return None
    return norm.weight, float(norm.eps)


def _read_norm(reads: Reads, module, key: str):
    """norm_args of module[key], its module and weight recorded."""
    norm = reads.child(module, key)
    if isinstance(norm, nn.Module):
        reads.child(norm, "weight")
    return norm_args(norm)


def _rope(rope):
    """(dims, traditional, base, scale, freqs) the op reproduces for `rope`, or None."""
    if type(rope) is nn.RoPE:
        return rope.dims, bool(rope.traditional), float(rope.base), float(rope.scale), None
    from mlx_lm.models import rope_utils  # once per plan, never per token

    if type(rope) is rope_utils.Llama3RoPE or (
        type(rope) is rope_utils.YarnRoPE and rope.mscale == 1.0
    ):
        # `_freqs` is private to mlx-lm: these classes keep their frequencies under no
        # public name (their __call__ passes it to mx.fast.rope). Read once, when planned.
        return rope.dims, bool(rope.traditional), None, 1.0, rope._freqs
    return None


def cache_kind(cache, tokens: int, grow: bool = False):
    """The cache's offset as (int, None) or (0, array), or None for an unsupported cache and,
    unless `grow`, for a call that grows a filled cache: mlx-lm concatenates the old buffers
    with a new step, and the fused layers' fewer, larger tasks let MLX run ~4 layers ahead, so
    ~4 layers' old and new buffers would be live at once (_fused evaluates x first then)."""
    if cache is None:
        return 0, None
    batched = _CACHES.get(type(cache))  # exact classes: quantized, rotating... keep mlx-lm's
    if batched is None:
        return None
    if not grow and cache.keys is not None and cache.size() + tokens > cache.keys.shape[2]:
        return None  # size(): the filled length (KVCache's offset, BatchKVCache's index)
    return (0, cache.offset) if batched else (int(cache.offset), None)


def _mask(mask):
    """(causal, mask array) for the native attention, or None."""
    if mask is None:
        return False, None
    if isinstance(mask, str):
        return (True, None) if mask == "causal" else None
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim <= 4:
        return False, mask
    return None


def _plain_projections(attn, mlp, reads: Reads):
    """(qkv, gate_up, o, down) native specs of plain (registered) projections."""

    def spec(module, key):
        return reads.spec(reads.child(module, key))

    qkv = grouped([spec(attn, "q_proj"), spec(attn, "k_proj"), spec(attn, "v_proj")])
    gate_up = grouped([spec(mlp, "gate_proj"), spec(mlp, "up_proj")])
    return qkv, gate_up, spec(attn, "o_proj"), spec(mlp, "down_proj")


def parts(block, mod, projections=_plain_projections, reads: Optional[Reads] = None):
    """What the fused ops need of a block of mlx-lm's module `mod`, or None; `projections`
    (attn, mlp, reads) -> (qkv, gate_up, o, down) or None reads the layers (shard_block.py
    reads sharded ones); what is read is recorded in `reads`."""
    reads = Reads() if reads is None else reads
    attn, mlp = reads.child(block, "self_attn"), reads.child(block, "mlp")
    if type(attn) is not mod.Attention or type(mlp) is not mod.MLP:
        return None
    proj = projections(attn, mlp, reads)
    if proj is None:
        return None
    qkv, gate_up, o, down = proj
    n1 = _read_norm(reads, block, "input_layernorm")
    n2 = _read_norm(reads, block, "post_attention_layernorm")
    rope = _rope(reads.child(attn, "rope"))
    if None in (n1, n2, qkv, gate_up, o, down, rope):
        return None
    head_norms = (None, None, 0.0)
    if reads.child(attn, "q_norm") is not None:  # qwen3: RMSNorm of each q and k head
        qn, kn = _read_norm(reads, attn, "q_norm"), _read_norm(reads, attn, "k_norm")
        if qn is None or kn is None or qn[1] != kn[1]:
            return None
        head_norms = (qn[0], kn[0], qn[1])
    return n1, n2, qkv, gate_up, o, down, rope, head_norms


def sub_norms(block, mod, reads: Reads):
    """(attention's sub-norm, MLP's sub-norm, MLP activation code) of a block of `mod`:
    (None, None, silu) for the llama block, the two RMSNorms and relu2 for BitNet's (mlx-lm's
    bitnet MLP), None where they are not what the op computes."""
    m = require()
    names = SUB_NORMED.get(mod.__name__.rsplit(".", 1)[-1])
    if names is None:
        return None, None, m.MLP_SILU
    attn, mlp = reads.child(block, "self_attn"), reads.child(block, "mlp")
    a, f = _read_norm(reads, attn, names[0]), _read_norm(reads, mlp, names[1])
    return None if a is None or f is None else (a, f, m.MLP_RELU2)


def _plain_run(attn, found, subs) -> Callable:
    """(x, cache, offset, how) -> the block's output: three native ops, every argument but
    the activations, offset and mask bound now (and the K/V dtype, read per call)."""
    (w1, eps1), (w2, eps2), qkv, gate_up, o, down, rope, head_norms = found
    attn_sub, ffn_sub, act = subs
    n_heads, n_kv_heads, scale = attn.n_heads, attn.n_kv_heads, attn.scale
    head_dim = qkv[0][0].shape[0] // n_heads
    m = require()
    attn_in = (w1, eps1, *qkv[:3], *qkv[3], n_heads, n_kv_heads, head_dim, *rope)
    attn_out = (*o[:3], *o[3])
    mlp = (w2, eps2, *gate_up[:3], *gate_up[3], *down[:3], *down[3])
    sub_a = dict(zip(("sub_norm_w", "sub_eps"), attn_sub or ()))
    sub_f = dict(zip(("sub_norm_w", "sub_eps"), ffn_sub or ()), act=act)

    def run(x, cache, offset, how):
        q, k, v = m.attn_in(x, *attn_in, *offset, *head_norms, kv_half=kv_half(cache))
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        causal, mask_array = how  # a bool mask that does not fit raises, as mlx-lm's would
        h = m.attn_out(q, k, v, scale, causal, mask_array, *attn_out, x, **sub_a)
        return m.mlp(h, *mlp, h, **sub_f)

    return run


class BlockPlan:
    """What the calls of one routed block need, decided once (as dispatch.LayerPlan is for
    one layer): `run` (x, cache, offset, how) -> output, or None where the block is not
    fused (then mlx-lm's block runs), and the `reads` it was derived from. It holds while
    they do: the setters that drop a projection's LayerPlan, a swapped layer (adapters) or
    a replaced norm weight make the next call plan again."""

    __slots__ = ("reads", "run")

    def __init__(self, reads: Reads, run: Optional[Callable]):
        self.reads, self.run = reads, run

    def __deepcopy__(self, memo):
        return None  # a copied block has copied layers: it plans again


def plan(block, mod) -> BlockPlan:
    """`block`'s plan (a block of mlx-lm's module `mod`), made now and kept unless what it
    read belongs to a transform's trace (mx.grad of the parameters: nothing kept, as
    TernaryLinear keeps no LayerPlan then)."""
    reads = Reads()
    found = parts(block, mod, reads=reads)
    subs = sub_norms(block, mod, reads)
    run = None if found is None or subs is None else _plain_run(block.self_attn, found, subs)
    if run is None and subs is not None and subs[0] is None:  # the forms know no sub-norms
        for form in FORMS:
            run = form(block, mod, reads)
            if run is not None:
                break
    out = BlockPlan(reads, run)
    is_tracer = require().is_tracer
    if not any(isinstance(v, mx.array) and is_tracer(v) for v in reads.values):
        block.__dict__[_PLAN] = out
    return out


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
    kept = block.__dict__.get(_PLAN)
    run = (kept if kept is not None and kept.reads.holds() else plan(block, mod)).run
    if run is None:
        return None
    offset, how = cache_kind(cache, x.shape[1]), _mask(mask)
    if offset is None and kv_dtype() == "float16" and not require().is_tracer(x):
        # a call that grows the cache: fused too, or mlx-lm's block would grow it in float32
        # (the dtype it gets); the layers before it run first, so one layer's old and new
        # buffers are live at a time
        offset = cache_kind(cache, x.shape[1], grow=True)
        if offset is not None:
            mx.eval(x)
    if offset is None or how is None:
        return None
    return run(x, cache, offset, how)


@lru_cache(maxsize=None)
def _blocks():
    """mlx-lm's block classes the fused path computes, each with its call (and the cache
    classes the ops take, in _CACHES): every mlx-lm import of the path, once."""
    import importlib

    from mlx_lm.models.cache import BatchKVCache, KVCache

    _CACHES.update({KVCache: False, BatchKVCache: True})
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
