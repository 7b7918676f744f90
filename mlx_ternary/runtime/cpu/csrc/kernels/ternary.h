// The ternary linear layer on the CPU, independent of MLX: y = act_quant(x) @ (s * t).T + b
// for both packed layouts of docs/FORMAT.md, templated on an ISA's inner operations
// (arch/scalar.h defines their contract).
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
#include <cstdint>
#include <type_traits>
#include <vector>

#include "layer.h"
#include "q8k.h"

namespace tk {

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


// Tokens per tile of the row kernels: a decoded step is reused this many times. Compact steps
// cost more to decode, so they are shared by more tokens.
constexpr int TOKEN_TILE = 4;
constexpr int COMPACT_INT_TILE = 8;
// From this many tokens on, float activations go through rows_float_gemm (its expansion and
// transpose of the weights pay off over the tokens).
constexpr int64_t FLOAT_GEMM_MIN_TOKENS = 24;


// Per-token int8 activations, decode (1 - Int8R8Tokens tokens, below; fast packing, tensor or row
// scales; ISAs with HasInt8R8, below): one token against 8 rows at a time through the q8k
// blocks' loop (kernels/q8k.h rows_r8, Int8Rows8 below) - an accumulator per row, each activation vector
// loaded once for the 8 rows, the 8 sums reduced into one vector (lane = row) every
// INT8_R8_STEPS steps (before int16 lanes could overflow without VNNI) and added up in int32,
// then rows_int's epilogue ((float)(sum - gsum) * s) * x_scale for 8 rows at once: each row's
// bits are rows_int's. The last n % 8 rows go through rows_int.
constexpr int INT8_R8_TOKENS = 3;
constexpr int INT8_R8_STEPS = Q8K_TILE_I16_TERMS / 4;  // 4 code vectors a step

// Tokens up to which the blocks run: INT8_R8_TOKENS, or an ISA's int8_r8_tokens (VNNI:
// 16, a whole decode batch; one vpdpbusd a code vector makes the blocks 1.2-1.4x the
// 4-token tiles of rows_int at 4-16 tokens, where AVX2's pairs measured 0.9-1.0x).
template <class O, class = void>
struct Int8R8Tokens : std::integral_constant<int, INT8_R8_TOKENS> {};
template <class O>
struct Int8R8Tokens<O, std::void_t<decltype(O::int8_r8_tokens)>>
    : std::integral_constant<int, O::int8_r8_tokens> {};

// Whether an ISA has the 8-row per-token int8 block's pieces (the int32 lane add and the
// float32 epilogue of 8 rows): x86 and NEON.
template <class O, class = void>
struct HasInt8R8 : std::false_type {};
template <class O>
struct HasInt8R8<O, std::void_t<decltype(&O::int8_rows), decltype(&O::tadd)>> : std::true_type {};

// Per-token int8's epilogue of the 8-row blocks (q8k.h rows_r8): the sums of the 8 rows
// widened into int32 lanes every INT8_R8_STEPS steps and at the row's end, then
// ((float)(sum - gsum) * s) * x_scale; the tail rows through rows_int.
template <class O>
struct Int8Rows8 {
  using Token = typename O::IA;  // int32, lane = row (tsum8's lanes)
  static void block(const Layer& L, int64_t n, float* s8) { row_scales8(L, n, 0, s8); }
  static Token token(const Layer&, const Acts&, int64_t) { return O::izero(); }
  static void step(const Layer& L, const Acts&, Token& sumi, const Step&, int64_t s,
                   typename O::TA* acc, int64_t, const float*) {
    if ((s + 1) % INT8_R8_STEPS == 0 || s + 1 == (int64_t)L.g.steps.size())
      sumi = O::tadd(sumi, O::tsum8(acc));
  }
  static typename O::FV result(const Layer& L, const Acts& a, const Token& sumi, int64_t m,
                               const float* s8) {
    return O::int8_rows(sumi, a.gsum[m * L.g.ngroups], s8, a.xs[m]);
  }
  static void tail(const Layer& L, const Acts& a, int64_t n, int64_t n1, int64_t m) {
    rows_int<O, 4, false, 1>(L, a, n, n1, m);
  }
};

template <class O>
void rows_int8_r8(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  rows_r8<O, Int8Rows8<O>>(L, a, n0, n1, m0, m1);
}

// All tokens for rows [n0, n1): token tiles, then the remainder.
template <class O, int NV, bool GROUPED>
void rows_all(const Layer& L, const Acts& a, int64_t M, int64_t n0, int64_t n1) {
  if (!L.act_quant && M >= FLOAT_GEMM_MIN_TOKENS) return rows_float_gemm<O, NV, GROUPED>(L, a, M, n0, n1);
  if constexpr (NV == 4 && HasQ8kPanel<O>::value)
    if (q8k_panels_apply<O>(L.g, L.q8k, M)) return rows_q8k_panels<O>(L, a, M, n0, n1);
  if constexpr (NV == 4 && HasQ8kTile<O>::value)
    if (L.q8k && L.g.q8k_tile) {
      if (M >= Q8K_TILE_TOKENS) return rows_q8k_tiled<O>(L, a, M, n0, n1);
      return rows_q8k_few<O>(L, a, n0, n1, 0, M);
    }
  if constexpr (NV == 4 && !GROUPED && HasMmla<O>::value)
    if (L.act_quant && !L.q8k && M >= Q8K_TILE_TOKENS) return O::int8_mmla_rows(L, a, M, n0, n1);
  if constexpr (NV == 4 && !GROUPED && HasInt8R8<O>::value)
    if (L.act_quant && !L.q8k && M <= Int8R8Tokens<O>::value) return rows_int8_r8<O>(L, a, n0, n1, 0, M);
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
