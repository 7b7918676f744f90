// Decode GEMV, fast packing: y (M, N) = x (M, K) @ (s * t).T + bias for a few tokens.
//
// Thread mapping: one threadgroup = 2 SIMD groups x 32 lanes; each SIMD group owns 4
// consecutive output rows (8 rows per threadgroup, grid.y = ceil(N / 8)) for TM tokens
// (grid.z = ceil(M / TM): more tokens are split over threadgroups, so a lane's registers
// stay bounded at TM <= 4). Lane l reads word j = l, l + 32, ... of each of its 4 rows: 16
// codes = 16 consecutive columns 16j..16j+15, so one SIMD-group step streams 32 words (128
// bytes) per row and every packed word is read once per token chunk. The next step's 4
// words are loaded before this step's FMAs (two steps in flight). Each lane keeps 4 rows x
// TM tokens float32 partial sums; one simd_sum per (row, token) at the end, lane 0 writes.
//
// Decode (no shift, multiply or int->float convert per weight): the code q at bit 2p of
// either 16-bit half (p = 0..4) is masked in place and OR-ed with the fp16 exponent 25 - 2p,
// which makes the half exactly 2^(10 - 2p) + q (per-field exponent constants). One shift per
// word (w >> 10) brings codes 5-7 and 13-15 into fields 0-2. With t = q - 1,
//   sum_c t_c x_c = sum_c h_c x_c - C,  C = sum_c x_c (2^(10 - 2 p_c) + 1),
// and C (per token and 16 columns) is shared by the 4 rows; with int8 activations the
// pre-pass (prepass.metal) has already computed it.
//   DECODE 0 ("offset"): FMA the raw halves, subtract C per step (~2.4 slots per weight).
//   DECODE 1 ("exact"):  subtract 2^(10 - 2p) in fp16 first (exact), C = sum x: every
//                        product exact. With integer activations both are exact.
//
// File convention (all kernels): the text above the line "//// BODY ////" is passed to
// mx.fast.metal_kernel as `header`, the text below it as `source` (MLX writes the signature).
// Inputs: x (M, K) XT; aux (M, AW) float (ACTQ: 1 / scale and the corrections from the
// pre-pass; a 1-element dummy otherwise); wq (N, KW) uint32; scales (1,1)|(N,1)|(N,SC) ST;
// bias (N,) BT (a dummy when !HAS_BIAS); params int32 [M, N, K, KW, SC, AW].
// Output: y (M, N) T. Templates: T, XT, ST, BT, TM (1..4), SMODE (0 tensor, 1 row, 2 group),
// G (group size, 0 if none), ACTQ, HAS_BIAS, DECODE, KALIGN (K % 16 == 0: one guard per
// word instead of one per column), XVEC (KALIGN and XT is half or float: x read as 4-vectors).
// Geometry macros (TERNARY_*: SIMD groups, rows, word size, TERNARY_UNROLL) come from the
// prelude runtime/metal/geometry.py generates.

// Field of code c (0..15) of a word: p = c mod 8, or c mod 8 - 5 for codes 5-7 (after >> 10).
inline int ternary_field(int c) {
  return (c & 7) < 5 ? (c & 7) : (c & 7) - 5;
}

// fp16 exponent 25 - 2p in both halves: the masked field p then reads 2^(10 - 2p) + q.
inline uint ternary_exponent(int p) {
  return uint(25 - 2 * p) * 0x04000400u;
}

//// BODY ////
  const int M = params[0];
  const int N = params[1];
  const int K = params[2];
  const int KW = params[3];
  const int SC = params[4];
  const int AW = params[5];
  constexpr int R = TERNARY_GEMV_SG_ROWS;     // rows per SIMD group
  constexpr int L = TERNARY_SIMD_WIDTH;       // lanes = words per row per step
  constexpr int WC = TERNARY_WORD_CODES;      // columns per word
  constexpr int HW = WC / 2;                  // half2 slots per word
  constexpr int XV = 4;                       // x vector width (XVEC)
  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const int row0 = (int(threadgroup_position_in_grid.y) * TERNARY_GEMV_SIMDGROUPS + int(sg)) * R;
  const int m0 = int(threadgroup_position_in_grid.z) * TM;
  const int mc = min(TM, M - m0);

  // Rows past N repeat the last row (loads stay in bounds) and are never written.
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

  // Rows past N read nothing: code 1 everywhere is a zero weight.
  uint wn[R];
  TERNARY_UNROLL
  for (int r = 0; r < R; r++) {
    wn[r] = (int(lane) < KW && row0 + r < N) ? wq[rows[r] * KW + int(lane)] : 0x55555555u;
  }
  for (int j = int(lane); j < KW; j += L) {
    const int k0 = j * WC;
    uint w[R];
    TERNARY_UNROLL
    for (int r = 0; r < R; r++) {
      w[r] = wn[r];
    }
    if (j + L < KW) {
      TERNARY_UNROLL
      for (int r = 0; r < R; r++) {
        wn[r] = row0 + r < N ? wq[rows[r] * KW + j + L] : 0x55555555u;
      }
    }
    // 4 rows x 8 half2: slot p < 5 holds codes p (.x) and 8 + p (.y); slots 5-7 hold codes
    // 5-7 and 13-15 (fields 0-2 of w >> 10).
    half2 h[R][HW];
    TERNARY_UNROLL
    for (int r = 0; r < R; r++) {
      const uint w2 = w[r] >> 10;
      TERNARY_UNROLL
      for (int p = 0; p < HW; p++) {
        const int f = p < 5 ? p : p - 5;
        const uint mask = 0x00030003u << (2 * f);
        h[r][p] = as_type<half2>(((p < 5 ? w[r] : w2) & mask) | ternary_exponent(f));
        if (DECODE == 1) {
          const half base = half(1 << (10 - 2 * f));
          h[r][p] -= half2(base, base);
        }
      }
    }
    // Group scales: the 16 columns of a word lie in one group (16 divides G).
    float s[R];
    TERNARY_UNROLL
    for (int r = 0; r < R; r++) {
      s[r] = SMODE == 2 ? static_cast<float>(scales[rows[r] * SC + k0 / max(G, 1)]) : 1.0f;
    }
    TERNARY_UNROLL
    for (int m = 0; m < TM; m++) {
      if (m < mc) {
        const int xrow = (m0 + m) * K;
        float xv[WC];
        if (KALIGN) {
          // Whole 16-column words; only the padding word of K % 32 == 16 lies past K.
          const bool in_k = k0 < K;
          if (XVEC && in_k) {
            const device vec<XT, XV>* xp = (const device vec<XT, XV>*)(x + xrow + k0);
            TERNARY_UNROLL
            for (int q = 0; q < WC / XV; q++) {
              const vec<XT, XV> v = xp[q];
              TERNARY_UNROLL
              for (int i = 0; i < XV; i++) {
                xv[XV * q + i] = static_cast<float>(v[i]);
              }
            }
          } else {
            TERNARY_UNROLL
            for (int c = 0; c < WC; c++) {
              xv[c] = in_k ? static_cast<float>(x[xrow + k0 + c]) : 0.0f;
            }
          }
        } else {
          const bool full = k0 + WC <= K;
          TERNARY_UNROLL
          for (int c = 0; c < WC; c++) {
            xv[c] = (full || k0 + c < K) ? static_cast<float>(x[xrow + k0 + c]) : 0.0f;
          }
        }
        float corr = 0.0f;
        if (ACTQ) {
          corr = aux[(m0 + m) * AW + 1 + j];
        } else {
          TERNARY_UNROLL
          for (int c = 0; c < WC; c++) {
            const float wgt = DECODE == 0 ? float(1 << (10 - 2 * ternary_field(c))) + 1.0f
                                          : 1.0f;
            corr = fma(xv[c], wgt, corr);
          }
        }
        TERNARY_UNROLL
        for (int r = 0; r < R; r++) {
          float d = 0.0f;
          TERNARY_UNROLL
          for (int p = 0; p < HW; p++) {
            // Slot p pairs codes c = p (or 5 + p - 5 = p) in .x with c + 8 in .y.
            d = fma(xv[p], float(h[r][p].x), d);
            d = fma(xv[HW + p], float(h[r][p].y), d);
          }
          acc[r][m] = fma(s[r], d - corr, acc[r][m]);
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
