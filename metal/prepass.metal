// x pre-pass for prefill (the GEMM, M > 16 tokens) with BitNet int8 activations: per token,
// the absmax scale and the quantized row, computed once per call so the GEMM's threadgroups
// stage ready integers instead of each re-reducing x. (Decode, M <= 16, quantizes inside
// the GEMV: one launch per call.)
//
// Thread mapping: one threadgroup of TERNARY_PREPASS_THREADS threads per token (grid =
// (threads, M, 1)). Pass 1: thread t takes max |x| over columns t, t + threads, ...;
// simd_max, then the SIMD-group maxima through threadgroup memory. Pass 2: thread t
// quantizes the same columns with ternary_act_quant (common.metal: float32, as
// reference.quantize_activations defines it), stored as half (integers in [-128, 127] are
// exact in half).
//
// File convention (all kernels): the text above the line "//// BODY ////" is passed to
// mx.fast.metal_kernel as `header`, the text below it as `source` (MLX writes the signature).
// Inputs: x (M, K) T; params int32 [K]. Outputs: xq (M, K) half; aux (M, 1) float = 1 / scale
// (turns integer sums back into x's units). Templates: T.
// Geometry macros (TERNARY_*) come from the prelude runtime/metal/geometry.py generates.

//// BODY ////
  const int K = params[0];
  constexpr int NT = TERNARY_PREPASS_THREADS;
  constexpr int SGS = NT / TERNARY_SIMD_WIDTH;
  const int m = int(threadgroup_position_in_grid.y);
  const uint tid = thread_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const device T* xr = x + m * K;

  threadgroup float tg_max[SGS];
  float a = 0.0f;
  for (int k = int(tid); k < K; k += NT) {
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
  const float scale = ternary_act_scale(amax);
  if (tid == 0) {
    aux[m] = 1.0f / scale;
  }
  for (int k = int(tid); k < K; k += NT) {
    xq[m * K + k] = static_cast<half>(ternary_act_quant(static_cast<float>(xr[k]), scale));
  }
