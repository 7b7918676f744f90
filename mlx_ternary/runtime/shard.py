"""Tensor parallelism for ternary layers: the sharded layers and `shard_linear`
(shard_plans.py applies them to whole models through `model.shard(group)`).

all-to-sharded: each rank holds a block of W's output rows (N). x is whole on every rank,
    so activation quantization is unchanged; the output stays sharded.
sharded-to-all: each rank holds a block of W's input columns (K) and sees a K-slice of x.
    With int8 activations the ranks agree on each token's absmax (all_max) before
    quantizing, so the codes and the scale are those of the whole row, then sum their
    partial outputs (all_sum) and add the bias once.

Rows are contiguous in both packings. Column blocks are cut on word (fast: 16 trits) or
byte (compact: 5 trits) boundaries, and scale groups are kept whole; a cut inside a word
or byte is decoded and repacked, exactly. A weight may come from a loaded layer or, through
`TernaryParts`, from a checkpoint read slice by slice (parallel.py).
"""

from dataclasses import dataclass
from functools import partial
from typing import Any, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers import distributed as mlx_distributed

from .. import format as fmt
from ..errors import TernaryError
from . import samehost
from .layers import TernaryLinear
from .reference import ACT_EPS, ACT_QMAX, ACT_QMIN

SHARDINGS = ("all-to-sharded", "sharded-to-all")
_FAST_PAD_WORD = 0x55555555  # sixteen zero trits (code 1)
_REPACK_TRITS = 1 << 14  # trits decoded at once where a column cut is repacked (~0.5 MB)
Segments = Union[int, Sequence[Union[int, float]]]


@dataclass
class TernaryParts:
    """The arrays of one ternary weight before sharding, and where they stand.

    `packed`, `scales` and `bias` are MLX arrays, or any object whose 2-D slicing
    (`a[r0:r1]`, `a[:, c0:c1]`) returns one: a checkpoint tensor read slice by slice.
    """

    name: str
    packed: Any  # (N, row_bytes) uint8 compact | (N, Kp/16) uint32 fast
    scales: Any  # (1, 1) | (N, 1) | (N, ceil(K / group_size))
    bias: Any  # (N,) or None
    packing: str  # the layout of `packed`
    in_features: int
    out_features: int
    group_size: Optional[int] = None
    activation_bits: Optional[int] = None
    backend: Optional[str] = None
    runtime_packing: Optional[str] = None  # the sharded layer's layout (default: packing)

    @classmethod
    def of(cls, layer: TernaryLinear, name: str = "layer") -> "TernaryParts":
        return cls(
            name,
            layer.packed,
            layer.scales,
            layer.get("bias"),
            layer.packing,
            layer.in_features,
            layer.out_features,
            layer.group_size,
            layer.activation_bits,
            layer.backend,
        )

    @property
    def scale(self) -> str:
        return fmt.scale_kind(tuple(self.scales.shape), self.out_features)


# --------------------------------------------------------------------------- #
# Which indices a rank holds
# --------------------------------------------------------------------------- #


def rank_ranges(
    total: int,
    world: int,
    rank: int,
    segments: Segments = 1,
    *,
    name: str = "layer",
    what: str = "output rows (N)",
) -> List[Tuple[int, int]]:
    """The [start, stop) ranges of `total` that `rank` holds: each segment split in `world`.

    `segments` follows mlx's shard_linear: a count of equal parts (a fused QKV is 3), or
    the split points, as indices or as fractions of `total`.
    """
    if isinstance(segments, int):
        if total % segments:
            raise TernaryError(
                f"{name}: its {total} {what} do not split into {segments} equal segments"
            )
        bounds = [total * i // segments for i in range(segments + 1)]
    else:
        points = [int(p * total) if isinstance(p, float) else int(p) for p in segments]
        bounds = [0, *points, total]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        if (b - a) % world:
            seg = f" (segment [{a}, {b}))" if len(bounds) > 2 else ""
            raise TernaryError(
                f"{name}: cannot split its {total} {what}{seg} across {world} ranks: each "
                f"rank must hold the same number; run on a number of ranks that divides "
                f"{b - a}"
            )
        step = (b - a) // world
        out.append((a + rank * step, a + (rank + 1) * step))
    return out


def _concat(parts: List[mx.array], axis: int) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def _pad_cols(a: mx.array, width: int, value: int) -> mx.array:
    return (
        a
        if a.shape[1] == width
        else mx.pad(a, [(0, 0), (0, width - a.shape[1])], constant_values=value)
    )


# --------------------------------------------------------------------------- #
# Slicing packed weights
# --------------------------------------------------------------------------- #


def _aligned_units(p: TernaryParts, c0: int, c1: int) -> Optional[Tuple[int, int]]:
    """The packed columns holding exactly trits [c0, c1) of a row, or None if the cut
    falls inside a word or byte."""
    k, g = p.in_features, p.group_size
    if p.packing == "fast":
        per = fmt.CODES_PER_WORD
        if c0 % per == 0 and (c1 % per == 0 or c1 == k):
            return c0 // per, fmt.ceil_div(c1, per)
        return None
    if g:  # compact blocks are scale groups, each padded to whole bytes
        bpb = fmt.ceil_div(g, fmt.TRITS_PER_BYTE)
        if c0 % g == 0 and (c1 % g == 0 or c1 == k):
            return c0 // g * bpb, fmt.ceil_div(c1, g) * bpb
        return None
    per = fmt.TRITS_PER_BYTE
    if c0 % per == 0 and (c1 % per == 0 or c1 == k):
        return c0 // per, fmt.ceil_div(c1, per)
    return None


def _trits_cols(p: TernaryParts, packed: Any, c0: int, c1: int, rows: slice) -> mx.array:
    """Trits [c0, c1) of `rows`, decoded from the words or bytes that cover them."""
    if p.packing == "fast":
        per = fmt.CODES_PER_WORD
        u0, u1 = c0 // per, fmt.ceil_div(c1, per)
        covered = fmt.unpack_fast_mx(packed[rows, u0:u1], (u1 - u0) * per)
        return covered[:, c0 - u0 * per : c1 - u0 * per]
    block = p.group_size or fmt.TRITS_PER_BYTE
    per_block = fmt.ceil_div(block, fmt.TRITS_PER_BYTE)
    b0, b1 = c0 // block, fmt.ceil_div(c1, block)
    covered = fmt.unpack_compact_mx(
        packed[rows, b0 * per_block : b1 * per_block], (b1 - b0) * block, p.group_size
    )
    return covered[:, c0 - b0 * block : c1 - b0 * block]


def _cols(p: TernaryParts, packed: Any, ranges: List[Tuple[int, int]], out: str) -> mx.array:
    """Columns `ranges` of the packed weight, packed as `out` for k = their total width.

    A cut inside a word or byte is decoded and repacked a block of rows at a time: the
    decoded digits take 20 bytes a trit, far more than the weight itself."""
    k = sum(c1 - c0 for c0, c1 in ranges)
    g = p.group_size
    width = fmt.packed_shape(out, 1, k, g)[1]
    units = _aligned_units(p, *ranges[0]) if len(ranges) == 1 else None
    if units is not None and out == p.packing:
        pad = _FAST_PAD_WORD if out == "fast" else 0
        return _pad_cols(packed[:, units[0] : units[1]], width, pad)
    step = max(1, _REPACK_TRITS // k)
    blocks = []
    for r0 in range(0, p.out_features, step):
        rows = slice(r0, min(r0 + step, p.out_features))
        trits = _concat([_trits_cols(p, packed, c0, c1, rows) for c0, c1 in ranges], axis=1)
        blocks.append(fmt.pack_mx(trits, out, g))
        mx.eval(blocks[-1])  # before the next block's digits are made
    return _concat(blocks, axis=0)


def local_parts(
    p: TernaryParts, sharding: str, world: int, rank: int, segments: Segments = 1
) -> Tuple[mx.array, mx.array, Optional[mx.array], int, int]:
    """(packed, scales, bias, in_features, out_features) of `rank`'s share of a weight.

    all-to-sharded keeps rows (and their scales and bias); sharded-to-all keeps columns
    (the bias stays whole). Packed as `p.runtime_packing` (default: as given).

    Raises:
        TernaryError: a dimension (or segment) that does not divide by `world`, or a
            column split that would cut a scale group.
    """
    if sharding not in SHARDINGS:
        raise TernaryError(f"{p.name}: sharding must be one of {SHARDINGS}, got {sharding!r}")
    out = p.runtime_packing or p.packing
    kind = p.scale
    if sharding == "all-to-sharded":
        rows = rank_ranges(p.out_features, world, rank, segments, name=p.name)
        packed = _concat([p.packed[r0:r1] for r0, r1 in rows], axis=0)
        scales = (
            p.scales[:]
            if kind == "tensor"
            else _concat([p.scales[r0:r1] for r0, r1 in rows], axis=0)
        )
        bias = None if p.bias is None else _concat([p.bias[r0:r1] for r0, r1 in rows], 0)
        if out != p.packing:
            packed = fmt.pack_mx(
                fmt.unpack_mx(packed, p.packing, p.in_features, p.group_size), out, p.group_size
            )
        return packed, scales, bias, p.in_features, sum(r1 - r0 for r0, r1 in rows)
    cols = rank_ranges(p.in_features, world, rank, segments, name=p.name, what="input columns (K)")
    g = p.group_size
    if kind == "group" and any(c0 % g or (c1 % g and c1 != p.in_features) for c0, c1 in cols):
        k_loc = cols[0][1] - cols[0][0]
        fix = (
            f"run on a number of ranks that divides its {p.in_features // g} groups"
            if p.in_features % g == 0
            else "its last group is partial, so it cannot be split"
        )
        raise TernaryError(
            f"{p.name}: cannot split its {p.in_features} input columns across {world} ranks: "
            f"each rank's {k_loc} columns must be whole scale groups of {g}; {fix}"
        )
    packed = _cols(p, p.packed, cols, out)
    if kind == "group":
        scales = _concat([p.scales[:, c0 // g : fmt.ceil_div(c1, g)] for c0, c1 in cols], axis=1)
    else:
        scales = p.scales[:]
    bias = None if p.bias is None else p.bias[:]
    return packed, scales, bias, sum(c1 - c0 for c0, c1 in cols), p.out_features


def _local_linear(
    p: TernaryParts,
    sharding: str,
    world: int,
    rank: int,
    segments: Segments,
    cls,
    activation_bits: Optional[int],
    with_bias: bool,
):
    # Copies, not views: a view would keep the whole weight's buffer alive.
    packed, scales, bias, k, n = (
        mx.contiguous(a) if isinstance(a, mx.array) else a
        for a in local_parts(p, sharding, world, rank, segments)
    )
    layer = cls(
        k,
        n,
        with_bias and bias is not None,
        packing=p.runtime_packing or p.packing,
        scale=p.scale,
        group_size=p.group_size,
        scale_dtype=scales.dtype,
        activation_bits=activation_bits,
        backend=p.backend,
    )
    layer.packed, layer.scales = packed, scales
    if with_bias and bias is not None:
        layer.bias = bias
    return layer, bias


# --------------------------------------------------------------------------- #
# The sharded layers
# --------------------------------------------------------------------------- #


class AllToShardedTernaryLinear(TernaryLinear):
    """A TernaryLinear holding this rank's block of output rows; its output is sharded.

    Its parameters keep TernaryLinear's names and meaning for the local block, and the
    forward pass is TernaryLinear's own, so it runs whatever backend the layer would.
    """

    group = None

    @classmethod
    def from_parts(
        cls,
        p: TernaryParts,
        *,
        segments: Segments = 1,
        group: Optional[mx.distributed.Group] = None,
    ):
        group = group or mx.distributed.init()
        layer, _ = _local_linear(
            p,
            "all-to-sharded",
            group.size(),
            group.rank(),
            segments,
            cls,
            p.activation_bits,
            with_bias=True,
        )
        layer.group = group
        return layer

    def __call__(self, x: mx.array) -> mx.array:
        # The gradient of a replicated input is the sum over the ranks (mlx's convention).
        return super().__call__(mlx_distributed.sum_gradients(self.group)(x))


@partial(mx.compile, shapeless=True)
def _quantize_with_absmax(x: mx.array, amax: mx.array):
    # The same arithmetic as reference.quantize_activations, given the whole row's absmax.
    scale = ACT_QMAX / mx.maximum(amax, ACT_EPS)
    return mx.clip(mx.round(x * scale), ACT_QMIN, ACT_QMAX), 1.0 / scale


def quantize_shared(x: mx.array, group) -> Tuple[mx.array, mx.array]:
    """BitNet int8 per-token quantization of a K-sharded x, with one scale per token
    over the whole row: the ranks agree on the absmax (all_max) first.

    Returns (integer-valued xq slice, 1 / scale), as reference.quantize_activations.
    """
    amax = mx.distributed.all_max(mx.abs(x).max(axis=-1, keepdims=True), group=group)
    return _quantize_with_absmax(x, amax)


class ShardedToAllTernaryLinear(nn.Module):
    """This rank's block of input columns; the ranks sum their outputs.

    `linear` is a plain TernaryLinear over the local columns (no bias, no activation
    quantization: that needs the whole row, so it happens here); `bias` is whole.
    """

    def __init__(
        self,
        linear: TernaryLinear,
        bias: Optional[mx.array],
        activation_bits: Optional[int],
        group,
        segments: Segments = 1,
    ):
        super().__init__()
        self.linear = linear
        if bias is not None:
            self.bias = bias
        self.activation_bits = activation_bits
        self.group = group
        self.__dict__["_segments"] = segments  # not a child module: how K was cut

    @classmethod
    def from_parts(
        cls,
        p: TernaryParts,
        *,
        segments: Segments = 1,
        group: Optional[mx.distributed.Group] = None,
    ):
        group = group or mx.distributed.init()
        # llama.cpp's q8k blocks are local to a rank when its columns start on one; where the
        # split cuts a block, the ranks gather the row and quantize it whole (_q8k_slice)
        q8k = p.activation_bits == fmt.Q8K
        k_local = p.in_features // group.size()
        cut = group.size() > 1 and (segments != 1 or k_local % fmt.Q8K_BLOCK != 0)
        local_q8k = q8k and not cut
        linear, bias = _local_linear(
            p,
            "sharded-to-all",
            group.size(),
            group.rank(),
            segments,
            TernaryLinear,
            fmt.Q8K if local_q8k else None,
            with_bias=False,
        )
        return cls(linear, bias, None if local_q8k else p.activation_bits, group, segments)

    @property
    def in_features(self) -> int:
        return self.linear.in_features * self.group.size()

    def _q8k_slice(self, x: mx.array) -> mx.array:
        """This rank's columns of ggml's Q8_K of the whole row, dequantized (d * q): the
        256-column blocks straddle the ranks' slices, so the ranks gather the row first."""
        from . import q8k  # llama.cpp's block numerics: q8k layers only

        k, world, rank = self.in_features, self.group.size(), self.group.rank()
        cols = [
            np.concatenate([np.arange(a, b) for a, b in rank_ranges(k, world, r, self._segments)])
            for r in range(world)
        ]
        lead, kl = x.shape[:-1], x.shape[-1]
        rows = mx.distributed.all_gather(x.reshape(1, -1, kl).astype(mx.float32), group=self.group)
        whole = rows.transpose(1, 0, 2).reshape(-1, world * kl)  # columns in `cols` order
        whole = whole[:, mx.array(np.argsort(np.concatenate(cols)))]
        q, d = q8k.quantize(whole)
        xq = (q * d[..., None]).reshape(whole.shape[0], -1)[:, mx.array(cols[rank])]
        return xq.reshape(*lead, kl).astype(x.dtype)

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def local_output(self, x: mx.array) -> mx.array:
        """This rank's share of the output, before the ranks sum it (no bias): a sharded
        adapter adds its own share here, so one all_sum carries both (shard_lora.py)."""
        if self.activation_bits == fmt.Q8K:
            return self.linear(self._q8k_slice(x))
        if self.activation_bits:
            xq, x_scale = quantize_shared(x, self.group)
            return self.linear(xq) * x_scale
        return self.linear(x)

    def __call__(self, x: mx.array) -> mx.array:
        y = samehost.all_sum(self.local_output(x), self.group)
        return y + self["bias"] if "bias" in self else y

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.in_features}, output_dims={self.out_features}, "
            f"ranks={self.group.size()}, activation_bits={self.activation_bits}, "
            f"bias={'bias' in self}"
        )


class ShardedRMSNorm(nn.Module):
    """RMSNorm over features sharded across the ranks: the sum of squares is all-reduced.

    BitNet normalizes the attention output and the MLP's hidden state, which tensor
    parallelism splits, just before the sharded-to-all projection.
    """

    def __init__(self, weight: mx.array, dims: int, eps: float, group):
        super().__init__()
        self.weight = weight
        self.dims, self.eps, self.group = dims, eps, group

    @classmethod
    def from_norm(cls, norm: nn.Module, group, *, name: str = "norm") -> "ShardedRMSNorm":
        dims = norm.weight.shape[0]
        ((a, b),) = rank_ranges(dims, group.size(), group.rank(), name=name, what="features")
        return cls(mx.contiguous(norm.weight[a:b]), dims, norm.eps, group)

    def __call__(self, x: mx.array) -> mx.array:
        x32 = x.astype(mx.float32)
        ss = mx.distributed.all_sum(mx.square(x32).sum(axis=-1, keepdims=True), group=self.group)
        return (x32 * mx.rsqrt(ss / self.dims + self.eps)).astype(x.dtype) * self.weight


# --------------------------------------------------------------------------- #
# shard_linear and model.shard
# --------------------------------------------------------------------------- #


def shard_linear(
    module: nn.Module,
    sharding: str,
    *,
    segments: Segments = 1,
    group: Optional[mx.distributed.Group] = None,
    parts: Optional[TernaryParts] = None,
    name: str = "layer",
):
    """mlx's shard_linear, extended to TernaryLinear (other layers go to mlx's).

    Args:
        module: the layer to shard.
        sharding: "all-to-sharded" (split N) or "sharded-to-all" (split K).
        segments: fused segments, as in mlx (e.g. 3 for a fused QKV).
        group: the ranks (default: the global group).
        parts: where to read the weight from instead of `module` (a checkpoint).
        name: the layer's path, for error messages.

    Returns:
        AllToShardedTernaryLinear or ShardedToAllTernaryLinear for a TernaryLinear.
    """
    if not isinstance(module, TernaryLinear):
        return mlx_distributed.shard_linear(module, sharding, segments=segments, group=group)
    if type(module) is not TernaryLinear:  # e.g. a rotation on the input, or sharded already
        raise TernaryError(
            f"{name}: {type(module).__name__} layers cannot be sharded; tensor "
            "parallelism splits plain TernaryLinear layers"
        )
    if parts is None:
        parts = TernaryParts.of(module, name)
    if parts.runtime_packing is None:
        parts.runtime_packing = module.packing
    cls = AllToShardedTernaryLinear if sharding == "all-to-sharded" else ShardedToAllTernaryLinear
    if sharding not in SHARDINGS:
        raise TernaryError(f"{name}: sharding must be one of {SHARDINGS}, got {sharding!r}")
    layer = cls.from_parts(parts, segments=segments, group=group)
    layer.train(module.training)  # the mode of the layer it replaces (a new one trains)
    if parts.packed is not module.packed:  # read from a checkpoint: hold the slice only
        mx.eval(layer.parameters())
    return layer


def ternary_bytes(model: nn.Module) -> int:
    """Bytes of packed trits and scales this process holds."""
    return sum(
        m.packed.nbytes + m.scales.nbytes
        for _, m in model.named_modules()
        if isinstance(m, TernaryLinear)
    )
