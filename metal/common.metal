// Helpers shared by the kernels: runtime/metal/sources.py prepends this file (after the
// generated geometry prelude) to every kernel's header. It holds no kernel and no body
// marker line.

// BitNet int8 activations, in float32 as reference.quantize_activations defines them:
// scale = 127 / max(absmax, 1e-5) per token, xq = clamp(rint(x * scale), -128, 127).
inline float ternary_act_scale(float amax) {
  return 127.0f / max(amax, 1e-5f);
}

inline float ternary_act_quant(float v, float scale) {
  return clamp(rint(v * scale), -128.0f, 127.0f);
}

// The activation scale of each of the first M rows of x (M x K, M <= TM), computed by a
// whole threadgroup of NSG SIMD groups: scale[m] and inv[m] = 1 / scale[m] in threadgroup
// memory (`red` is NSG * TM floats of scratch). Every thread must call it; it ends with a
// barrier, so every thread may read scale and inv afterwards.
template <typename T, int TM, int NSG>
inline void ternary_token_scales(const device T* x, int M, int K, uint tid, uint lane, uint sg,
                                 threadgroup float* red, threadgroup float* scale,
                                 threadgroup float* inv) {
  float a[TM];
  TERNARY_UNROLL
  for (int m = 0; m < TM; m++) {
    a[m] = 0.0f;
  }
  for (int k = int(tid); k < K; k += NSG * TERNARY_SIMD_WIDTH) {
    TERNARY_UNROLL
    for (int m = 0; m < TM; m++) {
      if (m < M) {
        a[m] = max(a[m], fabs(static_cast<float>(x[m * K + k])));
      }
    }
  }
  TERNARY_UNROLL
  for (int m = 0; m < TM; m++) {
    const float s = simd_max(a[m]);
    if (lane == 0) {
      red[int(sg) * TM + m] = s;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (int(tid) < TM) {
    float amax = red[tid];
    for (int g = 1; g < NSG; g++) {
      amax = max(amax, red[g * TM + int(tid)]);
    }
    const float sc = ternary_act_scale(amax);
    scale[tid] = sc;
    inv[tid] = 1.0f / sc;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Sum of v over the WL lanes of a SIMD group that share lane / WL (a butterfly, so every
// one of them holds the sum).
template <int WL>
inline float ternary_lane_sum(float v) {
  TERNARY_UNROLL
  for (int off = WL / 2; off > 0; off /= 2) {
    v += simd_shuffle_xor(v, ushort(off));
  }
  return v;
}
