// Decode GEMV, compact packing (base-3, 5 trits per byte): y (M, N) = act_quant(x) @ (s*t).T
// + bias, M <= 8. Two decode strategies, chosen by the DECODE template argument; they have
// different thread mappings (the wrapper sets grid and threadgroup to match).
//
// Thread mapping:
//
// DECODE 0 ("select"). Threadgroup = 2 SIMD groups x 32 lanes, 4 rows per SIMD group
// (grid.y = ceil(N / 8)). Lane l reads 32-bit word j = l, l + 32, ... of each of its rows:
// 4 bytes = 20 trits; a SIMD-group step streams 128 bytes per row, each word read once.
// Each byte goes to the top of a 16-bit register (u = q << 8); per trit, two unsigned
// compares against 86 << 8 and 171 << 8 select -1, 0 or +1 and u += u << 1 (x3, wrapping
// mod 2^16) brings up the next trit: no multiply, shift or convert per trit.
//
// DECODE 1 ("table", T-MAC style). Threadgroup = 128 threads, one output row per thread
// (grid.y = ceil(N / 128)). K is walked block by block (a block is one scale group, or the
// whole row) in slices of SB byte positions. Per slice the threadgroup builds, for each
// token and byte position, the partial sums sum_i (d_i - 1) x_{k+i} for all 243 byte values,
// stored at index q (the packed byte itself, so no v = (q*243) >> 8 is needed) in threadgroup
// memory; then each thread reads its row's bytes of the slice (each byte once) and adds one
// table entry per byte: one load + one add per 5 weights.
//
// Column of trit i of byte b: block blk = b / BPB (BPB = ceil(B / 5) bytes per block of B
// columns, B = G or K), column = blk * B + 5 * (b - blk * BPB) + i. Pad trits are zero
// trits, and bytes past nb * BPB (row padding to 4 bytes) are never decoded.
//
// File convention: text above the "//// BODY ////" line is the `header`, text below the `source`.
// Inputs: x (M, K) T; wq (N, RB) uint8; scales ST; bias (N,) BT (dummy when !HAS_BIAS);
// params int32 [N, K, RB, SC, B, BPB, NB]. Output: y (M, N) T.
// Templates: T, ST, BT, M, SMODE (0 tensor, 1 row, 2 group), ACTQ, HAS_BIAS, DECODE,
// SB (table strategy: byte positions per slice).

constant constexpr ushort TERNARY_T1 = 86 << 8;
constant constexpr ushort TERNARY_T2 = 171 << 8;

inline float ternary_act_quant(float v, float scale) {
  return clamp(rint(v * scale), -128.0f, 127.0f);
}

// Trit value (-1, 0, +1) of the byte in the top of u, as a half.
inline half ternary_trit(ushort u) {
  return u < TERNARY_T1 ? -1.0h : (u < TERNARY_T2 ? 0.0h : 1.0h);
}

// q = ceil(v * 256 / 243): where the table strategy stores the partial sum of byte value v.
constant ushort TERNARY_Q[243] = {
    0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
    17, 18, 19, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33,
    34, 35, 36, 37, 38, 39, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50,
    51, 52, 53, 54, 55, 56, 57, 58, 59, 61, 62, 63, 64, 65, 66, 67,
    68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 80, 81, 82, 83, 84,
    85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 96, 97, 98, 100, 101,
    102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 117,
    118, 120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131, 132, 133, 134,
    135, 136, 137, 139, 140, 141, 142, 143, 144, 145, 146, 147, 148, 149, 150, 151,
    152, 153, 154, 155, 156, 157, 159, 160, 161, 162, 163, 164, 165, 166, 167, 168,
    169, 170, 171, 172, 173, 174, 175, 176, 177, 179, 180, 181, 182, 183, 184, 185,
    186, 187, 188, 189, 190, 191, 192, 193, 194, 195, 196, 198, 199, 200, 201, 202,
    203, 204, 205, 206, 207, 208, 209, 210, 211, 212, 213, 214, 215, 216, 218, 219,
    220, 221, 222, 223, 224, 225, 226, 227, 228, 229, 230, 231, 232, 233, 234, 235,
    236, 238, 239, 240, 241, 242, 243, 244, 245, 246, 247, 248, 249, 250, 251, 252,
    253, 254, 255,
};

//// BODY ////
  const int N = params[0];
  const int K = params[1];
  const int RB = params[2];
  const int SC = params[3];
  const int B = params[4];
  const int BPB = params[5];
  const int NB = params[6];
  const uint lane = thread_index_in_simdgroup;
  const uint tid = thread_index_in_threadgroup;
  const int nthreads = DECODE == 0 ? 64 : 128;
  const int valid_bytes = NB * BPB;

  threadgroup float tg_amax[4 * 8];
  // Table strategy: [M][SB][256] float partial sums (unused, size 1, for DECODE 0).
  threadgroup float tg_tab[DECODE == 1 ? M * SB * 256 : 1];

  float act_scale[M];
  for (int m = 0; m < M; m++) {
    act_scale[m] = 1.0f;
  }
  if (ACTQ) {
    for (int m = 0; m < M; m++) {
      float a = 0.0f;
      for (int k = int(tid); k < K; k += nthreads) {
        a = max(a, fabs(static_cast<float>(x[m * K + k])));
      }
      a = simd_max(a);
      if (lane == 0) {
        tg_amax[simdgroup_index_in_threadgroup * 8 + m] = a;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int m = 0; m < M; m++) {
      float a = 0.0f;
      for (int g = 0; g < nthreads / 32; g++) {
        a = max(a, tg_amax[g * 8 + m]);
      }
      act_scale[m] = 127.0f / max(a, 1e-5f);
    }
  }

  if (DECODE == 0) {
    const uint sg = simdgroup_index_in_threadgroup;
    const int row0 = (int(threadgroup_position_in_grid.y) * 2 + int(sg)) * 4;
    int rows[4];
    for (int r = 0; r < 4; r++) {
      rows[r] = min(row0 + r, N - 1);
    }
    float acc[4][M];
    for (int r = 0; r < 4; r++) {
      for (int m = 0; m < M; m++) {
        acc[r][m] = 0.0f;
      }
    }
    const device uint* wwords = (const device uint*)wq;
    const int nwords = (valid_bytes + 3) / 4;
    const int RW = RB / 4;
    for (int j = int(lane); j < nwords; j += 32) {
      // Columns of the word's 4 bytes; a word spans at most 2 blocks (BPB >= 13 > 4).
      const int b0 = 4 * j;
      const int blk0 = b0 / BPB;
      int col[4];
      int part[4];
      bool ok[4];
      for (int i = 0; i < 4; i++) {
        int off = b0 + i - blk0 * BPB;
        part[i] = off >= BPB ? 1 : 0;
        off -= part[i] * BPB;
        col[i] = (blk0 + part[i]) * B + 5 * off;
        ok[i] = b0 + i < valid_bytes;
      }
      // Trits of 4 rows x 20 columns, decoded once and shared by the M tokens.
      half t[4][20];
      for (int r = 0; r < 4; r++) {
        // Rows past N read nothing: byte 128 is five zero trits.
        const uint w = row0 + r < N ? wwords[rows[r] * RW + j] : 0x80808080u;
        const ushort2 halves = as_type<ushort2>(w);
        ushort u[4];
        u[0] = halves.x << 8;
        u[1] = halves.x & 0xFF00;
        u[2] = halves.y << 8;
        u[3] = halves.y & 0xFF00;
        for (int i = 0; i < 4; i++) {
          ushort v = ok[i] ? u[i] : ushort(0x8000);  // q = 128: five zero trits
          for (int d = 0; d < 5; d++) {
            t[r][5 * i + d] = ternary_trit(v);
            v = v + (v << 1);
          }
        }
      }
      float s0[4];
      float s1[4];
      for (int r = 0; r < 4; r++) {
        s0[r] = 1.0f;
        s1[r] = 1.0f;
        if (SMODE == 2) {
          s0[r] = static_cast<float>(scales[rows[r] * SC + min(blk0, SC - 1)]);
          s1[r] = static_cast<float>(scales[rows[r] * SC + min(blk0 + 1, SC - 1)]);
        }
      }
      for (int m = 0; m < M; m++) {
        float xv[20];
        for (int i = 0; i < 4; i++) {
          for (int d = 0; d < 5; d++) {
            const int k = col[i] + d;
            float v = (ok[i] && k < K) ? static_cast<float>(x[m * K + k]) : 0.0f;
            xv[5 * i + d] = ACTQ ? ternary_act_quant(v, act_scale[m]) : v;
          }
        }
        for (int r = 0; r < 4; r++) {
          float p0 = 0.0f;
          float p1 = 0.0f;
          for (int i = 0; i < 4; i++) {
            float p = 0.0f;
            for (int d = 0; d < 5; d++) {
              p = fma(xv[5 * i + d], float(t[r][5 * i + d]), p);
            }
            if (part[i] == 0) {
              p0 += p;
            } else {
              p1 += p;
            }
          }
          acc[r][m] = fma(s0[r], p0, fma(s1[r], p1, acc[r][m]));
        }
      }
    }
    for (int r = 0; r < 4; r++) {
      const int n = row0 + r;
      float srow = SMODE == 0 ? static_cast<float>(scales[0])
                 : (SMODE == 1 ? static_cast<float>(scales[rows[r]]) : 1.0f);
      for (int m = 0; m < M; m++) {
        const float total = simd_sum(acc[r][m]);
        if (lane == 0 && n < N) {
          float out = total * srow;
          if (ACTQ) {
            out = out / act_scale[m];
          }
          if (HAS_BIAS) {
            out += static_cast<float>(bias[n]);
          }
          y[m * N + n] = static_cast<T>(out);
        }
      }
    }
  } else {
    const int n = int(threadgroup_position_in_grid.y) * 128 + int(tid);
    const int row = min(n, N - 1);
    const device uchar* wrow = wq + row * RB;
    float acc[M];
    for (int m = 0; m < M; m++) {
      acc[m] = 0.0f;
    }
    for (int blk = 0; blk < NB; blk++) {
      float part[M];
      for (int m = 0; m < M; m++) {
        part[m] = 0.0f;
      }
      for (int c0 = 0; c0 < BPB; c0 += SB) {
        const int nb = min(SB, BPB - c0);
        // Build: unit (m, sb, a) fills the 9 entries v = 9a + b, b = 0..8, from the sum
        // of digits d0..d2 of a and the 9 sums of digits d3, d4.
        const int units = M * nb * 27;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int e = int(tid); e < units; e += 128) {
          const int m = e / (nb * 27);
          const int sb = (e / 27) % nb;
          const int a = e % 27;
          const int kb = blk * B + 5 * (c0 + sb);
          const int kend = min(blk * B + B, K);
          float xs[5];
          for (int d = 0; d < 5; d++) {
            const int k = kb + d;
            float v = k < kend ? static_cast<float>(x[m * K + k]) : 0.0f;
            xs[d] = ACTQ ? ternary_act_quant(v, act_scale[m]) : v;
          }
          const float hi = float(a / 9 - 1) * xs[0] + float((a / 3) % 3 - 1) * xs[1]
                         + float(a % 3 - 1) * xs[2];
          threadgroup float* tab = tg_tab + (m * SB + sb) * 256;
          for (int b = 0; b < 9; b++) {
            tab[TERNARY_Q[9 * a + b]] = hi + float(b / 3 - 1) * xs[3] + float(b % 3 - 1) * xs[4];
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const int bbase = blk * BPB + c0;
        for (int sb = 0; sb < nb; sb++) {
          const uint q = n < N ? uint(wrow[bbase + sb]) : 128u;  // 128: five zero trits
          for (int m = 0; m < M; m++) {
            part[m] += tg_tab[(m * SB + sb) * 256 + q];
          }
        }
      }
      const float s = SMODE == 2 ? static_cast<float>(scales[row * SC + blk]) : 1.0f;
      for (int m = 0; m < M; m++) {
        acc[m] = fma(s, part[m], acc[m]);
      }
    }
    if (n < N) {
      float srow = SMODE == 0 ? static_cast<float>(scales[0])
                 : (SMODE == 1 ? static_cast<float>(scales[row]) : 1.0f);
      for (int m = 0; m < M; m++) {
        float out = acc[m] * srow;
        if (ACTQ) {
          out = out / act_scale[m];
        }
        if (HAS_BIAS) {
          out += static_cast<float>(bias[n]);
        }
        y[m * N + n] = static_cast<T>(out);
      }
    }
  }
