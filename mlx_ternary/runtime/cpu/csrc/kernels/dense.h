// Dense float rows on the CPU: y (M, N) = x (M, K) @ W (N, K).T with W kept in the dtype the
// checkpoint stores (float16, bfloat16 or float32) and float32 accumulation. This is the
// embedding-as-output-layer and lm_head matvec: MLX's CPU float16 matmul is many times slower
// than float32, and a float32 copy would double the memory of those tables.
// Each group of 8 weights is converted once and used for T tokens. A token's sum runs in the
// same order whatever T is (DENSE_CHAINS chains, their sum, then the tail), so a row of y
// does not depend on how many tokens share the call: batched decoding gives the single
// sequence's logits bit for bit (mlx-lm's batch tests compare them).
#pragma once

#include <cstdint>

#include "../arch/select.h"
#include "layer.h"

namespace tk {

struct DenseLayer {
  const void* w = nullptr;  // (N, K)
  int w_dtype = F32;
  int64_t n = 0, k = 0;
  const float* x = nullptr;  // (M, K) float32
  void* out = nullptr;       // (M, N)
  int out_dtype = F32;
};

inline const char* dense_isa() {
#if defined(TK_X86_AVX512)
  return "avx512-f16c";
#elif defined(TK_X86)
  return "avx2-f16c";
#elif defined(TK_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

// DENSE_CHAINS accumulation chains per token hide the FMA latency; the T * DENSE_CHAINS
// accumulators of a block of T tokens must fit the vector registers (16 AVX2, 32 NEON).
constexpr int DENSE_CHAINS = 4;
#if defined(TK_NEON)
constexpr int DENSE_TOKENS = 4;
#else
constexpr int DENSE_TOKENS = 3;
#endif

#if defined(TK_X86)
template <int WD>
inline __m256 load8(const void* w, int64_t i) {
  if constexpr (WD == F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)w + i)));
  } else if constexpr (WD == BF16) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)w + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  } else {
    return _mm256_loadu_ps((const float*)w + i);
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [n0, n1), tokens m0 .. m0 + T - 1.
template <int WD, int T>
void dense_rows_t(const DenseLayer& L, int64_t n0, int64_t n1, int64_t m0) {
  const int64_t k = L.k, kv = k / (8 * DENSE_CHAINS) * (8 * DENSE_CHAINS);
  for (int64_t n = n0; n < n1; n++) {
    const int64_t base = n * k;
    __m256 acc[T][DENSE_CHAINS];
    for (int t = 0; t < T; t++)
      for (int j = 0; j < DENSE_CHAINS; j++) acc[t][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < kv; i += 8 * DENSE_CHAINS) {
      __builtin_prefetch((const char*)L.w + (base + i) * (WD == F32 ? 4 : 2) + PREFETCH_BYTES);
      for (int j = 0; j < DENSE_CHAINS; j++) {
        __m256 w = load8<WD>(L.w, base + i + 8 * j);
        for (int t = 0; t < T; t++)
          acc[t][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(L.x + (m0 + t) * k + i + 8 * j),
                                      acc[t][j]);
      }
    }
    for (int t = 0; t < T; t++) {
      __m256 s = acc[t][0];
      for (int j = 1; j < DENSE_CHAINS; j++) s = _mm256_add_ps(s, acc[t][j]);
      float y = hsum8(s);
      for (int64_t i = kv; i < k; i++) y += load_as_f32(L.w, WD, base + i) * L.x[(m0 + t) * k + i];
      store_from_f32(L.out, L.out_dtype, (m0 + t) * L.n + n, y);
    }
  }
}

#if defined(TK_X86_AVX512)
template <int WD>
inline __m512 load16(const void* w, int64_t i) {
  if constexpr (WD == F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)w + i)));
  } else if constexpr (WD == BF16) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)w + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  } else {
    return _mm512_loadu_ps((const float*)w + i);
  }
}

// dense_rows_t on 16-lane vectors: the same chains, each twice as wide.
template <int WD, int T>
void dense_rows_t512(const DenseLayer& L, int64_t n0, int64_t n1, int64_t m0) {
  const int64_t k = L.k, kv = k / (16 * DENSE_CHAINS) * (16 * DENSE_CHAINS);
  for (int64_t n = n0; n < n1; n++) {
    const int64_t base = n * k;
    __m512 acc[T][DENSE_CHAINS];
    for (int t = 0; t < T; t++)
      for (int j = 0; j < DENSE_CHAINS; j++) acc[t][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kv; i += 16 * DENSE_CHAINS) {
      constexpr int step_bytes = 16 * DENSE_CHAINS * (WD == F32 ? 4 : 2);
      const char* ahead = (const char*)L.w + (base + i) * (WD == F32 ? 4 : 2) + PREFETCH_BYTES;
      for (int b = 0; b < step_bytes; b += 64) __builtin_prefetch(ahead + b);  // every line
      for (int j = 0; j < DENSE_CHAINS; j++) {
        __m512 w = load16<WD>(L.w, base + i + 16 * j);
        for (int t = 0; t < T; t++)
          acc[t][j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(L.x + (m0 + t) * k + i + 16 * j),
                                      acc[t][j]);
      }
    }
    for (int t = 0; t < T; t++) {
      __m512 s = acc[t][0];
      for (int j = 1; j < DENSE_CHAINS; j++) s = _mm512_add_ps(s, acc[t][j]);
      float y = _mm512_reduce_add_ps(s);
      for (int64_t i = kv; i < k; i++) y += load_as_f32(L.w, WD, base + i) * L.x[(m0 + t) * k + i];
      store_from_f32(L.out, L.out_dtype, (m0 + t) * L.n + n, y);
    }
  }
}
#endif
#elif defined(TK_NEON)
template <int WD>
inline float32x4_t load4(const void* w, int64_t i) {
  if constexpr (WD == F16) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)w + i)));
  } else if constexpr (WD == BF16) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t*)w + i), 16));
  } else {
    return vld1q_f32((const float*)w + i);
  }
}

template <int WD, int T>
void dense_rows_t(const DenseLayer& L, int64_t n0, int64_t n1, int64_t m0) {
  const int64_t k = L.k, kv = k / (4 * DENSE_CHAINS) * (4 * DENSE_CHAINS);
  for (int64_t n = n0; n < n1; n++) {
    const int64_t base = n * k;
    float32x4_t acc[T][DENSE_CHAINS];
    for (int t = 0; t < T; t++)
      for (int j = 0; j < DENSE_CHAINS; j++) acc[t][j] = vdupq_n_f32(0);
    for (int64_t i = 0; i < kv; i += 4 * DENSE_CHAINS) {
      __builtin_prefetch((const char*)L.w + (base + i) * (WD == F32 ? 4 : 2) + PREFETCH_BYTES);
      for (int j = 0; j < DENSE_CHAINS; j++) {
        float32x4_t w = load4<WD>(L.w, base + i + 4 * j);
        for (int t = 0; t < T; t++)
          acc[t][j] = vfmaq_f32(acc[t][j], w, vld1q_f32(L.x + (m0 + t) * k + i + 4 * j));
      }
    }
    for (int t = 0; t < T; t++) {
      float32x4_t s = acc[t][0];
      for (int j = 1; j < DENSE_CHAINS; j++) s = vaddq_f32(s, acc[t][j]);
      float y = vaddvq_f32(s);
      for (int64_t i = kv; i < k; i++) y += load_as_f32(L.w, WD, base + i) * L.x[(m0 + t) * k + i];
      store_from_f32(L.out, L.out_dtype, (m0 + t) * L.n + n, y);
    }
  }
}
#else
template <int WD, int T>
void dense_rows_t(const DenseLayer& L, int64_t n0, int64_t n1, int64_t m0) {
  for (int64_t n = n0; n < n1; n++)
    for (int t = 0; t < T; t++) {
      float y = 0.f;
      for (int64_t i = 0; i < L.k; i++)
        y += load_as_f32(L.w, WD, n * L.k + i) * L.x[(m0 + t) * L.k + i];
      store_from_f32(L.out, L.out_dtype, (m0 + t) * L.n + n, y);
    }
}
#endif

template <int WD, int T>
void dense_rows_tt(const DenseLayer& L, int64_t n0, int64_t n1, int64_t m0) {
#if defined(TK_X86_AVX512)
  dense_rows_t512<WD, T>(L, n0, n1, m0);
#else
  dense_rows_t<WD, T>(L, n0, n1, m0);
#endif
}

template <int WD>
void dense_rows_w(const DenseLayer& L, int64_t M, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + DENSE_TOKENS <= M; m += DENSE_TOKENS) dense_rows_tt<WD, DENSE_TOKENS>(L, n0, n1, m);
  switch (M - m) {
    case 3: dense_rows_tt<WD, 3>(L, n0, n1, m); break;
    case 2: dense_rows_tt<WD, 2>(L, n0, n1, m); break;
    case 1: dense_rows_tt<WD, 1>(L, n0, n1, m); break;
    default: break;
  }
}

inline void dense_rows(const DenseLayer& L, int64_t M, int64_t n0, int64_t n1) {
  switch (L.w_dtype) {
    case F16: dense_rows_w<F16>(L, M, n0, n1); break;
    case BF16: dense_rows_w<BF16>(L, M, n0, n1); break;
    default: dense_rows_w<F32>(L, M, n0, n1);
  }
}

}  // namespace tk
