// Decode GEMV, fast packing: y (M, N) = act_quant(x) (M, K) @ (s * t).T + bias for up to 16
// tokens in one launch, every packed word read once whatever M.
//
// Thread mapping: one threadgroup = NSG SIMD groups owns 64 output rows (grid.y =
// ceil(N / 64)) and every token. In a SIMD group, lane l works on word lane wl = l % WL
// (WL = 16) of row group l / WL (2 per SIMD group); a lane owns RL rows (RL = 4 up to 8
// tokens, 2 at 16: its RL x TM float accumulators stay <= 32 registers), so a SIMD group
// owns 2 RL rows and NSG = 64 / (2 RL). The threadgroup walks K in steps of WL words = 256
// columns: it stages the step's x for all tokens in threadgroup memory (quantized to int8
// values first with ACTQ) with each 16-column word's correction sum, then lane wl reads word
// j = step * WL + wl of each of its rows (64 contiguous bytes per row per step), decodes it
// once and applies it to every token from the staged x. So the packed weights are read once
// per call at any M <= 16, and x once per threadgroup (per 64 rows), not per SIMD group.
// At the end the WL lanes of a row group sum their partials with a butterfly and lane wl = 0
// writes.
//
// ACTQ (BitNet int8 activations): the threadgroup first takes each token's absmax over K
// (ternary_token_scales, common.metal) and quantizes x while staging it: one launch per call,
// no pre-pass. The staged values are integers, exact in half.
//
// Decode (no shift, multiply or int->float convert per weight): the code q at bit 2p of
// either 16-bit half (p = 0..4) is masked in place and OR-ed with the fp16 exponent 25 - 2p,
// which makes the half exactly 2^(10 - 2p) + q (per-field exponent constants). One shift per
// word (w >> 10) brings codes 5-7 and 13-15 into fields 0-2. With t = q - 1,
//   sum_c t_c x_c = sum_c h_c x_c - C,  C = sum_c x_c (2^(10 - 2 p_c) + 1),
// and C (per token and word) is computed once per threadgroup while staging, shared by its
// 64 rows.
//   DECODE 0 ("offset"): FMA the raw halves, subtract C per word.
//   DECODE 1 ("exact"):  subtract 2^(10 - 2p) in fp16 first (exact), C = sum x: every
//                        product exact. With integer activations both are exact.
//
// File convention (all kernels): the text above the line "//// BODY ////" is passed to
// mx.fast.metal_kernel as `header`, the text below it as `source` (MLX writes the signature).
// Inputs: x (M, K) XT; wq (N, KW) uint32; scales (1,1)|(N,1)|(N,SC) ST; bias (N,) BT (a dummy
// when !HAS_BIAS); params int32 [M, N, K, KW, SC]. Output: y (M, N) T.
// Templates: T, XT, XS (staging type: half for half x or ACTQ, else float), ST, BT, TM (tokens
// rounded up to 1, 2, 4, 8 or 16), RL (rows per lane), NSG (SIMD groups), SMODE (0 tensor,
// 1 row, 2 group), G (group size, 0 if none), ACTQ, HAS_BIAS, DECODE.
// Geometry macros (TERNARY_*) come from the prelude runtime/metal/geometry.py generates.

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
  constexpr int L = TERNARY_SIMD_WIDTH;
  constexpr int WL = TERNARY_GEMV_WORD_LANES;  // lanes along K per row group
  constexpr int WC = TERNARY_WORD_CODES;       // columns per word
  constexpr int HW = WC / 2;                   // half2 slots per word
  constexpr int XV = 4;                        // staged x vector width
  constexpr int WV = WC / XV;                  // staged vectors per word
  constexpr int SR = (L / WL) * RL;            // rows per SIMD group
  constexpr int NT = NSG * L;
  const uint tid = thread_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const int wl = int(lane) % WL;
  const int row0 = int(threadgroup_position_in_grid.y) * NSG * SR + int(sg) * SR +
                   (int(lane) / WL) * RL;

  threadgroup vec<XS, XV> xs[TM][WL * WV];  // the step's x, all tokens
  threadgroup float cs[TM][WL];             // each staged word's correction, negated: -C
  threadgroup float tsc[TM];                // ACTQ: activation scale per token
  threadgroup float tinv[TM];               // ACTQ: its inverse
  threadgroup float tred[NSG * TM];         // ACTQ: absmax scratch
  if (ACTQ) {
    ternary_token_scales<XT, TM, NSG>(x, M, K, tid, lane, sg, tred, tsc, tinv);
  }

  int rows[RL];
  TERNARY_UNROLL
  for (int r = 0; r < RL; r++) {
    rows[r] = min(row0 + r, N - 1);  // in bounds; rows past N are skipped
  }
  float acc[RL][TM];
  TERNARY_UNROLL
  for (int r = 0; r < RL; r++) {
    TERNARY_UNROLL
    for (int m = 0; m < TM; m++) {
      acc[r][m] = 0.0f;
    }
  }

  const int steps = (KW + WL - 1) / WL;
  for (int s = 0; s < steps; s++) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Stage: thread e takes (token m, word w) of the step: 16 columns and their correction.
    for (int e = int(tid); e < M * WL; e += NT) {
      const int m = e / WL;
      const int w = e % WL;
      const int k0 = (s * WL + w) * WC;
      float corr = 0.0f;
      TERNARY_UNROLL
      for (int q = 0; q < WV; q++) {
        vec<XS, XV> v;
        TERNARY_UNROLL
        for (int i = 0; i < XV; i++) {
          const int c = XV * q + i;
          float f = k0 + c < K ? static_cast<float>(x[m * K + k0 + c]) : 0.0f;
          if (ACTQ) {
            f = ternary_act_quant(f, tsc[m]);
          }
          v[i] = static_cast<XS>(f);
          const float wgt = DECODE == 0 ? float(1 << (10 - 2 * ternary_field(c))) + 1.0f : 1.0f;
          corr = fma(static_cast<float>(v[i]), wgt, corr);
        }
        xs[m][w * WV + q] = v;
      }
      cs[m][w] = -corr;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const int j = s * WL + wl;
    if (j < KW) {
      const int k0 = j * WC;
      TERNARY_UNROLL
      for (int r = 0; r < RL; r++) {
        if (row0 + r >= N) {
          continue;  // rows past N read nothing (and are never written)
        }
        // 8 half2: slot p < 5 holds codes p (.x) and 8 + p (.y); slots 5-7 hold codes 5-7
        // and 13-15 (fields 0-2 of w >> 10).
        const uint w = wq[rows[r] * KW + j];
        const uint w2 = w >> 10;
        half2 h[HW];
        TERNARY_UNROLL
        for (int p = 0; p < HW; p++) {
          const int f = p < 5 ? p : p - 5;
          const uint mask = 0x00030003u << (2 * f);
          h[p] = as_type<half2>(((p < 5 ? w : w2) & mask) | ternary_exponent(f));
          if (DECODE == 1) {
            const half base = half(1 << (10 - 2 * f));
            h[p] -= half2(base, base);
          }
        }
        // Group scales: the 16 columns of a word lie in one group (16 divides G).
        const float gs = SMODE == 2 ? static_cast<float>(scales[rows[r] * SC + k0 / max(G, 1)])
                                    : 1.0f;
        TERNARY_UNROLL
        for (int m = 0; m < TM; m++) {
          if (m < M) {
            // The word's partial sum starts at -C: one FMA per weight, then one add.
            float d = cs[m][wl];
            TERNARY_UNROLL
            for (int q = 0; q < WV; q++) {
              const vec<XS, XV> v = xs[m][wl * WV + q];
              TERNARY_UNROLL
              for (int i = 0; i < XV; i++) {
                // Column c = XV q + i is code c: slot c % 8, .x below 8, .y from 8.
                const int c = XV * q + i;
                const half hc = c < HW ? h[c].x : h[c - HW].y;
                d = fma(static_cast<float>(v[i]), static_cast<float>(hc), d);
              }
            }
            acc[r][m] = fma(gs, d, acc[r][m]);
          }
        }
      }
    }
  }

  // The WL lanes of a row group sum their partials; lane wl = 0 applies the row scale,
  // the activation scale and the bias.
  TERNARY_UNROLL
  for (int r = 0; r < RL; r++) {
    const int n = row0 + r;
    TERNARY_UNROLL
    for (int m = 0; m < TM; m++) {
      if (m < M) {
        const float total = ternary_lane_sum<WL>(acc[r][m]);
        if (wl == 0 && n < N) {
          const float srow = SMODE == 0 ? static_cast<float>(scales[0])
                           : (SMODE == 1 ? static_cast<float>(scales[n]) : 1.0f);
          float out = total * srow;
          if (ACTQ) {
            out *= tinv[m];
          }
          if (HAS_BIAS) {
            out += static_cast<float>(bias[n]);
          }
          y[m * N + n] = static_cast<T>(out);
        }
      }
    }
  }
