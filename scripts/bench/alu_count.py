"""ALU issue slots per weight of the two decode GEMVs, counted from their sources.

The method (docs/KERNELS.md, "Costs per kernel"): per lane and row, FMA, add, bitwise,
compare-select, min and an integer add with a folded left shift are 1 slot; shifts and
integer multiply-adds 1 (on a quarter-rate pipe); half2 arithmetic 2; fp16 sources to an
fp32 FMA and `as_type` free; every load (device or threadgroup, scalar or vector) 1; a
guard 1. A lane's decode is paid once per row and shared by the tokens, the per-token part
M times; the threadgroup's staging (shared by its 64 rows) is listed apart in the docs.
The counts below are transcribed from metal/gemv_fast.metal and metal/gemv_compact.metal
as written; change them with the kernels.

    python scripts/bench/alu_count.py            # the table docs/KERNELS.md quotes
    python scripts/bench/alu_count.py --check    # compact within 1.2x of fast everywhere
"""

import argparse
import sys

TOKENS = (1, 2, 4, 8, 16)
GROUPS = (0, 256, 128, 64)  # 0: tensor or row scales
TARGET = 1.2

# gemv_fast, per lane, row and 16-weight word.
FAST_WEIGHTS = 16
FAST_DECODE = 1 + 1 + 1 + 1 + 8 * 2  # guard, address, load, w >> 10, 8 x (AND + OR)
FAST_GROUP = 4  # address, shift, add, load of the word's group scale
FAST_TOKEN = 1 + 4 + 16 + 1  # correction load, 4 x loads, 16 FMA, 1 FMA/add into acc

# gemv_compact, per lane, row and 52-byte unit (13 words of 20 trits).
UNIT_WORDS = 13
UNIT_TRITS = UNIT_WORDS * 20
UNIT_OVERHEAD = 1 + 1 + 1  # the unit's guard, its full-unit test, its address
WORD_DECODE = 1 + 2 * 3 + 5 * 2 * 2  # load; 2 placements (shift, AND, OR); 5 steps x 2 regs
WORD_TOKEN = 1 + 6 + 24  # chain corrections (one 2-vector), 6 coefficient 4-vectors, 24 FMA


def compact_blocks(g: int) -> tuple:
    """(blocks per unit, words of a unit with a block edge inside) for group size g."""
    if g == 0:
        return 1, 0  # the row is one block: one chain per word, its sum added
    bpb = -(-g // 5)
    blocks = UNIT_WORDS * 4 // bpb
    inside = sum(1 for i in range(UNIT_WORDS) if (4 * i) // bpb != (4 * i + 3) // bpb)
    return blocks, inside


def fast_slots(g: int, m: int) -> float:
    return (FAST_DECODE + (FAST_GROUP if g else 0) + FAST_TOKEN * m) / FAST_WEIGHTS


def compact_slots(g: int, m: int) -> float:
    blocks, inside = compact_blocks(g)
    scales = 1 + 3 * blocks if g else 0  # address, then (add, min, load) per block
    per_row = UNIT_OVERHEAD + UNIT_WORDS * WORD_DECODE + scales
    per_token = UNIT_WORDS * (WORD_TOKEN + 1) + inside  # + 1 FMA/add per chain
    return (per_row + per_token * m) / UNIT_TRITS


def table() -> list:
    """Rows (group, M, fast slots, compact slots, ratio), and the per-token limit (M -> inf)."""
    rows = []
    for g in GROUPS:
        for m in TOKENS:
            f, c = fast_slots(g, m), compact_slots(g, m)
            rows.append((g, m, f, c, c / f))
        lim = (compact_slots(g, 1) - compact_slots(g, 0)) / (fast_slots(g, 1) - fast_slots(g, 0))
        rows.append((g, "inf", FAST_TOKEN / FAST_WEIGHTS, None, lim))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help=f"assert compact <= {TARGET}x fast")
    args = ap.parse_args(argv)
    print("slots per weight; group 0 = tensor/row scales; M = inf: the per-token part")
    print(f"{'group':>5} {'M':>4} {'fast':>7} {'compact':>8} {'ratio':>6}")
    worst = 0.0
    for g, m, f, c, r in table():
        cells = f"{c:8.3f}" if c is not None else f"{'':8}"
        print(f"{g:>5} {m:>4} {f:7.3f} {cells} {r:6.3f}")
        worst = max(worst, r)
    print(f"worst ratio {worst:.3f} (target <= {TARGET})")
    if args.check and worst > TARGET:
        print("FAIL: compact's decode above the target", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
