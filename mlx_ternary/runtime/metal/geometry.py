"""The Metal kernels' geometry, named once.

The launchers (launch.py) size their grids and threadgroups with these constants, and
every .metal source sees the same values as macros in a generated prelude (`prelude()`,
prepended to each kernel's header by sources.py), so no tile size, thread count or unroll
pragma is a literal in metal/*.metal. The packed-word facts come from format.py.
"""

import math

from ...format import CODES_PER_WORD, ROW_ALIGN_BYTES, TERNARY_GROUP_SIZES, TRITS_PER_BYTE

SIMD_WIDTH = 32  # lanes per SIMD group on Apple GPUs

# Decode GEMVs (gemv_fast.metal, gemv_compact.metal): one threadgroup owns GEMV_TG_ROWS
# output rows and every token of the call (up to MAX_GEMV_TOKENS), so the packed weights
# are read once per call and x once per threadgroup. A SIMD group's lanes split into
# SIMD_WIDTH / GEMV_WORD_LANES row groups of GEMV_WORD_LANES lanes along K; a lane owns
# `gemv_layout(tm)[0]` rows, keeping its accumulators (rows x tokens) within
# GEMV_LANE_ACCUMULATORS.
GEMV_WORD_LANES = 16
GEMV_TG_ROWS = 64
GEMV_LANE_ROWS = 4  # rows per lane while tokens x rows fit the accumulator budget
GEMV_LANE_ACCUMULATORS = 32
MAX_GEMV_TOKENS = 16  # GEMV up to here (each weight read once), GEMM above
GEMV_TOKEN_TILES = (1, 2, 4, 8, 16)  # the TM template values: tokens rounded up


# gemv_compact.metal: a lane holds a unit of COMPACT_UNIT_BYTES of one row, the smallest span
# that is whole words and whole blocks (ceil(G / 5) bytes) of every group size (52 bytes =
# 13 words = 4 blocks of G = 64), so where a block edge falls inside a word is the same for
# every lane; COMPACT_UNIT_LANES lanes per row (one row per lane), the threadgroup still
# GEMV_TG_ROWS rows. Per barrier the threadgroup stages at most GEMV_STAGE_WORDS words'
# coefficients (both GEMVs).
COMPACT_UNIT_BYTES = math.lcm(
    ROW_ALIGN_BYTES, *(-(-g // TRITS_PER_BYTE) for g in TERNARY_GROUP_SIZES)
)
COMPACT_UNIT_LANES = (8, 4, 2)  # lanes per row, preferred first
COMPACT_IDLE_MAX = 0.1  # the largest share of unit slots a layer may leave idle
GEMV_STAGE_WORDS = GEMV_WORD_LANES


def compact_unit_lanes(valid_bytes: int) -> int:
    """Lanes per row (WL) of gemv_compact for rows of `valid_bytes` packed bytes: the most
    lanes whose last super-step leaves at most COMPACT_IDLE_MAX of the unit slots idle, else
    the fewest idle (more lanes on ties)."""
    units = max(1, -(-valid_bytes // COMPACT_UNIT_BYTES))

    def idle(wl: int) -> float:
        return 1.0 - units / (wl * -(-units // wl))

    for wl in COMPACT_UNIT_LANES:
        if idle(wl) <= COMPACT_IDLE_MAX:
            return wl
    return min(COMPACT_UNIT_LANES, key=lambda wl: (idle(wl), -wl))


def compact_layout(valid_bytes: int) -> tuple:
    """(lanes per row WL, SIMD groups per threadgroup NSG) of gemv_compact: one row per
    lane, GEMV_TG_ROWS rows per threadgroup."""
    wl = compact_unit_lanes(valid_bytes)
    return wl, GEMV_TG_ROWS * wl // SIMD_WIDTH


def gemv_token_tile(m: int) -> int:
    """TM for an m-token GEMV: m rounded up to a power of 2 (fewer compiled variants)."""
    return next(t for t in GEMV_TOKEN_TILES if t >= m)


def gemv_layout(tm: int) -> tuple:
    """(rows per lane RL, SIMD groups per threadgroup NSG) of a GEMV with TM = tm."""
    rl = min(GEMV_LANE_ROWS, GEMV_LANE_ACCUMULATORS // tm)
    return rl, GEMV_TG_ROWS // (rl * (SIMD_WIDTH // GEMV_WORD_LANES))


# x pre-pass (prepass.metal): one threadgroup per token.
PREPASS_THREADS = 256

# Prefill GEMM (gemm.metal).
GEMM_THREADS = 256
GEMM_TOKENS = 64  # tokens per threadgroup tile
GEMM_ROWS = 32  # output rows per threadgroup tile
GEMM_STEP_BYTES = 8  # packed bytes of a row decoded per K step (one per thread)
GEMM_SG_TILE = 16  # tokens and rows of one SIMD group's share of the tile (2 x 2 matrices)
MMA_TILE = 8  # side of a simdgroup matrix
GEMM_FMA_ROWS = 4  # rows per thread of the FMA tiles (kernel="gemm_fma")
# Columns of a K step: 8 bytes = 32 codes (fast) or 40 trits (compact); tiles keep one more
# column so the rows of a threadgroup array do not start in the same bank.
GEMM_STEP_COLS = GEMM_STEP_BYTES * TRITS_PER_BYTE
GEMM_TILE_STRIDE = GEMM_STEP_COLS + 1

# Fixed-trip loops carry this so their arrays can stay in registers.
UNROLL = '_Pragma("clang loop unroll(full)")'

_MACROS = {
    "TERNARY_UNROLL": UNROLL,
    "TERNARY_SIMD_WIDTH": SIMD_WIDTH,
    "TERNARY_WORD_CODES": CODES_PER_WORD,
    "TERNARY_WORD_BYTES": ROW_ALIGN_BYTES,
    "TERNARY_BYTE_TRITS": TRITS_PER_BYTE,
    "TERNARY_GEMV_WORD_LANES": GEMV_WORD_LANES,
    "TERNARY_GEMV_STAGE_WORDS": GEMV_STAGE_WORDS,
    "TERNARY_UNIT_BYTES": COMPACT_UNIT_BYTES,
    "TERNARY_PREPASS_THREADS": PREPASS_THREADS,
    "TERNARY_GEMM_THREADS": GEMM_THREADS,
    "TERNARY_GEMM_TOKENS": GEMM_TOKENS,
    "TERNARY_GEMM_ROWS": GEMM_ROWS,
    "TERNARY_GEMM_STEP_BYTES": GEMM_STEP_BYTES,
    "TERNARY_GEMM_SG_TILE": GEMM_SG_TILE,
    "TERNARY_GEMM_TILE_STRIDE": GEMM_TILE_STRIDE,
    "TERNARY_MMA_TILE": MMA_TILE,
    "TERNARY_GEMM_FMA_ROWS": GEMM_FMA_ROWS,
}


def prelude() -> str:
    """The `#define` lines every kernel header starts with."""
    lines = ["// Generated by mlx_ternary/runtime/metal/geometry.py: the kernels' geometry."]
    lines += [f"#define {name} {value}" for name, value in _MACROS.items()]
    return "\n".join(lines) + "\n\n"


def macro_names() -> tuple:
    """The macros `prelude()` defines."""
    return tuple(_MACROS)
