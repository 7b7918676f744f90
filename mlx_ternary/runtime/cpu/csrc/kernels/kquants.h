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
#include "ggml_blocks.h"
#include "layer.h"
#include "q8k.h"

namespace tk {

// quantize_row_q8_K_ref, with the ternary layers' quantizer (q8k.h q8k_block: one home for
// ggml's Q8_K numerics): codes, d per 256 columns, and the sums of each 16 codes.
inline void quantize_q8k_row(const float* x, int64_t k, int8_t* q, float* d, int32_t* bsum) {
  alignas(32) float buf[Q8K_BLOCK];
  for (int64_t b = 0; b < k / Q8K_BLOCK; b++) {
    int8_t* qb = q + Q8K_BLOCK * b;
    d[b] = q8k_block_codes(x + Q8K_BLOCK * b, Q8K_BLOCK, qb, buf);
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

// All M tokens, rows [n0, n1), in tiles of KQ_TILE tokens.
template <class O>
void ggml_rows(const GgmlLayer& L, bool llama, int64_t M, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += KQ_TILE) {
    const int64_t m1 = std::min(M, m0 + KQ_TILE);
    if constexpr (std::is_same_v<O, KqNative>)  // the ISA's own rows, where it has them
      if (native::ggml_tile(L, llama, m0, m1, n0, n1)) continue;
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
