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

constexpr float EXP_CLAMP = 88.f;

inline float silu_mul_scalar(float g, float x) {
  const float e = std::exp(-std::fmin(std::fmax(g, -EXP_CLAMP), EXP_CLAMP));
  return g * (1.f / (1.f + e)) * x;
}

#if defined(TK_X86)
inline __m256 exp8(__m256 v) {
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-EXP_CLAMP)), _mm256_set1_ps(EXP_CLAMP));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n for n in [-127, 127]: split in two factors so neither exponent field overflows
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 s2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
#endif

// out[i] = silu(g[i]) * x[i] for i in [i0, i1)
inline void silu_mul(const float* g, const float* x, float* out, int64_t i0, int64_t i1) {
  int64_t i = i0;
#if defined(TK_X86)
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= i1; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_xor_ps(gv, sign));
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(x + i)));
  }
#endif
  for (; i < i1; i++) out[i] = silu_mul_scalar(g[i], x[i]);
}

}  // namespace tk
