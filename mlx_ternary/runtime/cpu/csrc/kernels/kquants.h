// llama.cpp's quantized tables (Q8_0, Q4_K, Q5_K, Q6_K) read as stored: the embedding lookup
// (dequantize gathered rows) and the output layer's matvec. runtime/ggml.py is the reference
// twin and docs/FORMAT.md ("ggml tables") the definition of the block layouts.
//
// Two numerics for the matvec:
//   float   each block dequantized exactly as ggml (and gguf-py) do it, then a float32 dot
//           product with the float activations (8 FMA lanes, summed in lane order at the end)
//   llama   ggml's own: the activations quantized per token (Q8_K per 256 columns for the
//           k-quants, Q8_0 per 32 for Q8_0, the reference quantizers of ggml-quants.c) and the
//           generic integer dot products ggml_vec_dot_{q4_K,q5_K,q6_K}_q8_K /
//           ggml_vec_dot_q8_0_q8_0 reproduced bit for bit: per block 8 int32 lanes (lane l
//           sums the columns c = l mod 8, weighted by the sub-block scales), scaled by
//           d_w * d_x into 8 float lanes; k-quant mins subtracted per block in scalar; the
//           lanes added to the scalar sum, lane 0 first.
//
// KqScalar is the definition; KqAvx2 computes the same integers (and, with FMA on both, the
// same floats) and is checked against it at every load (kq_selfcheck).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../arch/select.h"
#include "layer.h"
#include "q8k.h"

namespace tk {

// The codes of mlx_ternary/format.py GGML_TABLES (the Python side passes them in).
enum GgmlType { GQ8_0 = 0, GQ4_K = 1, GQ5_K = 2, GQ6_K = 3 };

struct GgmlGeom {
  int block = 0, bytes = 0;  // weights and bytes per block
};

inline bool ggml_known(int t) { return t >= GQ8_0 && t <= GQ6_K; }

inline GgmlGeom ggml_geom(int t) {
  switch (t) {
    case GQ8_0: return {32, 34};
    case GQ4_K: return {256, 144};
    case GQ5_K: return {256, 176};
    default: return {256, 210};
  }
}

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// One block, decoded: integer codes, integer sub-block scales (and mins), float d (and dmin).
struct KBlock {
  alignas(32) int8_t q[256];  // Q8_0: q (32); Q4_K 0..15; Q5_K 0..31; Q6_K -32..31
  int32_t sc[16];             // Q4_K/Q5_K: 8 scales (per 32); Q6_K: 16 (per 16)
  int32_t mn[8];              // Q4_K/Q5_K: 8 mins
  float d = 0.f, dmin = 0.f;
};

// The 6-bit (scale, min) pairs of Q4_K / Q5_K (12 bytes).
inline void k4_scales(const uint8_t* s, int32_t* sc, int32_t* mn) {
  for (int j = 0; j < 4; j++) sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63;
  for (int j = 4; j < 8; j++) {
    sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

inline void decode_block(int type, const uint8_t* b, KBlock& k) {
  if (type == GQ8_0) {
    k.d = f16_at(b);
    std::memcpy(k.q, b + 2, 32);
    return;
  }
  if (type == GQ6_K) {  // ql[128], qh[64], scales[16] int8, d
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; h++, ql += 64, qh += 32) {
      int8_t* a = k.q + 128 * h;
      for (int l = 0; l < 32; l++) {
        a[l] = (int8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        a[l + 32] = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        a[l + 64] = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        a[l + 96] = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      }
    }
    for (int j = 0; j < 16; j++) k.sc[j] = (int8_t)b[192 + j];
    k.d = f16_at(b + 208);
    return;
  }
  // Q4_K: d, dmin, scales[12], qs[128]; Q5_K: d, dmin, scales[12], qh[32], qs[128]
  k.d = f16_at(b), k.dmin = f16_at(b + 2);
  k4_scales(b + 4, k.sc, k.mn);
  const uint8_t* qs = b + (type == GQ5_K ? 48 : 16);
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 32; l++) {
      k.q[64 * c + l] = (int8_t)(qs[32 * c + l] & 0xF);
      k.q[64 * c + 32 + l] = (int8_t)(qs[32 * c + l] >> 4);
    }
  if (type == GQ5_K) {
    const uint8_t* qh = b + 16;
    for (int i = 0; i < 256; i++) k.q[i] |= (int8_t)(((qh[i % 32] >> (i / 32)) & 1) << 4);
  }
}

// The block's weights as ggml's dequantize_row_* (and gguf-py) compute them, in float32.
inline void dequantize_block(int type, const KBlock& k, float* out) {
  if (type == GQ8_0) {
    for (int i = 0; i < 32; i++) out[i] = (float)k.q[i] * k.d;
  } else if (type == GQ6_K) {
    for (int j = 0; j < 16; j++) {
      const float dd = k.d * (float)k.sc[j];
      for (int i = 16 * j; i < 16 * j + 16; i++) out[i] = dd * (float)k.q[i];
    }
  } else {
    for (int j = 0; j < 8; j++) {
      const float dd = k.d * (float)k.sc[j], dm = k.dmin * (float)k.mn[j];
      for (int i = 32 * j; i < 32 * j + 32; i++) out[i] = dd * (float)k.q[i] - dm;
    }
  }
}

inline void dequantize_row(int type, const uint8_t* row, int64_t k, float* out) {
  const GgmlGeom g = ggml_geom(type);
  KBlock kb;
  for (int64_t b = 0; b < k / g.block; b++) {
    decode_block(type, row + b * g.bytes, kb);
    dequantize_block(type, kb, out + b * g.block);
  }
}

// ---------------------------------------------------------------------------------------------
// Activations quantized as ggml's reference quantizers do it
// ---------------------------------------------------------------------------------------------

// The byte order the AVX2 k-quant kernel keeps each 32 columns in (codes and activations
// alike), so that pmaddubsw pairs two columns of one lane (c = l mod 8) and its int16
// results come out as (sub-block 2g lane l, sub-block 2g + 1 lane l) for pmaddwd:
// position 16 h + p holds column 4 KQ_DWORD[(16 h + KQ_BYTE[p]) / 4] + KQ_BYTE[p] % 4
// (a dword permute, then a byte shuffle within each 128-bit half).
constexpr int KQ_DWORD[8] = {0, 2, 4, 6, 1, 3, 5, 7};
constexpr int KQ_BYTE[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

inline int kq_source(int pos) {
  const int h = pos / 16, b = KQ_BYTE[pos % 16];
  return 4 * KQ_DWORD[(16 * h + b) / 4] + b % 4;
}

struct KActs {
  std::vector<int8_t> q;     // (M, K)
  std::vector<int8_t> qp;    // (M, K): q with each 32 columns in the kq_source order
  std::vector<float> d;      // (M, nb): Q8_K d, or the float16-rounded Q8_0 d
  std::vector<int32_t> bsum; // (M, K / 16): Q8_K sums of 16 codes (the k-quant mins)
};

// quantize_row_q8_K_ref, with the ternary layers' quantizer (q8k.h q8k_block: one home for
// ggml's Q8_K numerics): codes, d per 256 columns, and the sums of each 16 codes.
inline void quantize_q8k_row(const float* x, int64_t k, int8_t* q, float* d, int32_t* bsum) {
  alignas(32) float buf[Q8K_BLOCK];
  for (int64_t b = 0; b < k / Q8K_BLOCK; b++) {
    std::memcpy(buf, x + Q8K_BLOCK * b, sizeof(buf));
    d[b] = q8k_block(buf, Q8K_BLOCK);
    int8_t* qb = q + Q8K_BLOCK * b;
    for (int i = 0; i < Q8K_BLOCK; i++) qb[i] = (int8_t)buf[i];
    for (int j = 0; j < 16; j++) {
      int32_t s = 0;
      for (int i = 0; i < 16; i++) s += qb[16 * j + i];
      bsum[16 * b + j] = s;
    }
  }
}

// quantize_row_q8_0_ref: d = amax / 127 stored as float16, id = 1 / d, q = roundf(x id).
inline void quantize_q8_0_row(const float* x, int64_t k, int8_t* q, float* d) {
  for (int64_t b = 0; b < k / 32; b++) {
    const float* xb = x + 32 * b;
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(xb[i]));
    const float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
    for (int i = 0; i < 32; i++) q[32 * b + i] = (int8_t)std::round(xb[i] * id);
    d[b] = f16_to_f32(f32_to_f16(db));
  }
}


// ---------------------------------------------------------------------------------------------
// The layer: rows [n0, n1) of y (M, N) = x (M, K) @ W.T
// ---------------------------------------------------------------------------------------------

struct GgmlLayer {
  const uint8_t* w = nullptr;  // (N, row_bytes) blocks as stored
  int type = GQ6_K;
  int64_t n = 0, k = 0;
  const float* x = nullptr;  // (M, K) float32 (float numerics)
  const KActs* acts = nullptr;  // quantized activations (llama numerics)
  float* out = nullptr;         // (M, N) float32
  int64_t row_bytes() const { return k / ggml_geom(type).block * ggml_geom(type).bytes; }
};

constexpr int KQ_TILE = 8;  // tokens sharing one decoded block

template <class O>
void ggml_rows_llama(const GgmlLayer& L, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const GgmlGeom g = ggml_geom(L.type);
  const int64_t nb = L.k / g.block, rb = L.row_bytes();
  const KActs& A = *L.acts;
  KBlock kb;
  for (int64_t n = n0; n < n1; n++) {
    typename O::F8 sums[KQ_TILE];
    float sumf[KQ_TILE];
    const int T = (int)(m1 - m0);
    for (int t = 0; t < T; t++) sums[t] = O::fzero(), sumf[t] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* blk = L.w + n * rb + b * g.bytes;
      __builtin_prefetch(blk + PREFETCH_BYTES);
      decode_block(L.type, blk, kb);
      for (int t = 0; t < T; t++) {
        const int64_t m = m0 + t;
        const int8_t* q8 = A.q.data() + m * L.k + b * g.block;
        const float dx = A.d[m * nb + b];
        if (L.type == GQ8_0) {
          sumf[t] += (float)O::dot32(kb.q, q8) * (kb.d * dx);
          continue;
        }
        typename O::I8 aux = O::izero();
        if (L.type == GQ6_K) {
          for (int j = 0; j < 16; j++) aux = O::template lanes<16>(aux, kb.q + 16 * j, q8 + 16 * j, kb.sc[j]);
        } else {
          for (int j = 0; j < 8; j++) aux = O::template lanes<32>(aux, kb.q + 32 * j, q8 + 32 * j, kb.sc[j]);
        }
        sums[t] = O::scale_add(sums[t], aux, kb.d * dx);
        if (L.type != GQ6_K) {
          const int32_t* bs = A.bsum.data() + m * (L.k / 16) + b * 16;
          int32_t sumi = 0;
          for (int j = 0; j < 16; j++) sumi += bs[j] * kb.mn[j / 2];
          sumf[t] -= (kb.dmin * dx) * (float)sumi;
        }
      }
    }
    for (int t = 0; t < T; t++) {
      float lanes[8], y = sumf[t];
      O::fstore(sums[t], lanes);
      for (int l = 0; l < 8; l++) y += lanes[l];
      L.out[(m0 + t) * L.n + n] = y;
    }
  }
}

template <class O>
void ggml_rows_float(const GgmlLayer& L, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const GgmlGeom g = ggml_geom(L.type);
  const int64_t nb = L.k / g.block, rb = L.row_bytes();
  KBlock kb;
  alignas(32) float wf[256];
  for (int64_t n = n0; n < n1; n++) {
    typename O::F8 acc[KQ_TILE];
    const int T = (int)(m1 - m0);
    for (int t = 0; t < T; t++) acc[t] = O::fzero();
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* blk = L.w + n * rb + b * g.bytes;
      __builtin_prefetch(blk + PREFETCH_BYTES);
      decode_block(L.type, blk, kb);
      dequantize_block(L.type, kb, wf);
      for (int t = 0; t < T; t++)
        acc[t] = O::fdot(acc[t], wf, L.x + (m0 + t) * L.k + b * g.block, g.block);
    }
    for (int t = 0; t < T; t++) {
      float lanes[8], y = 0.f;
      O::fstore(acc[t], lanes);
      for (int l = 0; l < 8; l++) y += lanes[l];
      L.out[(m0 + t) * L.n + n] = y;
    }
  }
}

#if defined(TK_X86)
// The AVX2 llama numerics: the same integer lanes as KqScalar's definition, computed on codes
// decoded straight into the kq_source order (qp) against the permuted activations.
namespace kqx {

inline __m256i permute32(__m256i v) {
  const __m256i dw = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i by = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4,
                                      8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(v, dw), by);
}

inline int32_t pair(int32_t s0, int32_t s1) {
  return (int32_t)(((uint32_t)(uint16_t)(int16_t)s1 << 16) | (uint16_t)(int16_t)s0);
}

// One block -> its codes (in the kq_source order when PERM, else column order), scales,
// mins, d, dmin, and the int16 scale pairs of each 32 columns (PERM only).
template <int TYPE, bool PERM>
inline void decode(const uint8_t* b, KBlock& k, int32_t* pairs) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  auto put = [&](int at, __m256i v) {
    _mm256_store_si256((__m256i*)(k.q + at), PERM ? permute32(v) : v);
  };
  if constexpr (TYPE == GQ6_K) {
    const __m256i m30 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
      const __m256i l0 = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
      const __m256i v[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)),
          _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                          _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30))};
      for (int p = 0; p < 4; p++) put(128 * h + 32 * p, _mm256_sub_epi8(v[p], off));
    }
    const int8_t* sc = (const int8_t*)(b + 192);
    for (int j = 0; j < 16; j++) k.sc[j] = sc[j];
    if (PERM)
      for (int g = 0; g < 8; g++) pairs[g] = pair(sc[2 * g], sc[2 * g + 1]);
    k.d = _cvtsh_ss(*(const uint16_t*)(b + 208));
    return;
  }
  k4_scales(b + 4, k.sc, k.mn);
  if (PERM)
    for (int g = 0; g < 8; g++) pairs[g] = pair(k.sc[g], k.sc[g]);
  k.d = _cvtsh_ss(*(const uint16_t*)b), k.dmin = _cvtsh_ss(*(const uint16_t*)(b + 2));
  const uint8_t* qs = b + (TYPE == GQ5_K ? 48 : 16);
  __m256i hb = _mm256_setzero_si256();
  if constexpr (TYPE == GQ5_K) hb = _mm256_loadu_si256((const __m256i*)(b + 16));
  for (int c = 0; c < 4; c++) {
    const __m256i q = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if constexpr (TYPE == GQ5_K) {
      const __m256i one = _mm256_set1_epi8(1);
      const __m128i s0 = _mm_cvtsi32_si128(2 * c), s1 = _mm_cvtsi32_si128(2 * c + 1);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, s0), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, s1), one), 4));
    }
    put(64 * c, lo);
    put(64 * c + 32, hi);
  }
}

// dequantize_block's float32 numbers from decoded codes: (d * sc) * q [- dmin * m].
template <int TYPE>
inline void dequantize(const KBlock& k, float* out) {
  constexpr int SUB = TYPE == GQ6_K ? 16 : 32;
  for (int j = 0; j < 256 / SUB; j++) {
    const __m256 dd = _mm256_set1_ps(k.d * (float)k.sc[j]);
    const __m256 dm = _mm256_set1_ps(TYPE == GQ6_K ? 0.f : k.dmin * (float)k.mn[j]);
    for (int i = SUB * j; i < SUB * j + SUB; i += 8) {
      __m256 w = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(k.q + i)))));
      if constexpr (TYPE != GQ6_K) w = _mm256_sub_ps(w, dm);
      _mm256_store_ps(out + i, w);
    }
  }
}

template <int TYPE>
void rows_float(const GgmlLayer& L, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t nb = L.k / 256, rb = L.row_bytes();
  KBlock kb;
  alignas(32) float wf[256];
  const int T = (int)(m1 - m0);
  for (int64_t n = n0; n < n1; n++) {
    __m256 acc[KQ_TILE];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* blk = L.w + n * rb + b * ggml_geom(TYPE).bytes;
      __builtin_prefetch(blk + PREFETCH_BYTES);
      decode<TYPE, false>(blk, kb, nullptr);
      dequantize<TYPE>(kb, wf);
      for (int t = 0; t < T; t++)
        acc[t] = KqAvx2::fdot(acc[t], wf, L.x + (m0 + t) * L.k + b * 256, 256);
    }
    for (int t = 0; t < T; t++) {
      float ln[8], y = 0.f;
      _mm256_storeu_ps(ln, acc[t]);
      for (int l = 0; l < 8; l++) y += ln[l];
      L.out[(m0 + t) * L.n + n] = y;
    }
  }
}

// The 8 integer lanes of one block against one token's permuted activations.
template <int TYPE>
inline __m256i lanes(const int8_t* qp, const int32_t* pairs, const int8_t* xp) {
  __m256i acc = _mm256_setzero_si256();
  for (int g = 0; g < 8; g++) {
    const __m256i w = _mm256_load_si256((const __m256i*)(qp + 32 * g));
    const __m256i x = _mm256_loadu_si256((const __m256i*)(xp + 32 * g));
    __m256i p;
    if constexpr (TYPE == GQ6_K)  // |w| <= 32: pairs <= 2 * 32 * 127, no saturation
      p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    else
      p = _mm256_maddubs_epi16(w, x);
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi32(pairs[g])));
  }
  return acc;
}

template <int TYPE>
void rows(const GgmlLayer& L, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const GgmlGeom g = ggml_geom(TYPE);
  const int64_t nb = L.k / 256, rb = L.row_bytes();
  const KActs& A = *L.acts;
  KBlock kb;
  int32_t pairs[8];
  const int T = (int)(m1 - m0);
  for (int64_t n = n0; n < n1; n++) {
    __m256 sums[KQ_TILE];
    float sumf[KQ_TILE];
    for (int t = 0; t < T; t++) sums[t] = _mm256_setzero_ps(), sumf[t] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* blk = L.w + n * rb + b * g.bytes;
      __builtin_prefetch(blk + PREFETCH_BYTES);
      __builtin_prefetch(blk + PREFETCH_BYTES + 64);
      decode<TYPE, true>(blk, kb, pairs);
      const float d = kb.d, dmin = kb.dmin;
      const int32_t* mn = kb.mn;
      const int8_t* qp = kb.q;
      for (int t = 0; t < T; t++) {
        const int64_t m = m0 + t;
        const __m256i aux = lanes<TYPE>(qp, pairs, A.qp.data() + m * L.k + b * 256);
        const float dx = A.d[m * nb + b];
        sums[t] = KqAvx2::scale_add(sums[t], aux, d * dx);
        if constexpr (TYPE != GQ6_K) {
          const int32_t* bs = A.bsum.data() + m * (L.k / 16) + b * 16;
          int32_t sumi = 0;
          for (int j = 0; j < 16; j++) sumi += bs[j] * mn[j / 2];
          sumf[t] -= (dmin * dx) * (float)sumi;
        }
      }
    }
    for (int t = 0; t < T; t++) {
      float ln[8], y = sumf[t];
      _mm256_storeu_ps(ln, sums[t]);
      for (int l = 0; l < 8; l++) y += ln[l];
      L.out[(m0 + t) * L.n + n] = y;
    }
  }
}

// Q8_0 x Q8_0: one integer sum per 32-column block, then ggml's scalar float sum.
inline void rows_q8_0(const GgmlLayer& L, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t nb = L.k / 32, rb = L.row_bytes();
  const KActs& A = *L.acts;
  const int T = (int)(m1 - m0);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; n++) {
    float sumf[KQ_TILE];
    for (int t = 0; t < T; t++) sumf[t] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* blk = L.w + n * rb + b * 34;
      __builtin_prefetch(blk + PREFETCH_BYTES);
      const float d = _cvtsh_ss(*(const uint16_t*)blk);
      const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + 2));
      const __m256i aw = _mm256_sign_epi8(w, w);
      for (int t = 0; t < T; t++) {
        const int64_t m = m0 + t;
        const __m256i x = _mm256_loadu_si256((const __m256i*)(A.q.data() + m * L.k + 32 * b));
        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones);
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 1));
        sumf[t] += (float)_mm_cvtsi128_si32(h) * (d * A.d[m * nb + b]);
      }
    }
    for (int t = 0; t < T; t++) L.out[(m0 + t) * L.n + n] = sumf[t];
  }
}

inline bool rows_float_k(const GgmlLayer& L, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  switch (L.type) {
    case GQ4_K: rows_float<GQ4_K>(L, m0, m1, n0, n1); return true;
    case GQ5_K: rows_float<GQ5_K>(L, m0, m1, n0, n1); return true;
    case GQ6_K: rows_float<GQ6_K>(L, m0, m1, n0, n1); return true;
    default: return false;  // Q8_0: the generic loop (its decode is a copy)
  }
}

inline void rows_llama(const GgmlLayer& L, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  switch (L.type) {
    case GQ8_0: rows_q8_0(L, m0, m1, n0, n1); break;
    case GQ4_K: rows<GQ4_K>(L, m0, m1, n0, n1); break;
    case GQ5_K: rows<GQ5_K>(L, m0, m1, n0, n1); break;
    default: rows<GQ6_K>(L, m0, m1, n0, n1);
  }
}

}  // namespace kqx
#endif

// All M tokens, rows [n0, n1), in tiles of KQ_TILE tokens.
template <class O>
void ggml_rows(const GgmlLayer& L, bool llama, int64_t M, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += KQ_TILE) {
    const int64_t m1 = std::min(M, m0 + KQ_TILE);
#if defined(TK_X86)
    if (llama && std::is_same_v<O, KqAvx2>) {
      kqx::rows_llama(L, m0, m1, n0, n1);
      continue;
    }
    if (!llama && std::is_same_v<O, KqAvx2> && kqx::rows_float_k(L, m0, m1, n0, n1)) continue;
#endif
    if (llama)
      ggml_rows_llama<O>(L, m0, m1, n0, n1);
    else
      ggml_rows_float<O>(L, m0, m1, n0, n1);
  }
}

// Token m of x (float32 (M, K)) quantized for `type`'s dot product into a.
inline void quantize_token_ggml(int type, const float* x, int64_t k, int64_t m, KActs& a) {
  const int64_t nb = k / ggml_geom(type).block;
  if (type == GQ8_0)
    quantize_q8_0_row(x + m * k, k, a.q.data() + m * k, a.d.data() + m * nb);
  else
    quantize_q8k_row(x + m * k, k, a.q.data() + m * k, a.d.data() + m * nb,
                     a.bsum.data() + m * (k / 16));
  const int8_t* q = a.q.data() + m * k;
  int8_t* qp = a.qp.data() + m * k;
  for (int64_t c = 0; c < k; c += 32)
    for (int p = 0; p < 32; p++) qp[c + p] = q[c + kq_source(p)];
}

inline void size_acts(int type, int64_t M, int64_t k, KActs& a) {
  a.q.resize(M * k), a.qp.resize(M * k);
  a.d.resize(M * (k / ggml_geom(type).block)), a.bsum.resize(M * (k / 16));
}

}  // namespace tk
