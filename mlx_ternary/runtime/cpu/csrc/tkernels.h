// The ternary linear layer on the CPU, independent of MLX: y = act_quant(x) @ (s * t).T + b
// for both packed layouts of docs/FORMAT.md, templated on an ISA's inner operations
// (simd_scalar.h defines their contract).
//
// Weights are read in place. A row is a sequence of 32-byte steps (fast: 128 columns of 2-bit
// codes; compact: 32 base-3 bytes = 160 trits of one block); each token's activations are
// stored once per call in the order a decoded step produces its codes, zero where there is no
// column, so every step is NV straight vector dot products. A decoded step stays in registers
// while it is multiplied with T tokens (prefill reuses it T times).
//
// With int8 activations (BitNet: scale = 127 / max|x|, round half to even, clamp) the products
// accumulate in int32 - exact - as sum(c x) - sum(x), c = t + 1. Row and tensor scales then
// give exactly the reference twin's float32 epilogue ((y * s) * x_scale) + bias. Group scales
// are applied in float32 per group; float activations accumulate in float32 (FMA).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace tk {

// The codes of mlx_ternary/format.py PACKING_CODES (the Python side passes them in).
enum Packing { COMPACT = 0, FAST = 1 };
enum DType { F32 = 0, F16 = 1, BF16 = 2 };

// ----------------------------------------------------------------------------------------------
// Half-precision conversions (bit exact, round to nearest even)
// ----------------------------------------------------------------------------------------------

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do { man <<= 1; e++; } while (!(man & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFF;
  if (ax >= 0x7F800000) return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000 ? 0x200 : 0));
  if (ax >= 0x477FF000) return (uint16_t)(sign | 0x7C00);  // rounds to >= 65520: inf
  if (ax < 0x38800000) {                                     // subnormal or zero in f16
    if (ax < 0x33000000) return (uint16_t)sign;
    uint32_t e = ax >> 23, man = (ax & 0x7FFFFF) | 0x800000, shift = 126 - e;
    uint32_t h = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) h++;
    return (uint16_t)(sign | h);
  }
  uint32_t h = ((ax >> 13) - (112 << 10)), rem = ax & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
  return (uint16_t)(sign | h);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((x >> 16) | 0x40);
  return (uint16_t)((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

inline float load_as_f32(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case F16: return f16_to_f32(((const uint16_t*)p)[i]);
    case BF16: return bf16_to_f32(((const uint16_t*)p)[i]);
    default: return ((const float*)p)[i];
  }
}

inline void store_from_f32(void* p, int dtype, int64_t i, float v) {
  switch (dtype) {
    case F16: ((uint16_t*)p)[i] = f32_to_f16(v); break;
    case BF16: ((uint16_t*)p)[i] = f32_to_bf16(v); break;
    default: ((float*)p)[i] = v;
  }
}

// ----------------------------------------------------------------------------------------------
// Geometry: the steps of one packed row
// ----------------------------------------------------------------------------------------------

struct Step {
  int32_t off;     // byte offset in the row
  int16_t valid;   // packed bytes of this step (32 except at a block's or row's end)
  int16_t flush;   // group scales: 1 when a group (or two, lo/hi) ends with this step
  int32_t glo, ghi;  // the groups of bytes 0-15 / 16-31 (-1: past the last group)
  int32_t seg;       // q8k: the segment (q8k.h) that ends with this step, else -1
};

struct Geometry {
  int packing = FAST;
  int64_t n = 0, k = 0;
  int group = 0;          // columns per scale group; 0 for tensor/row scales
  int64_t row_bytes = 0;
  int nv = 4;             // code vectors per step
  int64_t ngroups = 1;
  int64_t block_len = 0, block_bytes = 0, chunks = 0;  // compact
  std::vector<Step> steps;
  std::vector<int64_t> perm;  // activation position -> column (-1: none), see column_of
  // q8k (q8k.h): columns per segment (a 256-column block, or a smaller scale group), the
  // segments and blocks of a row, and whether every step lies inside one segment
  int seg_len = 0;
  int64_t nseg = 0, nblocks8 = 0;
  bool q8k_ok = false;
  bool q8k_tile = false;  // q8k.h rows_q8k_tile applies
  bool q8k_wide = false;  // q8k.h rows_q8k_wide_tile / rows_q8k_r8w apply
  std::vector<int32_t> seg_group, seg_block;  // q8k: per segment, its scale group and block

  int64_t xlen() const { return (int64_t)steps.size() * nv * 32; }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Column of position p of a token's permuted activations, or -1 where there is none.
inline int64_t column_of(const Geometry& g, int64_t p) {
  int64_t per_step = (int64_t)g.nv * 32, s = p / per_step, r = p % per_step;
  int64_t v = r / 32, b = r % 32, col;
  if (g.packing == FAST) {
    col = 128 * s + 4 * b + v;  // byte b of a step holds columns 4b..4b+3 at bits 0,2,4,6
  } else {
    int64_t blk = s / g.chunks, c = s % g.chunks, local = 5 * (32 * c + b) + v;
    if (local >= g.block_len) return -1;
    col = blk * g.block_len + local;  // byte holds 5 trits, first most significant
  }
  return col < g.k ? col : -1;
}

inline void plan_q8k(Geometry& g);  // q8k.h

inline Geometry make_geometry(int packing, int64_t n, int64_t k, int group) {
  Geometry g;
  g.packing = packing;
  g.n = n;
  g.k = k;
  g.group = group;
  g.ngroups = group ? ceil_div(k, group) : 1;
  if (packing == FAST) {
    g.nv = 4;
    g.row_bytes = ceil_div(k, 32) * 32 / 4;
    int64_t nsteps = ceil_div(g.row_bytes, 32);
    for (int64_t j = 0; j < nsteps; j++) {
      Step s{};
      s.off = (int32_t)(32 * j);
      s.valid = (int16_t)std::min<int64_t>(32, g.row_bytes - 32 * j);
      if (group == 64) {
        s.flush = 1, s.glo = (int32_t)(2 * j), s.ghi = (int32_t)(2 * j + 1);
      } else if (group == 128) {
        s.flush = 1, s.glo = s.ghi = (int32_t)j;
      } else if (group == 256) {
        s.flush = (j % 2 == 1 || j == nsteps - 1), s.glo = s.ghi = (int32_t)(j / 2);
      }
      g.steps.push_back(s);
    }
  } else {
    g.nv = 5;
    g.block_len = group ? group : k;
    int64_t nblocks = ceil_div(k, g.block_len);
    g.block_bytes = ceil_div(g.block_len, 5);
    g.chunks = ceil_div(g.block_bytes, 32);
    g.row_bytes = ceil_div(nblocks * g.block_bytes, 4) * 4;
    for (int64_t b = 0; b < nblocks; b++)
      for (int64_t c = 0; c < g.chunks; c++) {
        Step s{};
        s.off = (int32_t)(b * g.block_bytes + 32 * c);
        s.valid = (int16_t)std::min<int64_t>(32, g.block_bytes - 32 * c);
        if (group) s.flush = (c == g.chunks - 1), s.glo = s.ghi = (int32_t)b;
        g.steps.push_back(s);
      }
  }
  for (auto& s : g.steps) {
    if (s.glo >= g.ngroups) s.glo = -1;
    if (s.ghi >= g.ngroups) s.ghi = -1;
  }
  g.perm.resize(g.xlen());
  for (int64_t p = 0; p < g.xlen(); p++) g.perm[p] = column_of(g, p);
  plan_q8k(g);
  return g;
}

// ----------------------------------------------------------------------------------------------
// Activations: permuted, int8-quantized or float, once per call
// ----------------------------------------------------------------------------------------------

struct Acts {
  std::vector<int8_t> q;       // (M, xlen) int8
  std::vector<float> f;        // (M, xlen) float
  std::vector<float> xs;       // (M) 1 / scale
  std::vector<int32_t> gsum;   // (M, ngroups) sum of q per group (tensor/row: ngroups = 1)
  std::vector<float> d8;       // q8k: (M, nblocks8) ggml's Q8_K block scales d
  std::vector<int32_t> ssum;   // q8k: (M, nseg) sum of q per segment
};

// Token m of x (row-major (M, K), dtype) -> int8 codes at acts.q[m], as reference.py does it
// in float32: amax = max(max|x|, 1e-5); scale = 127 / amax; q = clamp(round(x * scale)).
inline void quantize_token(const Geometry& g, const void* x, int dtype, int64_t m, Acts& a,
                           float* tmp) {
  const int64_t k = g.k;
  for (int64_t i = 0; i < k; i++) tmp[i] = load_as_f32(x, dtype, m * k + i);
  float amax = 0.f;
  for (int64_t i = 0; i < k; i++) amax = std::max(amax, std::fabs(tmp[i]));
  amax = std::max(amax, 1e-5f);
  const float scale = 127.f / amax;
  a.xs[m] = 1.f / scale;
  for (int64_t i = 0; i < k; i++)
    tmp[i] = std::min(127.f, std::max(-128.f, std::nearbyint(tmp[i] * scale)));
  int8_t* q = a.q.data() + m * g.xlen();
  int32_t* gs = a.gsum.data() + m * g.ngroups;
  for (int64_t j = 0; j < g.ngroups; j++) gs[j] = 0;
  for (int64_t p = 0; p < g.xlen(); p++) {
    int64_t c = g.perm[p];
    q[p] = c < 0 ? 0 : (int8_t)tmp[c];
  }
  for (int64_t i = 0; i < k; i++) gs[g.group ? i / g.group : 0] += (int32_t)tmp[i];
}

inline void permute_token(const Geometry& g, const void* x, int dtype, int64_t m, Acts& a) {
  float* f = a.f.data() + m * g.xlen();
  for (int64_t p = 0; p < g.xlen(); p++) {
    int64_t c = g.perm[p];
    f[p] = c < 0 ? 0.f : load_as_f32(x, dtype, m * g.k + c);
  }
}

// ----------------------------------------------------------------------------------------------
// Rows
// ----------------------------------------------------------------------------------------------

struct Layer {
  explicit Layer(const Geometry& geometry) : g(geometry) {}
  const Geometry& g;
  const uint8_t* w = nullptr;  // (N, row_bytes) packed
  const void* scales = nullptr;
  int scale_dtype = F32;
  int scale_kind = 0;          // 0 tensor, 1 row, 2 group
  const void* bias = nullptr;  // (N) or null
  int bias_dtype = F32;
  bool act_quant = false;      // int8 activations: BitNet's per token, or q8k's
  bool q8k = false;            // llama.cpp's Q8_K blocks (q8k.h)
  void* out = nullptr;         // (M, N)
  int out_dtype = F32;

  float scale(int64_t n, int64_t gi) const {
    if (scale_kind == 0) return load_as_f32(scales, scale_dtype, 0);
    if (scale_kind == 1) return load_as_f32(scales, scale_dtype, n);
    return gi < 0 ? 0.f : load_as_f32(scales, scale_dtype, n * g.ngroups + gi);
  }
  float bias_at(int64_t n) const { return bias ? load_as_f32(bias, bias_dtype, n) : 0.f; }
};

// Weights stream from memory once per call; a software prefetch this far ahead (rows are
// contiguous, so it runs into the next rows) measured 25-35 % faster cold matvecs than the
// hardware prefetchers alone on an AMD EPYC (Zen 3).
constexpr int PREFETCH_BYTES = 4096;

template <class O, int NV>
inline void decode_step(const uint8_t* p, int valid, typename O::V* c) {
  typename O::V w = valid == 32 ? O::load(p) : O::load_tail(p, valid);
  if constexpr (NV == 4) O::fast4(w, c); else O::base3(w, c);
}

// Rows [n0, n1) for tokens m0 .. m0 + T - 1, int8 activations.
template <class O, int NV, bool GROUPED, int T>
void rows_int(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0) {
  const Geometry& g = L.g;
  const int64_t xlen = g.xlen(), nsteps = (int64_t)g.steps.size();
  const int8_t* xb[T];
  for (int t = 0; t < T; t++) xb[t] = a.q.data() + (m0 + t) * xlen;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* w = L.w + n * g.row_bytes;
    typename O::IA acc[T];
    typename O::FV f[T];
    for (int t = 0; t < T; t++) acc[t] = O::izero(), f[t] = O::fvzero();
    for (int64_t s = 0; s < nsteps; s++) {
      const Step& st = g.steps[s];
      __builtin_prefetch(w + st.off + PREFETCH_BYTES);
      typename O::V c[NV];
      decode_step<O, NV>(w + st.off, st.valid, c);
      for (int t = 0; t < T; t++) O::template idot<NV>(acc[t], c, xb[t] + s * NV * 32);
      if constexpr (GROUPED) {
        if (st.flush) {
          float lo = L.scale(n, st.glo), hi = L.scale(n, st.ghi);
          for (int t = 0; t < T; t++) O::iflush(acc[t], f[t], lo, hi);
        }
      }
    }
    const float b = L.bias_at(n);
    for (int t = 0; t < T; t++) {
      const int64_t m = m0 + t;
      const int32_t* gs = a.gsum.data() + m * g.ngroups;
      float y;
      if constexpr (GROUPED) {
        float corr = 0.f;
        for (int64_t j = 0; j < g.ngroups; j++) corr += L.scale(n, j) * (float)gs[j];
        y = (O::fvsum(f[t]) - corr) * a.xs[m];
      } else {
        y = ((float)(O::isum(acc[t]) - gs[0]) * L.scale(n, 0)) * a.xs[m];
      }
      store_from_f32(L.out, L.out_dtype, m * g.n + n, y + b);
    }
  }
}

// Rows [n0, n1) for tokens m0 .. m0 + T - 1, float activations. Each code vector is expanded
// to floats once and used for all T tokens; NC accumulation chains per token hide the FMA
// latency (chains [0, NC/2) take bytes 0-15 of each vector, the rest bytes 16-31).
template <class O, int NV, bool GROUPED, int T>
void rows_float(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0) {
  using F8 = typename O::F8;
  constexpr int NC = T == 1 ? 4 : 2;
  const Geometry& g = L.g;
  const int64_t xlen = g.xlen(), nsteps = (int64_t)g.steps.size();
  const float* xb[T];
  for (int t = 0; t < T; t++) xb[t] = a.f.data() + (m0 + t) * xlen;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* w = L.w + n * g.row_bytes;
    F8 acc[T][NC], f[T];
    for (int t = 0; t < T; t++) {
      f[t] = O::f8zero();
      for (int c = 0; c < NC; c++) acc[t][c] = O::f8zero();
    }
    for (int64_t s = 0; s < nsteps; s++) {
      const Step& st = g.steps[s];
      __builtin_prefetch(w + st.off + PREFETCH_BYTES);
      typename O::V c[NV];
      decode_step<O, NV>(w + st.off, st.valid, c);
      for (int v = 0; v < NV; v++) {
        F8 wf[4];
        O::fexpand(c[v], wf);
        const int64_t off = s * NV * 32 + 32 * v;
        for (int j = 0; j < 4; j++)
          for (int t = 0; t < T; t++) {
            F8& r = acc[t][NC == 4 ? j : j / 2];
            r = O::fma8(r, wf[j], xb[t] + off + 8 * j);
          }
      }
      if constexpr (GROUPED) {
        if (st.flush) {
          float lo = L.scale(n, st.glo), hi = L.scale(n, st.ghi);
          for (int t = 0; t < T; t++) {
            F8 l = acc[t][0], h = acc[t][NC / 2];
            if constexpr (NC == 4) l = O::f8add(l, acc[t][1]), h = O::f8add(h, acc[t][3]);
            f[t] = O::f8fmas(O::f8fmas(f[t], l, lo), h, hi);
            for (int c = 0; c < NC; c++) acc[t][c] = O::f8zero();
          }
        }
      }
    }
    const float b = L.bias_at(n);
    for (int t = 0; t < T; t++) {
      float y;
      if constexpr (GROUPED) {
        y = O::f8sum(f[t]);
      } else {
        F8 sum = acc[t][0];
        for (int c = 1; c < NC; c++) sum = O::f8add(sum, acc[t][c]);
        y = O::f8sum(sum) * L.scale(n, 0);
      }
      store_from_f32(L.out, L.out_dtype, (m0 + t) * g.n + n, y + b);
    }
  }
}

// Float activations, many tokens: each block of 16 rows is expanded once to float weights
// (t, or s * t with group scales), stored column-major (16 rows per column, in the
// activations' permuted column order), and multiplied with the tokens by a register-blocked
// outer-product kernel: per column, two 8-row weight vectors times T broadcast activations
// into 2 x T accumulators (an SGEMM micro-kernel; FMA-bound, everything streams from L1/L2).
constexpr int GEMM_ROWS = 16, GEMM_TOKENS = 6;

template <class O, int T, bool GROUPED>
void float_panel(const Layer& L, const Acts& a, const float* wt, int64_t n, int rows, int64_t m0) {
  using F8 = typename O::F8;
  const int64_t xlen = L.g.xlen();
  F8 acc[T][2];
  for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = O::f8zero();
  const float* x = a.f.data() + m0 * xlen;
  for (int64_t k = 0; k < xlen; k++) {
    F8 w0 = O::f8load(wt + k * GEMM_ROWS), w1 = O::f8load(wt + k * GEMM_ROWS + 8);
    for (int t = 0; t < T; t++) {
      F8 xb = O::f8set(x[t * xlen + k]);
      acc[t][0] = O::f8fma(acc[t][0], w0, xb);
      acc[t][1] = O::f8fma(acc[t][1], w1, xb);
    }
  }
  float y[GEMM_ROWS];
  for (int t = 0; t < T; t++) {
    O::f8store(y, acc[t][0]);
    O::f8store(y + 8, acc[t][1]);
    for (int r = 0; r < rows; r++) {
      float v = y[r];
      if constexpr (!GROUPED) v *= L.scale(n + r, 0);
      store_from_f32(L.out, L.out_dtype, (m0 + t) * L.g.n + n + r, v + L.bias_at(n + r));
    }
  }
}

template <class O, int NV, bool GROUPED>
void rows_float_gemm(const Layer& L, const Acts& a, int64_t M, int64_t n0, int64_t n1) {
  using F8 = typename O::F8;
  const Geometry& g = L.g;
  const int64_t xlen = g.xlen(), nsteps = (int64_t)g.steps.size();
  thread_local std::vector<float> wt, rows_buf;  // this thread's panel (xlen x 16), its rows
  wt.resize(xlen * GEMM_ROWS);
  rows_buf.resize(xlen * GEMM_ROWS);
  for (int64_t r0 = n0; r0 < n1; r0 += GEMM_ROWS) {
    const int rows = (int)std::min<int64_t>(GEMM_ROWS, n1 - r0);
    for (int r = 0; r < GEMM_ROWS; r++) {
      float* row = rows_buf.data() + r * xlen;
      if (r >= rows) {
        std::fill(row, row + xlen, 0.f);
        continue;
      }
      const int64_t n = r0 + r;
      const uint8_t* w = L.w + n * g.row_bytes;
      for (int64_t s = 0; s < nsteps; s++) {
        const Step& st = g.steps[s];
        typename O::V c[NV];
        decode_step<O, NV>(w + st.off, st.valid, c);
        float lo = 1.f, hi = 1.f;
        if constexpr (GROUPED) lo = L.scale(n, st.glo), hi = L.scale(n, st.ghi);
        for (int v = 0; v < NV; v++) {
          F8 wf[4];
          O::fexpand(c[v], wf);
          float* o = row + s * NV * 32 + 32 * v;
          for (int j = 0; j < 4; j++)
            O::f8store(o + 8 * j, GROUPED ? O::f8mul(wf[j], j < 2 ? lo : hi) : wf[j]);
        }
      }
    }
    // Transpose 16 x xlen -> xlen x 16 in blocks of 8 columns (their 8 lines stay in L1).
    for (int64_t k0 = 0; k0 < xlen; k0 += 8)
      for (int r = 0; r < GEMM_ROWS; r++)
        for (int j = 0; j < 8; j++) wt[(k0 + j) * GEMM_ROWS + r] = rows_buf[r * xlen + k0 + j];
    int64_t m = 0;
    for (; m + GEMM_TOKENS <= M; m += GEMM_TOKENS)
      float_panel<O, GEMM_TOKENS, GROUPED>(L, a, wt.data(), r0, rows, m);
    switch (M - m) {
      case 5: float_panel<O, 5, GROUPED>(L, a, wt.data(), r0, rows, m); break;
      case 4: float_panel<O, 4, GROUPED>(L, a, wt.data(), r0, rows, m); break;
      case 3: float_panel<O, 3, GROUPED>(L, a, wt.data(), r0, rows, m); break;
      case 2: float_panel<O, 2, GROUPED>(L, a, wt.data(), r0, rows, m); break;
      case 1: float_panel<O, 1, GROUPED>(L, a, wt.data(), r0, rows, m); break;
      default: break;
    }
  }
}

}  // namespace tk

#include "q8k.h"

namespace tk {

// Tokens per tile of the row kernels: a decoded step is reused this many times. Compact steps
// cost more to decode, so they are shared by more tokens.
constexpr int TOKEN_TILE = 4;
constexpr int COMPACT_INT_TILE = 8;
// From this many tokens on, float activations go through rows_float_gemm (its expansion and
// transpose of the weights pay off over the tokens).
constexpr int64_t FLOAT_GEMM_MIN_TOKENS = 24;


// All tokens for rows [n0, n1): token tiles, then the remainder.
template <class O, int NV, bool GROUPED>
void rows_all(const Layer& L, const Acts& a, int64_t M, int64_t n0, int64_t n1) {
  if (!L.act_quant && M >= FLOAT_GEMM_MIN_TOKENS) return rows_float_gemm<O, NV, GROUPED>(L, a, M, n0, n1);
  if constexpr (NV == 4 && HasQ8kTile<O>::value)
    if (L.q8k && L.g.q8k_tile) {
      if (M >= Q8K_TILE_TOKENS) return rows_q8k_tiled<O>(L, a, M, n0, n1);
      return rows_q8k_few<O>(L, a, n0, n1, 0, M);
    }
  int64_t m = 0;
  auto run = [&](auto tile) {
    constexpr int T = decltype(tile)::value;
    if (L.q8k) rows_q8k<O, NV, T>(L, a, n0, n1, m);
    else if (L.act_quant) rows_int<O, NV, GROUPED, T>(L, a, n0, n1, m);
    else rows_float<O, NV, GROUPED, T>(L, a, n0, n1, m);
    m += T;
  };
  if (NV == 5 && L.act_quant)
    for (; m + COMPACT_INT_TILE <= M;) {
      if (L.q8k) rows_q8k<O, NV, COMPACT_INT_TILE>(L, a, n0, n1, m);
      else rows_int<O, NV, GROUPED, COMPACT_INT_TILE>(L, a, n0, n1, m);
      m += COMPACT_INT_TILE;
    }
  for (; m + TOKEN_TILE <= M;) run(std::integral_constant<int, TOKEN_TILE>{});
  switch (M - m) {
    case 3: run(std::integral_constant<int, 3>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 1: run(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

template <class O>
void rows_dispatch(const Layer& L, const Acts& a, int64_t M, int64_t n0, int64_t n1) {
  const bool grouped = L.scale_kind == 2;
  if (L.g.packing == FAST) {
    if (grouped) rows_all<O, 4, true>(L, a, M, n0, n1);
    else rows_all<O, 4, false>(L, a, M, n0, n1);
  } else {
    if (grouped) rows_all<O, 5, true>(L, a, M, n0, n1);
    else rows_all<O, 5, false>(L, a, M, n0, n1);
  }
}

// ----------------------------------------------------------------------------------------------
// Dequantized rows (the backward pass): W[n] = s * t as float32
// ----------------------------------------------------------------------------------------------

inline void dequantize_rows(const Layer& L, float* out, int64_t n0, int64_t n1) {
  const Geometry& g = L.g;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* w = L.w + n * g.row_bytes;
    float* o = out + n * g.k;
    for (int64_t col = 0; col < g.k; col++) {
      int t;
      if (g.packing == FAST) {
        t = (int)((w[col / 4] >> (2 * (col % 4))) & 3) - 1;
      } else {
        int64_t blk = col / g.block_len, local = col % g.block_len;
        uint32_t q = w[blk * g.block_bytes + local / 5];
        for (int i = 0; i < local % 5; i++) q = (q * 3) & 0xFF;
        t = (int)((q * 3) >> 8) - 1;
      }
      o[col] = (float)t * L.scale(n, g.group ? col / g.group : 0);
    }
  }
}

}  // namespace tk
