// llama.cpp's quantized tables as stored (Q8_0, Q4_K, Q5_K, Q6_K): the block layouts, their
// decoding, the activations' kq_source order and the bound layer - what kernels/kquants.h and
// arch/x86.h's vector rows share. MLX-free and ISA-free. docs/FORMAT.md ("ggml tables") is
// the definition of the layouts, runtime/ggml.py the reference twin.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "layer.h"

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

}  // namespace tk
