"""The fused native decoder block (cpu/block.py) for a tensor-parallel block.

A block sharded by `model.shard(group)` (mlx-lm's plan: q/k/v and gate/up all-to-sharded,
o_proj and down_proj sharded-to-all, the attention's head counts divided by the ranks) runs
as the same three native ops on this rank's rows and columns, with the ranks' sums between
them, computing exactly what the sharded layers compute:

    q, k, v = attn_in(x)                 this rank's heads (its rows of q/k/v)
    k, v = cache.update_and_fetch(k, v)
    h = x + (all_sum(attn_out(q, k, v)) [+ o bias])    o_proj's local columns, no residual
    out = h + (all_sum(mlp(h)) [+ down bias])           gate/up rows, down's columns

ShardedToAllTernaryLinear's bias is added once, after the sum, as the layer does. Gradients
keep the sharded layers' convention: the replicated input of each all-to-sharded group (and
its norm's weight, whose gradient flows through the sharded rows) has its gradient summed
over the ranks (mlx's sum_gradients), the residual's does not. That node is built only
where x or the weight is a transform's tracer (mx.grad, vjp, compile): decode builds none.

It applies where the plain fused block would (the conditions in cpu/block.py) with these
layers instead: q/k/v and gate/up AllToShardedTernaryLinear whose rows the native kernel
runs as is (`TernaryLinear.kernel_spec`), o_proj and down_proj ShardedToAllTernaryLinear
over a plain local TernaryLinear with no activation quantization of their own across the
ranks - float activations, or llama.cpp's q8k blocks local to each rank. Elsewhere (int8
activations, whose absmax the ranks agree on with an all_max before o_proj and down_proj;
q8k blocks cut by a rank's columns, gathered whole; adapters on the sharded layers) the
block runs mlx-lm's block over the sharded layers, as before.
"""

from functools import lru_cache

import mlx.core as mx

from . import samehost
from .cpu import block as fused
from .cpu import require
from .shard import AllToShardedTernaryLinear, ShardedToAllTernaryLinear

# sharded blocks run fused in this process, and gradient-convention nodes built (for tests)
_counts = {"calls": 0, "grad_nodes": 0}


def _rows(layer, size: int, reads: fused.Reads):
    """The native spec of an all-to-sharded layer's rows (its class runs them as the
    kernel does: `TernaryLinear.kernel_spec`), or None."""
    if type(layer) is not AllToShardedTernaryLinear or layer.group.size() != size:
        return None
    return reads.spec(layer, AllToShardedTernaryLinear.block_projection)


def _cols(layer, reads: fused.Reads):
    """(native spec of the local columns, the whole bias or None), or None."""
    if type(layer) is not ShardedToAllTernaryLinear or layer.activation_bits is not None:
        return None
    spec = reads.spec(reads.child(layer, "linear"))
    return None if spec is None else (spec, reads.child(layer, "bias"))


def _projections(attn, mlp, reads: fused.Reads):
    """(qkv, gate_up, o, down) of this rank's sharded projections (o and down with their
    whole biases), or None."""
    o_proj, down_proj = reads.child(attn, "o_proj"), reads.child(mlp, "down_proj")
    o, down = _cols(o_proj, reads), _cols(down_proj, reads)
    if o is None or down is None or o_proj.group.size() != down_proj.group.size():
        return None
    size = o_proj.group.size()

    def rows(module, *keys):
        return fused.grouped([_rows(reads.child(module, k), size, reads) for k in keys])

    return rows(attn, "q_proj", "k_proj", "v_proj"), rows(mlp, "gate_proj", "up_proj"), o, down


@lru_cache(maxsize=None)
def _replicated(group):
    """(x, w) -> (x, w), their gradients summed over `group`: sum_gradients of both an
    all-to-sharded group's input and its norm's weight, in one node."""
    if group.size() == 1:
        return lambda x, w: (x, w)

    @mx.custom_function
    def f(x, w):
        return x, w

    @f.vjp
    def f(primals, cotangents, outputs):
        return tuple(mx.distributed.all_sum(c, group=group) for c in cotangents)

    return f


def _summed_gradients(group, a, w):
    """(a, w) through the gradient node where either is a transform's tracer (a gradient
    may flow to them), else as they are: in decode the nodes would be 72 of a step's 230 on
    the 0.53 G llama, 1-3 ms of CPU a token on the rank's core."""
    m = require()
    if not (m.is_tracer(a) or m.is_tracer(w)):
        return a, w
    _counts["grad_nodes"] += 1
    return _replicated(group)(a, w)


def _plus(a, bias):
    return a if bias is None else a + bias


def sharded_block(block, mod, reads: fused.Reads):
    """The run (x, cache, offset, how) of mlx-lm's `mod`.TransformerBlock over sharded
    layers - three native ops and two all_sums - or None: a form of cpu/block.py's plan,
    which calls it once per plan with its `reads`, and the run per call with the cache's
    offset and the mask it has checked."""
    parts = fused.parts(block, mod, _projections, reads)
    if parts is None:
        return None
    (w1, eps1), (w2, eps2), qkv, gate_up, (o, o_bias), (down, down_bias), rope, head_norms = parts
    attn = block.self_attn
    group, mlp_group, scale = attn.o_proj.group, block.mlp.down_proj.group, attn.scale
    head_dim = qkv[0][0].shape[0] // attn.n_heads
    m = require()
    attn_in = (eps1, *qkv[:3], *qkv[3], attn.n_heads, attn.n_kv_heads, head_dim, *rope)
    attn_out = (*o[:3], *o[3], None)
    mlp = (eps2, *gate_up[:3], *gate_up[3], *down[:3], *down[3], None)

    def run(x, cache, offset, how):
        xr, w1r = _summed_gradients(group, x, w1)
        q, k, v = m.attn_in(xr, w1r, *attn_in, *offset, *head_norms, kv_half=fused.kv_half(cache))
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        causal, mask_array = how
        r = m.attn_out(q, k, v, scale, causal, mask_array, *attn_out)
        h = x + _plus(samehost.all_sum(r, group), o_bias)
        hr, w2r = _summed_gradients(mlp_group, h, w2)
        r = m.mlp(hr, w2r, *mlp)
        _counts["calls"] += 1
        return h + _plus(samehost.all_sum(r, mlp_group), down_bias)

    return run


def register() -> None:
    """Let routed blocks (cpu/block.py) take the sharded fused path (once per process)."""
    if sharded_block not in fused.FORMS:
        fused.FORMS.append(sharded_block)


def fused_calls() -> int:
    """How many sharded blocks this process has run fused (tests: not the fallback)."""
    return _counts["calls"]


def gradient_nodes() -> int:
    """How many gradient-convention nodes the sharded fused blocks have built (tests: two a
    block under mx.grad, none in decode)."""
    return _counts["grad_nodes"]
