// SwiGLU on the CPU, float32: out = silu(g) * x = g * sigmoid(g) * x, elementwise (mlx-lm's
// `swiglu`, the gate of llama-style MLPs). MLX's CPU build computes exp one element at a time
// (a 128-token prefill of a 5632-wide MLP spends more there than in the layer's attention);
// this is one pass with a vectorized exp: Cephes' expf (range reduction by ln 2 in two parts,
// a degree-5 polynomial, the exponent added to the bits; within 2 ulp over the float range,
// inputs clamped to [-88, 88]), then sigmoid = 1 / (1 + exp(-g)) in float32.
#pragma once

#include <cmath>
#include <cstdint>

#include "../arch/select.h"

namespace tk {

inline float silu_mul_scalar(float g, float x) {
  const float e = std::exp(-std::fmin(std::fmax(g, -EXP_CLAMP), EXP_CLAMP));
  return g * (1.f / (1.f + e)) * x;
}


// out[i] = silu(g[i]) * x[i] for i in [i0, i1)
inline void silu_mul(const float* g, const float* x, float* out, int64_t i0, int64_t i1) {
  int64_t i = i0;
  i = native::silu_mul_head(g, x, out, i, i1);
  for (; i < i1; i++) out[i] = silu_mul_scalar(g[i], x[i]);
}

}  // namespace tk
