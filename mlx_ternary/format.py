"""The ternary format (mlx-ternary's own checkpoints): the one definition of both packed layouts.

docs/FORMAT.md describes the layouts in prose with worked examples; this module is
their executable definition (numpy for readers/writers, MLX for the runtime).

A ternary matrix W (out_features N, in_features K) is stored as W = s * t with
t in {-1, 0, +1} and s a scale per tensor (scales shape (1, 1)), per output row
((N, 1)) or per group of `group_size` input columns ((N, ceil(K / group_size))).

compact (base-3): trits are cut into blocks along K (the whole row, or one scale
    group); each block is packed 5 trits per byte, first trit most significant:
    v = 81*d0 + 27*d1 + 9*d2 + 3*d3 + d4 with d = t + 1, stored as the 8-bit fixed
    point fraction q = ceil(v * 256 / 243). Trit i is read back as
    d_i = ((q * 3**i) mod 256) * 3 >> 8: multiplies/adds and a shift, or, with q in
    the top byte of a 32-bit register, an add-with-shift and two compares. The byte
    index for table lookups is v = (q * 243) >> 8. Blocks are padded with zero trits
    to a multiple of 5; rows are padded to a multiple of 4 bytes.
        packed: (N, row_bytes) uint8
fast (2-bit): code q = t + 1 in 2 bits, 16 codes per uint32, lowest bits first,
    K padded to a multiple of 32 with zero trits (code 1). This is bit-for-bit the
    MLX 2-bit affine packing, so q * s - s reproduces W exactly.
        packed: (N, Kp / 16) uint32, Kp = ceil(K / 32) * 32
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Union

import mlx.core as mx
import numpy as np

from .errors import FormatError

FORMAT_NAME = "mlx-ternary"
FORMAT_VERSION = 1  # written when every non-ternary weight is float
AFFINE_FORMAT_VERSION = 2  # written when some weight stays MLX affine-quantized
GGML_FORMAT_VERSION = 3  # written when some table keeps llama.cpp's GGUF blocks
KNOWN_VERSIONS = (1, 2, 3)
# MLX affine quantization (mx.quantize): the bits and group sizes of a kept affine layer,
# of --q-bits / --q-group-size, and of a quantized KV cache (--kv-bits / --kv-group-size).
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
KV_BITS = AFFINE_BITS
KV_GROUP_SIZES = AFFINE_GROUP_SIZES
KV_GROUP_SIZE = 64  # the default, as mlx-lm's


@dataclass(frozen=True)
class GGMLTable:
    """One llama.cpp block type a table can keep as stored (docs/FORMAT.md "ggml tables")."""

    block: int  # weights per block, along a row
    bytes: int  # bytes per block
    code: int  # the native kernel's code (runtime/cpu/csrc/kernels/ggml_blocks.h GgmlType)


# llama.cpp's quantized tables kept as their GGUF blocks (per-layer mode "ggml").
GGML_MODE = "ggml"
GGML_TABLES = {
    "Q8_0": GGMLTable(32, 34, 0),
    "Q4_K": GGMLTable(256, 144, 1),
    "Q5_K": GGMLTable(256, 176, 2),
    "Q6_K": GGMLTable(256, 210, 3),
}
# The integer code of each packing, the one table both kernel families read: the Metal
# kernels' PACKING template constant and the native CPU backend's `Packing` enum
# (runtime/cpu/csrc/kernels/layer.h).
PACKING_CODES = {"compact": 0, "fast": 1}
PACKINGS = tuple(PACKING_CODES)
SCALE_KINDS = ("tensor", "row", "group")
# Group sizes of ternary group scales (not the affine ones above).
TERNARY_GROUP_SIZES = (64, 128, 256)

# How ternary layers treat their input (QuantizationConfig.activations, load(activations=)):
#   "model"  the model's own definition: `activation_bits` (8: BitNet int8 per token; null:
#            float, as TriLM / Bonsai)
#   "q8k"    llama.cpp's: int8 per block of Q8K_BLOCK columns as ggml's Q8_K (what its
#            TQ1_0 / TQ2_0 dot products compute; the default for llama.cpp's GGUF files)
#   "float"  no activation quantization
ACTIVATION_MODES = ("model", "q8k", "float")
Q8K = "q8k"  # a layer's activation_bits for llama.cpp's block int8 (else 8 or None)
Q8K_BLOCK = 256  # ggml's QK_K

TRITS_PER_BYTE = 5
CODES_PER_WORD = 16
FAST_K_ALIGN = 32
ROW_ALIGN_BYTES = 4
_POW3 = np.array([81, 27, 9, 3, 1], dtype=np.uint32)
# Weights handled per step by the row-blocked numpy paths (pack, unpack, checks, round-trip
# errors): their temporaries stay a few times 4 MiB whatever the tensor's size, so
# converting a 151936 x 4096 head holds its packed bytes, never an (N, K) float copy.
BLOCK_WEIGHTS = 1 << 20


def check_packing(packing: str, what: str = "packing") -> str:
    """`packing` if it names a packing; FormatError naming `what` and the allowed ones."""
    if not isinstance(packing, str) or packing not in PACKING_CODES:
        raise FormatError(f"{what} is {packing!r}; expected one of {PACKINGS}")
    return packing


def packing_code(packing: str, what: str = "packing") -> int:
    """The integer code the kernels (Metal and native CPU) take for a packing."""
    return PACKING_CODES[check_packing(packing, what)]


def check_activations(mode: str, what: str = "activations") -> str:
    """`mode` if it is one of ACTIVATION_MODES, else a FormatError naming `what`."""
    if mode not in ACTIVATION_MODES:
        raise FormatError(f"{what} is {mode!r}; expected one of {', '.join(ACTIVATION_MODES)}")
    return mode


def layer_activation_bits(mode: str, activation_bits: Optional[int]):
    """What a ternary layer runs with under `mode` for a model whose own definition is
    `activation_bits`: 8 (per-token int8), None (float) or Q8K."""
    check_activations(mode)
    if mode == "model":
        return activation_bits
    return Q8K if mode == Q8K else None


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for positive integers, exactly (the one definition)."""
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def to_numpy(a) -> np.ndarray:
    """A numpy copy of an MLX or numpy array (bfloat16 widened to float32)."""
    if isinstance(a, mx.array):
        return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)
    return np.asarray(a)


# --------------------------------------------------------------------------- #
# Geometry
# --------------------------------------------------------------------------- #


def block_size(in_features: int, group_size: Optional[int]) -> int:
    """Trits per compact block: one scale group, or the whole row."""
    return group_size if group_size else in_features


def compact_row_bytes(in_features: int, group_size: Optional[int] = None) -> int:
    b = block_size(in_features, group_size)
    n_blocks = ceil_div(in_features, b)
    return _round_up(n_blocks * ceil_div(b, TRITS_PER_BYTE), ROW_ALIGN_BYTES)


def fast_padded_k(in_features: int) -> int:
    return _round_up(in_features, FAST_K_ALIGN)


def packed_shape(
    packing: str, out_features: int, in_features: int, group_size: Optional[int] = None
) -> tuple:
    if check_packing(packing) == "compact":
        return (out_features, compact_row_bytes(in_features, group_size))
    return (out_features, fast_padded_k(in_features) // CODES_PER_WORD)


def packed_dtype(packing: str):
    return np.uint8 if check_packing(packing) == "compact" else np.uint32


def scales_shape(
    scale: str, out_features: int, in_features: int, group_size: Optional[int] = None
) -> tuple:
    if scale == "tensor":
        return (1, 1)
    if scale == "row":
        return (out_features, 1)
    if scale == "group":
        if group_size not in TERNARY_GROUP_SIZES:
            raise FormatError(f"group_size must be one of {TERNARY_GROUP_SIZES}, got {group_size}")
        return (out_features, ceil_div(in_features, group_size))
    raise FormatError(f"unknown scale kind {scale!r}; expected one of {SCALE_KINDS}")


def scale_kind(scales_shape_: tuple, out_features: int) -> str:
    rows, cols = scales_shape_
    if (rows, cols) == (1, 1) and out_features != 1:
        return "tensor"
    if cols == 1:
        return "row"
    return "group"


# --------------------------------------------------------------------------- #
# numpy pack / unpack
# --------------------------------------------------------------------------- #


def row_blocks(rows: int, cols: int):
    """Slices of rows holding about BLOCK_WEIGHTS weights each (at least one row)."""
    step = max(1, BLOCK_WEIGHTS // max(cols, 1))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def check_trits(t: np.ndarray, name: str = "tensor", first_row: int = 0) -> np.ndarray:
    """`t` as int8 trits (no copy when it is int8), or a FormatError naming the first
    value that is not a trit (its row counted from `first_row`)."""
    t = np.asarray(t)
    if t.ndim != 2:
        raise FormatError(f"{name}: expected a 2-D weight, got shape {t.shape}")
    for rows in row_blocks(*t.shape):
        block = t[rows]
        bad = (block != -1) & (block != 0) & (block != 1)
        if bad.any():
            i, j = (int(x) for x in np.argwhere(bad)[0])
            value = block[i, j]
            idx = (i + rows.start + first_row, j)
            raise FormatError(f"{name}: value {value} at {idx} is not a trit in {{-1, 0, +1}}")
    return t if t.dtype == np.int8 else t.astype(np.int8)


def _blocks(t: np.ndarray, group_size: Optional[int], pad_value: int) -> np.ndarray:
    """(N, K) -> (N, n_blocks, block padded to a multiple of 5)."""
    n, k = t.shape
    b = block_size(k, group_size)
    n_blocks = ceil_div(k, b)
    bp = _round_up(b, TRITS_PER_BYTE)
    out = np.full((n, n_blocks, bp), pad_value, dtype=t.dtype)
    full = np.full((n, n_blocks * b), pad_value, dtype=t.dtype)
    full[:, :k] = t
    out[:, :, :b] = full.reshape(n, n_blocks, b)
    return out


def pack_compact(t: np.ndarray, group_size: Optional[int] = None) -> np.ndarray:
    """Trits (N, K) int8 -> (N, row_bytes) uint8, 5 trits per byte."""
    t = np.asarray(t, dtype=np.int8)
    n, k = t.shape
    d = _blocks(t, group_size, 0).astype(np.uint32) + 1  # (N, nb, bp) digits 0..2
    v = d.reshape(n, -1, TRITS_PER_BYTE) @ _POW3  # (N, nb * bp / 5) in 0..242
    q = ((v * 256 + 242) // 243).astype(np.uint8)
    out = np.zeros((n, compact_row_bytes(k, group_size)), dtype=np.uint8)
    out[:, : q.shape[1]] = q
    return out


def decode_compact_bytes(q: np.ndarray) -> np.ndarray:
    """Bytes (...,) uint8 -> digits (..., 5) in 0..2, first trit first."""
    q = np.asarray(q, dtype=np.uint32)
    return np.stack(
        [(((q * 3**i) & 0xFF) * 3) >> 8 for i in range(TRITS_PER_BYTE)], axis=-1
    ).astype(np.int8)


def unpack_compact(
    packed: np.ndarray, in_features: int, group_size: Optional[int] = None
) -> np.ndarray:
    """(N, row_bytes) uint8 -> trits (N, K) int8."""
    n = packed.shape[0]
    b = block_size(in_features, group_size)
    n_blocks = ceil_div(in_features, b)
    bpb = ceil_div(b, TRITS_PER_BYTE)
    d = decode_compact_bytes(packed[:, : n_blocks * bpb])  # (N, nb*bpb, 5)
    t = d.reshape(n, n_blocks, bpb * TRITS_PER_BYTE)[:, :, :b] - 1
    return t.reshape(n, n_blocks * b)[:, :in_features].astype(np.int8)


def pack_fast(t: np.ndarray) -> np.ndarray:
    """Trits (N, K) int8 -> (N, Kp/16) uint32 of 2-bit codes t + 1, LSB first."""
    t = np.asarray(t, dtype=np.int8)
    n, k = t.shape
    codes = np.ones((n, fast_padded_k(k)), dtype=np.uint32)
    codes[:, :k] = t.astype(np.int32) + 1
    shifts = 2 * np.arange(CODES_PER_WORD, dtype=np.uint32)
    words = codes.reshape(n, -1, CODES_PER_WORD) << shifts
    return np.bitwise_or.reduce(words, axis=-1).astype(np.uint32)


def unpack_fast(packed: np.ndarray, in_features: int) -> np.ndarray:
    """(N, Kp/16) uint32 -> trits (N, K) int8."""
    shifts = 2 * np.arange(CODES_PER_WORD, dtype=np.uint32)
    codes = (np.asarray(packed, dtype=np.uint32)[..., None] >> shifts) & 3
    n = packed.shape[0]
    return codes.reshape(n, -1)[:, :in_features].astype(np.int8) - 1


def pack_rows(
    trits_of, rows: int, cols: int, packing: str, group_size: Optional[int] = None
) -> np.ndarray:
    """The packed (rows, ...) array of trits handed over a block of rows at a time:
    `trits_of(row slice)` -> int8 trits of those rows. Both layouts pack each row on its
    own, so the bytes are those of packing the whole matrix at once."""
    compact = check_packing(packing) == "compact"
    out = np.empty(packed_shape(packing, rows, cols, group_size), packed_dtype(packing))
    for r in row_blocks(rows, cols):
        t = trits_of(r)
        out[r] = pack_compact(t, group_size) if compact else pack_fast(t)
    return out


def pack(t: np.ndarray, packing: str, group_size: Optional[int] = None) -> np.ndarray:
    t = np.asarray(t, dtype=np.int8)
    return pack_rows(lambda r: t[r], *t.shape, packing, group_size)


def unpack(
    packed: np.ndarray, packing: str, in_features: int, group_size: Optional[int] = None
) -> np.ndarray:
    compact = check_packing(packing) == "compact"
    out = np.empty((packed.shape[0], in_features), np.int8)
    for r in row_blocks(packed.shape[0], in_features):
        block = packed[r]
        out[r] = (
            unpack_compact(block, in_features, group_size)
            if compact
            else unpack_fast(block, in_features)
        )
    return out


# --------------------------------------------------------------------------- #
# MLX pack / unpack (same layouts, usable on any backend)
# --------------------------------------------------------------------------- #


def unpack_compact_mx(
    packed: mx.array, in_features: int, group_size: Optional[int] = None
) -> mx.array:
    """(N, row_bytes) uint8 -> trits (N, K) int8, with MLX ops."""
    n = packed.shape[0]
    b = block_size(in_features, group_size)
    n_blocks = ceil_div(in_features, b)
    bpb = ceil_div(b, TRITS_PER_BYTE)
    q = packed[:, : n_blocks * bpb].astype(mx.uint32)
    digits = [(((q * 3**i) & 0xFF) * 3) >> 8 for i in range(TRITS_PER_BYTE)]
    d = mx.stack(digits, axis=-1).reshape(n, n_blocks, bpb * TRITS_PER_BYTE)[:, :, :b]
    t = d.reshape(n, n_blocks * b)[:, :in_features].astype(mx.int8) - 1
    return t


def pack_compact_mx(t: mx.array, group_size: Optional[int] = None) -> mx.array:
    """Trits (N, K) -> (N, row_bytes) uint8, with MLX ops."""
    n, k = t.shape
    b = block_size(k, group_size)
    n_blocks = ceil_div(k, b)
    bp = _round_up(b, TRITS_PER_BYTE)
    d = mx.pad(t.astype(mx.uint32) + 1, [(0, 0), (0, n_blocks * b - k)], constant_values=1)
    d = mx.pad(d.reshape(n, n_blocks, b), [(0, 0), (0, 0), (0, bp - b)], constant_values=1)
    v = (d.reshape(n, -1, TRITS_PER_BYTE) * mx.array(_POW3)).sum(axis=-1)
    q = ((v * 256 + 242) // 243).astype(mx.uint8)
    row_bytes = compact_row_bytes(k, group_size)
    return mx.pad(q, [(0, 0), (0, row_bytes - q.shape[1])])


def pack_fast_mx(t: mx.array) -> mx.array:
    """Trits (N, K) -> (N, Kp/16) uint32 2-bit codes, with MLX ops."""
    n, k = t.shape
    codes = mx.pad(t.astype(mx.uint32) + 1, [(0, 0), (0, fast_padded_k(k) - k)], constant_values=1)
    shifts = 2 * mx.arange(CODES_PER_WORD, dtype=mx.uint32)
    words = codes.reshape(n, -1, CODES_PER_WORD) << shifts
    # Fields are disjoint, so a sum is an OR.
    return words.sum(axis=-1).astype(mx.uint32)


def unpack_fast_mx(packed: mx.array, in_features: int) -> mx.array:
    shifts = 2 * mx.arange(CODES_PER_WORD, dtype=mx.uint32)
    codes = (packed[..., None] >> shifts) & 3
    return codes.reshape(packed.shape[0], -1)[:, :in_features].astype(mx.int8) - 1


def unpack_mx(
    packed: mx.array, packing: str, in_features: int, group_size: Optional[int] = None
) -> mx.array:
    if check_packing(packing) == "compact":
        return unpack_compact_mx(packed, in_features, group_size)
    return unpack_fast_mx(packed, in_features)


def pack_mx(t: mx.array, packing: str, group_size: Optional[int] = None) -> mx.array:
    if check_packing(packing) == "compact":
        return pack_compact_mx(t, group_size)
    return pack_fast_mx(t)


def expand_scales(scales, in_features: int, group_size: Optional[int]):
    """Scales of any granularity -> broadcastable against (N, K) (numpy or MLX)."""
    rows, cols = scales.shape
    if cols == 1:
        return scales
    lib = mx if isinstance(scales, mx.array) else np
    return lib.repeat(scales, group_size, axis=1)[:, :in_features]


# --------------------------------------------------------------------------- #
# The packed tensor
# --------------------------------------------------------------------------- #


def _fitted_scales(scales, n: int, k: int, group_size: Optional[int], name: str):
    """(scales as (1, 1) | (n, 1) | (n, groups), the group size they imply) for an (n, k)
    weight, or a FormatError when their shape fits none."""
    scales = np.asarray(scales)
    if scales.ndim == 0:
        scales = scales.reshape(1, 1)
    elif scales.ndim == 1:
        scales = scales.reshape(-1, 1)
    kind = scale_kind(scales.shape, n)
    gs = group_size if kind == "group" else None
    want = scales_shape(kind, n, k, gs)
    if scales.shape != want:
        raise FormatError(
            f"{name}: scales of shape {scales.shape} do not fit a ({n}, {k}) weight "
            f"with {kind} scales (expected {want})"
        )
    return scales, gs


@dataclass
class PackedTernary:
    """One ternary weight in the ternary format's layout.

    packed: (N, row_bytes) uint8 for compact, (N, Kp/16) uint32 for fast.
    scales: (1, 1) | (N, 1) | (N, ceil(K / group_size)), float16/bfloat16/float32.
    Both are numpy arrays, or MLX arrays when a reader hands stored tensors on lazily
    (the ternary-format reader): nothing is read from disk until they are used.
    """

    packing: str
    packed: np.ndarray
    scales: np.ndarray
    out_features: int
    in_features: int
    group_size: Optional[int] = None

    @classmethod
    def from_trits(
        cls,
        t: np.ndarray,
        scales: np.ndarray,
        packing: str = "compact",
        group_size: Optional[int] = None,
        name: str = "tensor",
    ) -> "PackedTernary":
        t = check_trits(t, name)
        n, k = t.shape
        scales, gs = _fitted_scales(scales, n, k, group_size, name)
        return cls(packing, pack(t, packing, gs), scales, n, k, gs)

    @classmethod
    def from_trit_rows(
        cls,
        trits_of,
        rows: int,
        cols: int,
        scales: np.ndarray,
        packing: str = "compact",
        group_size: Optional[int] = None,
        name: str = "tensor",
    ) -> "PackedTernary":
        """As from_trits, the trits handed over a block of rows at a time (`trits_of(row
        slice)` -> those rows' trits), so no (rows, cols) array is ever held."""
        scales, gs = _fitted_scales(scales, rows, cols, group_size, name)

        def checked(r: slice) -> np.ndarray:
            return check_trits(trits_of(r), name, r.start)

        return cls(packing, pack_rows(checked, rows, cols, packing, gs), scales, rows, cols, gs)

    @property
    def scale(self) -> str:
        return scale_kind(self.scales.shape, self.out_features)

    def trits(self) -> np.ndarray:
        return unpack(to_numpy(self.packed), self.packing, self.in_features, self.group_size)

    def rows(self, r: slice) -> "PackedTernary":
        """Rows `r` (a slice with a stop) as a PackedTernary of their own: views, no copy."""
        scales = self.scales[r] if self.scales.shape[0] > 1 else self.scales
        n = len(range(*r.indices(self.out_features)))
        return PackedTernary(
            self.packing, self.packed[r], scales, n, self.in_features, self.group_size
        )

    def max_difference(self, other: "PackedTernary") -> float:
        """max |self - other| over every weight (float32), a block of rows at a time."""
        err = 0.0
        for r in row_blocks(self.out_features, self.in_features):
            a, b = self.rows(r).dequantize(np.float32), other.rows(r).dequantize(np.float32)
            err = max(err, float(np.abs(a - b).max(initial=0.0)))
        return err

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        s = expand_scales(
            to_numpy(self.scales).astype(np.float32), self.in_features, self.group_size
        )
        return (self.trits().astype(np.float32) * s).astype(dtype)

    def repack(self, packing: str) -> "PackedTernary":
        if packing == self.packing:
            return self
        return PackedTernary(
            packing,
            pack_rows(
                lambda r: self.rows(r).trits(),
                self.out_features,
                self.in_features,
                packing,
                self.group_size,
            ),
            self.scales,
            self.out_features,
            self.in_features,
            self.group_size,
        )

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.out_features * self.in_features)


@dataclass
class AffineTensor:
    """A non-ternary weight kept in MLX's affine quantized layout (mlx-lm's QuantizedLinear
    and QuantizedEmbedding parameters): w = scales * q + biases per group of `group_size`
    input columns, q packed `bits` wide into uint32 along K, lowest bits first.

    Readers yield (module path, AffineTensor) for weights that stay quantized (an MLX
    4-bit embedding, a GGUF Q4_0 / Q8_0 tensor mapped exactly); loaders build
    nn.QuantizedLinear / nn.QuantizedEmbedding from it and writers store the three arrays
    as `<path>.weight`, `<path>.scales`, `<path>.biases`, as mlx-lm does.

    weight: (N, K * bits / 32) uint32.
    scales, biases: (N, K / group_size), float16/bfloat16/float32.
    """

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple:
        """(N, K) of the float weight."""
        return (self.weight.shape[0], self.weight.shape[1] * 32 // self.bits)

    @property
    def entry(self) -> dict:
        """How mlx-lm's `quantization` block records this layer."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}

    def dequantize(self, dtype=mx.float32) -> mx.array:
        # Scales and biases in `dtype` first: float16 ones would round each weight.
        return mx.dequantize(
            self.weight,
            self.scales.astype(dtype),
            self.biases.astype(dtype),
            group_size=self.group_size,
            bits=self.bits,
        )

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes


def check_ggml_type(type_name, what: str = "ggml table type") -> GGMLTable:
    """The GGMLTable of `type_name`, or a FormatError naming it and the types kept."""
    if type_name not in GGML_TABLES:
        raise FormatError(
            f"{what} is {type_name!r}; mlx-ternary keeps the llama.cpp tables "
            f"{', '.join(GGML_TABLES)} as stored (re-convert the model with this version)"
        )
    return GGML_TABLES[type_name]


@dataclass
class GGMLTensor:
    """A non-ternary weight (an embedding, an output layer) kept as llama.cpp's GGUF blocks:
    row r of the (N, K) weight is bytes [r * row_bytes, (r + 1) * row_bytes) of `blocks`,
    K / block blocks of GGML_TABLES[type] in column order, exactly as the GGUF file stores
    them. Native checkpoints store `blocks` as `<path>.weight`.

    blocks: (N, row_bytes) uint8 (MLX or numpy).
    """

    blocks: mx.array
    type: str
    in_features: int

    def __post_init__(self):
        t = check_ggml_type(self.type)
        if self.in_features % t.block:
            raise FormatError(
                f"a {self.type} table has rows of whole {t.block}-column blocks; "
                f"{self.in_features} columns are not"
            )
        dt = self.blocks.dtype
        is_u8 = dt == mx.uint8 if isinstance(self.blocks, mx.array) else dt == np.uint8
        if not is_u8 or self.blocks.ndim != 2 or self.blocks.shape[1] != self.row_bytes:
            raise FormatError(
                f"{self.type} blocks of shape {tuple(self.blocks.shape)} ({dt}) are not uint8 "
                f"rows of {self.in_features} columns ({self.row_bytes} bytes each)"
            )

    @property
    def row_bytes(self) -> int:
        t = GGML_TABLES[self.type]
        return self.in_features // t.block * t.bytes

    @property
    def shape(self) -> tuple:
        """(N, K) of the float weight."""
        return (self.blocks.shape[0], self.in_features)

    @property
    def entry(self) -> dict:
        """How the `quantization` section records this layer."""
        return {"mode": GGML_MODE, "type": self.type}

    @property
    def nbytes(self) -> int:
        return self.blocks.shape[0] * self.row_bytes


# --------------------------------------------------------------------------- #
# config.json "quantization" section
# --------------------------------------------------------------------------- #


def affine_entry(entry, where: str) -> dict:
    """A checked mlx-lm per-layer quantization entry {group_size, bits, mode}."""
    if not isinstance(entry, dict):
        raise FormatError(f'{where}: expected {{"group_size": G, "bits": B}}, got {entry!r}')
    mode = entry.get("mode", "affine")
    if mode != "affine":
        raise FormatError(
            f"{where}: quantization mode {mode!r} is not kept by mlx-ternary "
            f"(it keeps MLX affine layers and llama.cpp {GGML_MODE!r} tables only); dequantize "
            "that layer first"
        )
    bits, gs = entry.get("bits"), entry.get("group_size")
    if bits not in AFFINE_BITS or gs not in AFFINE_GROUP_SIZES:
        raise FormatError(
            f"{where}: bits {bits!r} / group_size {gs!r}; MLX affine layers have "
            f"bits in {AFFINE_BITS} and group_size in {AFFINE_GROUP_SIZES}"
        )
    return {"group_size": gs, "bits": bits, "mode": "affine"}


def layer_entry(entry, where: str) -> dict:
    """A checked per-layer entry: MLX affine ({group_size, bits, mode}) or a llama.cpp table
    kept as stored ({"mode": "ggml", "type": T}); other modes are refused by name."""
    if isinstance(entry, dict) and entry.get("mode") == GGML_MODE:
        check_ggml_type(entry.get("type"), f"{where}: type")
        return {"mode": GGML_MODE, "type": entry["type"]}
    return affine_entry(entry, where)


@dataclass
class QuantizationConfig:
    """The `quantization` section of a ternary checkpoint's config.json.

    `layers` holds the affine-quantized (non-ternary) layers by module path, recorded as
    mlx-lm records per-layer quantization: {"group_size": G, "bits": B, "mode": "affine"}.
    """

    packing: str = "compact"
    scale: str = "row"
    group_size: Optional[int] = None
    activation_bits: Optional[int] = None
    activations: str = "model"
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    layers: Dict[str, dict] = field(default_factory=dict)

    def __post_init__(self):
        check_packing(self.packing, "quantization.packing")
        if self.scale not in SCALE_KINDS:
            raise FormatError(
                f"quantization.scale is {self.scale!r}; expected one of {SCALE_KINDS}"
            )
        if self.scale == "group" and self.group_size not in TERNARY_GROUP_SIZES:
            raise FormatError(
                f"quantization.group_size is {self.group_size!r}; group scales need one of {TERNARY_GROUP_SIZES}"
            )
        if self.activation_bits not in (None, 8):
            raise FormatError(
                f"quantization.activation_bits is {self.activation_bits!r}; supported: 8 or null"
            )
        check_activations(self.activations, "quantization.activations")

    @classmethod
    def from_dict(cls, d: dict, source: Union[str, Path] = "config.json") -> "QuantizationConfig":
        if d.get("format") != FORMAT_NAME:
            raise FormatError(
                f"{source}: quantization.format is {d.get('format')!r}, not {FORMAT_NAME!r}"
            )
        version = d.get("format_version")
        if version not in KNOWN_VERSIONS:
            raise FormatError(
                f"{source}: mlx-ternary format_version {version!r} is not one this version of "
                f"mlx-ternary reads (known: {', '.join(map(str, KNOWN_VERSIONS))}); "
                "upgrade mlx-ternary or re-convert the model"
            )
        fields = ("packing", "scale", "group_size", "activation_bits", "activations")
        # Per-layer entries: written by convert (version 2) or added by mlx-lm's
        # quantize_model to a loaded model's config (then saved under version 1).
        layers = {
            k: layer_entry(v, f"{source}: quantization.{k}")
            for k, v in d.items()
            if isinstance(v, dict)
        }
        try:
            return cls(**{k: d[k] for k in fields if k in d}, format_version=version, layers=layers)
        except FormatError as e:
            raise FormatError(f"{source}: {e}") from None

    @property
    def version(self) -> int:
        """The oldest format version that holds these layers (older readers refuse newer)."""
        if any(e.get("mode") == GGML_MODE for e in self.layers.values()):
            return GGML_FORMAT_VERSION
        return AFFINE_FORMAT_VERSION if self.layers else FORMAT_VERSION

    def to_dict(self) -> dict:
        return {
            "format": self.format,
            "format_version": self.version,
            "packing": self.packing,
            "scale": self.scale,
            "group_size": self.group_size,
            "activation_bits": self.activation_bits,
            # absent = "model" (older readers ignore the key: they run the model's own numerics)
            **({"activations": self.activations} if self.activations != "model" else {}),
            **{path: dict(entry) for path, entry in sorted(self.layers.items())},
        }


def is_ternary_config(config: dict) -> bool:
    q = config.get("quantization")
    return isinstance(q, dict) and q.get("format") == FORMAT_NAME
