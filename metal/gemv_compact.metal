// Decode GEMV, compact packing (base-3, 5 trits per byte): y (M, N) = x (M, K) @ (s*t).T
// + bias for a few tokens. Compact is the memory option (1.6-1.75 bits per weight); its
// decode costs more ALU per weight than the fast packing's (docs/KERNELS.md).
//
// Thread mapping: one threadgroup = 2 SIMD groups x 32 lanes, 4 rows per SIMD group
// (grid.y = ceil(N / 8)), TM <= 4 tokens per threadgroup (grid.z = ceil(M / TM)). Lane l
// reads 32-bit word j = l, l + 32, ... of each of its rows: 4 bytes = 20 trits; a SIMD-group
// step streams 128 bytes per row, each word read once per token chunk. Each byte goes to
// the top of a 16-bit register (u = q << 8); per trit, two unsigned compares against
// 86 << 8 and 171 << 8 select -1, 0 or +1 and u += u << 1 (x3, wrapping mod 2^16) brings up
// the next trit: no multiply, shift or convert per trit. Trits are decoded once per step
// and shared by the tokens.
//
// Blocks: with group scales (G > 0) a block is one group of G columns, BPB = ceil(G / 5)
// bytes (a template constant: 13, 26 or 52); byte b holds columns blk * G + 5 (b - blk BPB)
// .. +4 of block blk = b / BPB, and a word's 4 bytes span at most 2 blocks (BPB > 4), each
// with its own partial sum and scale. Without group scales (G == 0) the row is one block:
// byte b holds columns 5b..5b+4 and there is no routing. Pad trits are zero trits, and bytes
// past the last block (row padding to 4 bytes) are never decoded.
//
// File convention: text above the "//// BODY ////" line is the `header`, text below the `source`.
// Inputs: x (M, K) XT; aux (M, AW) float (ACTQ: aux[m][0] = 1 / scale from the pre-pass; a
// 1-element dummy otherwise); wq (N, RB) uint8; scales ST; bias (N,) BT (dummy when
// !HAS_BIAS); params int32 [M, N, K, RB, SC, AW, VB (valid bytes per row)].
// Output: y (M, N) T. Templates: T, XT, ST, BT, TM (1..4), SMODE, G, ACTQ, HAS_BIAS.
// Geometry macros (TERNARY_*: SIMD groups, rows, word size, TERNARY_UNROLL) come from the
// prelude runtime/metal/geometry.py generates.

constant constexpr ushort TERNARY_T1 = 86 << 8;
constant constexpr ushort TERNARY_T2 = 171 << 8;

// Trit value (-1, 0, +1) of the byte in the top of u, as a half.
inline half ternary_trit(ushort u) {
  return u < TERNARY_T1 ? -1.0h : (u < TERNARY_T2 ? 0.0h : 1.0h);
}

//// BODY ////
  const int M = params[0];
  const int N = params[1];
  const int K = params[2];
  const int RB = params[3];
  const int SC = params[4];
  const int AW = params[5];
  const int VB = params[6];
  constexpr int R = TERNARY_GEMV_SG_ROWS;     // rows per SIMD group
  constexpr int L = TERNARY_SIMD_WIDTH;       // lanes = words per row per step
  constexpr int WB = TERNARY_WORD_BYTES;      // bytes per word
  constexpr int TB = TERNARY_BYTE_TRITS;      // trits per byte
  constexpr int BPB = G > 0 ? (G + TB - 1) / TB : 1;
  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const int row0 = (int(threadgroup_position_in_grid.y) * TERNARY_GEMV_SIMDGROUPS + int(sg)) * R;
  const int m0 = int(threadgroup_position_in_grid.z) * TM;
  const int mc = min(TM, M - m0);

  int rows[R];
  TERNARY_UNROLL
  for (int r = 0; r < R; r++) {
    rows[r] = min(row0 + r, N - 1);
  }
  float acc[R][TM];
  TERNARY_UNROLL
  for (int r = 0; r < R; r++) {
    TERNARY_UNROLL
    for (int m = 0; m < TM; m++) {
      acc[r][m] = 0.0f;
    }
  }
  const device uint* wwords = (const device uint*)wq;
  const int nwords = (VB + WB - 1) / WB;
  const int RW = RB / WB;
  for (int j = int(lane); j < nwords; j += L) {
    // Columns of the word's 4 bytes and the block part (0: first block, 1: the next).
    const int b0 = WB * j;
    const int blk0 = G > 0 ? b0 / BPB : 0;
    int col[WB];
    int part[WB];
    bool ok[WB];
    TERNARY_UNROLL
    for (int i = 0; i < WB; i++) {
      if (G > 0) {
        int off = b0 + i - blk0 * BPB;
        part[i] = off >= BPB ? 1 : 0;
        off -= part[i] * BPB;
        col[i] = (blk0 + part[i]) * G + TB * off;
      } else {
        part[i] = 0;
        col[i] = TB * (b0 + i);
      }
      ok[i] = b0 + i < VB;
    }
    // Trits of R rows x WB * TB columns, decoded once and shared by the tokens.
    half t[R][WB * TB];
    TERNARY_UNROLL
    for (int r = 0; r < R; r++) {
      // Rows past N read nothing: byte 128 is five zero trits.
      const uint w = row0 + r < N ? wwords[rows[r] * RW + j] : 0x80808080u;
      const ushort2 halves = as_type<ushort2>(w);
      ushort u[WB];
      u[0] = halves.x << 8;
      u[1] = halves.x & 0xFF00;
      u[2] = halves.y << 8;
      u[3] = halves.y & 0xFF00;
      TERNARY_UNROLL
      for (int i = 0; i < WB; i++) {
        ushort v = ok[i] ? u[i] : ushort(0x8000);  // q = 128: five zero trits
        TERNARY_UNROLL
        for (int d = 0; d < TB; d++) {
          t[r][TB * i + d] = ternary_trit(v);
          v = v + (v << 1);
        }
      }
    }
    float s0[R];
    float s1[R];
    TERNARY_UNROLL
    for (int r = 0; r < R; r++) {
      s0[r] = 1.0f;
      s1[r] = 1.0f;
      if (SMODE == 2) {
        s0[r] = static_cast<float>(scales[rows[r] * SC + min(blk0, SC - 1)]);
        s1[r] = static_cast<float>(scales[rows[r] * SC + min(blk0 + 1, SC - 1)]);
      }
    }
    TERNARY_UNROLL
    for (int m = 0; m < TM; m++) {
      if (m < mc) {
        const int xrow = (m0 + m) * K;
        float xv[WB * TB];
        TERNARY_UNROLL
        for (int i = 0; i < WB; i++) {
          TERNARY_UNROLL
          for (int d = 0; d < TB; d++) {
            const int k = col[i] + d;
            xv[TB * i + d] = (ok[i] && k < K) ? static_cast<float>(x[xrow + k]) : 0.0f;
          }
        }
        TERNARY_UNROLL
        for (int r = 0; r < R; r++) {
          float p0 = 0.0f;
          float p1 = 0.0f;
          TERNARY_UNROLL
          for (int i = 0; i < WB; i++) {
            float p = 0.0f;
            TERNARY_UNROLL
            for (int d = 0; d < TB; d++) {
              p = fma(xv[TB * i + d], float(t[r][TB * i + d]), p);
            }
            if (part[i] == 0) {
              p0 += p;
            } else {
              p1 += p;
            }
          }
          acc[r][m] = G > 0 ? fma(s0[r], p0, fma(s1[r], p1, acc[r][m])) : acc[r][m] + p0;
        }
      }
    }
  }

  // Lane 0 writes: only it reads the row scale, bias and activation scale.
  TERNARY_UNROLL
  for (int r = 0; r < R; r++) {
    const int n = row0 + r;
    TERNARY_UNROLL
    for (int m = 0; m < TM; m++) {
      if (m < mc) {
        const float total = simd_sum(acc[r][m]);
        if (lane == 0 && n < N) {
          const float srow = SMODE == 0 ? static_cast<float>(scales[0])
                           : (SMODE == 1 ? static_cast<float>(scales[n]) : 1.0f);
          float out = total * srow;
          if (ACTQ) {
            out *= aux[(m0 + m) * AW];
          }
          if (HAS_BIAS) {
            out += static_cast<float>(bias[n]);
          }
          y[(m0 + m) * N + n] = static_cast<T>(out);
        }
      }
    }
  }
