// Decode GEMV, fast packing: y (M, N) = act_quant(x) (M, K) @ (s * t).T + bias, M <= 8.
//
// Thread mapping: one threadgroup = 2 SIMD groups x 32 lanes; each SIMD group owns 4
// consecutive output rows (8 rows per threadgroup, grid.y = ceil(N / 8)). Lane l reads word
// j = l, l + 32, ... of each of its 4 rows: 16 codes = 16 consecutive columns 16j..16j+15,
// so one SIMD-group step streams 32 words (128 bytes) per row and every packed word is read
// exactly once. Each lane keeps 4 rows x M tokens float32 partial sums; one simd_sum per
// (row, token) at the end, lane 0 writes.
//
// Decode (no shift, multiply or int->float convert per weight): a code q at bit 2p of either
// 16-bit half (p = 0..4) is masked in place and OR-ed with the fp16 exponent of 1024, which
// makes the half 1024 + 4^p q. The one shift per word (w >> 10) brings codes 5-7 and 13-15
// into mantissa positions. x is pre-scaled by 4^-p per column, so
//   sum_c t_c x_c = sum_c x'_c h_c - sum_c (1024 x'_c + x_c)
// and the correction C (per lane, step and token) is shared by the lane's 4 rows.
//   DECODE 0 ("offset"): FMA the raw halves, subtract C per step: ~2.4 ALU slots/weight.
//   DECODE 1 ("exact"):  subtract 1024 in fp16 first (exact), then FMA: ~3.4 slots/weight,
//                        products exact (bit-exact sums for int8 activations).
//
// File convention (all kernels): the text above the line "//// BODY ////" is passed to
// mx.fast.metal_kernel as `header`, the text below it as `source` (MLX writes the signature).
// Inputs: x (M, K) T; w (N, KW) uint32; scales (1,1)|(N,1)|(N,SC) ST; bias (N,) BT (a dummy
// when HAS_BIAS is false); params int32 [N, K, KW, SC]. Output: y (M, N) T.
// Templates: T, ST, BT, M (1..8), SMODE (0 tensor, 1 row, 2 group), G (group size, 0 if
// none), ACTQ (int8 per-token absmax activations), HAS_BIAS, DECODE.

// Bits of the fp16 1024.0 in both halves of a word.
constant constexpr uint TERNARY_EXP2 = 0x64006400u;

// Position-in-half scaling of the 16 codes of a word: codes 0-4 and 8-12 sit at p = c mod 8
// in the unshifted word, codes 5-7 and 13-15 at p = (c mod 8) - 5 after w >> 10.
inline float ternary_fast_prescale(int c) {
  int p = (c & 7) < 5 ? (c & 7) : (c & 7) - 5;
  return 1.0f / float(1 << (2 * p));
}

// Mean-free int8 absmax quantization of one value (reference.quantize_activations).
inline float ternary_act_quant(float v, float scale) {
  return clamp(rint(v * scale), -128.0f, 127.0f);
}

//// BODY ////
  const int N = params[0];
  const int K = params[1];
  const int KW = params[2];
  const int SC = params[3];
  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const uint tid = thread_index_in_threadgroup;
  const int row0 = (int(threadgroup_position_in_grid.y) * 2 + int(sg)) * 4;

  // Per-token activation scale (127 / absmax) when the layer quantizes activations.
  threadgroup float tg_amax[2 * 8];
  float act_scale[M];
  for (int m = 0; m < M; m++) {
    act_scale[m] = 1.0f;
  }
  if (ACTQ) {
    for (int m = 0; m < M; m++) {
      float a = 0.0f;
      for (int k = int(tid); k < K; k += 64) {
        a = max(a, fabs(static_cast<float>(x[m * K + k])));
      }
      a = simd_max(a);
      if (lane == 0) {
        tg_amax[sg * 8 + m] = a;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int m = 0; m < M; m++) {
      act_scale[m] = 127.0f / max(max(tg_amax[m], tg_amax[8 + m]), 1e-5f);
    }
  }

  // Rows past N repeat the last row (loads stay in bounds) and are never written.
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

  for (int j = int(lane); j < KW; j += 32) {
    const int k0 = j * 16;
    // Decode: 4 rows x 8 half2 = 4 x 16 codes as halves 1024 + 4^p q (or 4^p q, DECODE 1).
    half2 h[4][8];
    for (int r = 0; r < 4; r++) {
      // Rows past N read nothing: code 1 everywhere is a zero weight.
      const uint w = row0 + r < N ? wq[rows[r] * KW + j] : 0x55555555u;
      const uint w2 = w >> 10;
      for (int p = 0; p < 5; p++) {
        const uint mask = 0x00030003u << (2 * p);
        h[r][p] = as_type<half2>((w & mask) | TERNARY_EXP2);
      }
      for (int p = 0; p < 3; p++) {
        const uint mask = 0x00030003u << (2 * p);
        h[r][5 + p] = as_type<half2>((w2 & mask) | TERNARY_EXP2);
      }
      if (DECODE == 1) {
        for (int p = 0; p < 8; p++) {
          h[r][p] -= half2(1024.0h, 1024.0h);
        }
      }
    }
    // Group scales: the 16 columns of a word lie in one group (16 divides G).
    float s[4];
    for (int r = 0; r < 4; r++) {
      s[r] = SMODE == 2 ? static_cast<float>(scales[rows[r] * SC + k0 / max(G, 1)]) : 1.0f;
    }
    for (int m = 0; m < M; m++) {
      // Codes c and c + 8 share half2 slot (c mod 8): xv[c] pairs with h[.][c mod 8].x/.y.
      float xv[16];
      const bool full = k0 + 16 <= K;
      for (int c = 0; c < 16; c++) {
        float v = (full || k0 + c < K) ? static_cast<float>(x[m * K + k0 + c]) : 0.0f;
        if (ACTQ) {
          v = ternary_act_quant(v, act_scale[m]);
        }
        xv[c] = v;
      }
      float corr = 0.0f;
      for (int c = 0; c < 16; c++) {
        const float xs = xv[c] * ternary_fast_prescale(c);
        corr += DECODE == 0 ? fma(xs, 1024.0f, xv[c]) : xv[c];
        xv[c] = xs;
      }
      for (int r = 0; r < 4; r++) {
        float d = 0.0f;
        // Slots 0-4: codes 0-4 (.x) and 8-12 (.y); slots 5-7: codes 5-7 (.x), 13-15 (.y).
        for (int p = 0; p < 5; p++) {
          d = fma(xv[p], float(h[r][p].x), d);
          d = fma(xv[8 + p], float(h[r][p].y), d);
        }
        for (int p = 0; p < 3; p++) {
          d = fma(xv[5 + p], float(h[r][5 + p].x), d);
          d = fma(xv[13 + p], float(h[r][5 + p].y), d);
        }
        acc[r][m] = fma(s[r], d - corr, acc[r][m]);
      }
    }
  }

  for (int r = 0; r < 4; r++) {
    const int n = row0 + r;
    float srow = 1.0f;
    if (SMODE == 0) {
      srow = static_cast<float>(scales[0]);
    } else if (SMODE == 1) {
      srow = static_cast<float>(scales[rows[r]]);
    }
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
