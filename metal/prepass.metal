// x pre-pass for layers with BitNet int8 activations: y = act_quant(x) @ W.T needs, per
// token, the absmax scale and the quantized row. Computed here once per layer input, so the
// GEMV/GEMM that follows reads ready integers instead of re-reducing and re-quantizing x in
// every threadgroup and SIMD group.
//
// Thread mapping: one threadgroup of 256 threads (8 SIMD groups) per token (grid =
// (256, M, 1)). Pass 1: thread t takes max |x| over columns t, t + 256, ...; simd_max, then
// the 8 SIMD-group maxima through threadgroup memory. Pass 2: thread t quantizes the
// 16-column chunks c = t, t + 256, ...: xq = clamp(rint(x * 127 / amax), -128, 127), stored
// as half (integers in [-128, 127] are exact in half), and, with CORR, the chunk's
// correction sum for the fast GEMV (gemv_fast.metal). Arithmetic in float32, as
// reference.quantize_activations defines it (scale = 127 / max(amax, 1e-5)).
//
// File convention (all kernels): the text above the line "//// BODY ////" is passed to
// mx.fast.metal_kernel as `header`, the text below it as `source` (MLX writes the signature).
// Inputs: x (M, K) T; params int32 [K, AW]. Outputs: xq (M, K) half; aux (M, AW) float:
// aux[m][0] = 1 / scale (turns integer sums back into x's units), aux[m][1 + c] = the
// correction of chunk c when CORR != 0 (AW = 1 + Kp / 16 with Kp the fast packing's padded
// K, else AW = 1).
// Geometry macros (TERNARY_*: thread counts, word size, TERNARY_UNROLL) come from the prelude
// runtime/metal/geometry.py generates.
// Templates: T, CORR (0 none; 1 offset decode: sum_i xq_i (2^(10 - 2 p_i) + 1); 2 exact
// decode: sum_i xq_i), where p_i is the field of code i of a fast word (gemv_fast.metal).

// The weight of column i (0..15) of a chunk in the offset decode's correction: the decoded
// half of code i is 2^(10 - 2 p) + q with p = i mod 8 (or i mod 8 - 5 for 5..7).
inline float ternary_corr_weight(int i) {
  const int p = (i & 7) < 5 ? (i & 7) : (i & 7) - 5;
  return float(1 << (10 - 2 * p)) + 1.0f;
}

//// BODY ////
  const int K = params[0];
  const int AW = params[1];
  const int m = int(threadgroup_position_in_grid.y);
  const uint tid = thread_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const device T* xr = x + m * K;

  constexpr int SGS = TERNARY_PREPASS_THREADS / TERNARY_SIMD_WIDTH;
  constexpr int WC = TERNARY_WORD_CODES;
  threadgroup float tg_max[SGS];
  float a = 0.0f;
  for (int k = int(tid); k < K; k += TERNARY_PREPASS_THREADS) {
    a = max(a, fabs(static_cast<float>(xr[k])));
  }
  a = simd_max(a);
  if (lane == 0) {
    tg_max[sg] = a;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float amax = tg_max[0];
  TERNARY_UNROLL
  for (int g = 1; g < SGS; g++) {
    amax = max(amax, tg_max[g]);
  }
  const float scale = 127.0f / max(amax, 1e-5f);
  if (tid == 0) {
    aux[m * AW] = 1.0f / scale;
  }

  // With CORR, AW - 1 covers the fast packing's padded columns too (their sums are 0).
  const int chunks = CORR != 0 ? AW - 1 : (K + WC - 1) / WC;
  for (int c = int(tid); c < chunks; c += TERNARY_PREPASS_THREADS) {
    float corr = 0.0f;
    TERNARY_UNROLL
    for (int i = 0; i < WC; i++) {
      const int k = c * WC + i;
      if (k < K) {
        const float q = clamp(rint(static_cast<float>(xr[k]) * scale), -128.0f, 127.0f);
        xq[m * K + k] = static_cast<half>(q);
        corr += CORR == 1 ? q * ternary_corr_weight(i) : q;
      }
    }
    if (CORR != 0) {
      aux[m * AW + 1 + c] = corr;
    }
  }
