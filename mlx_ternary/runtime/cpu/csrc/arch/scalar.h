// Portable ternary inner operations: the definition every SIMD path is checked against
// (selftest.cpp and the extension's load-time self-check) and the path on CPUs without one.
//
// A "step" is 32 packed bytes. Decoding gives NV vectors of 32 unsigned codes c = t + 1 in
// {0, 1, 2}: 4 vectors for the fast packing (the 2-bit fields at bits 0, 2, 4, 6 of each byte),
// 5 for compact (base-3 digits 0..4 of each byte). Activations are stored permuted to match
// (kernels/layer.h), so code byte b of vector v multiplies activation x[32 v + b] of the step.
// Integer accumulators keep 8 int32 lanes, lane j summing bytes 4j..4j+3 of every vector:
// lanes 0-3 cover bytes 0-15 ("lo"), lanes 4-7 bytes 16-31 ("hi"), which is how a step of
// the fast packing holds two groups of 64 columns.
//
// KqScalar is the same for llama.cpp's quantized tables (kernels/kquants.h): the portable
// definition of their inner operations that arch/x86.h's KqAvx2 must match bit for bit.
#pragma once

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "../kernels/layer.h"  // dtypes, their conversions, PREFETCH_BYTES

namespace tk {

struct ScalarOps {
  static constexpr const char* name = "scalar";
  struct V { uint8_t b[32]; };
  struct IA { int32_t l[8]; };   // int32 lanes, lane j <- bytes 4j..4j+3
  struct FV { float l[8]; };     // float lanes for group-scaled sums, same lane map

  static V load(const uint8_t* p) { V v; std::memcpy(v.b, p, 32); return v; }
  static V load_tail(const uint8_t* p, int n) {
    V v{};
    std::memcpy(v.b, p, n);
    return v;
  }
  static void fast4(const V& w, V c[4]) {
    for (int s = 0; s < 4; s++)
      for (int b = 0; b < 32; b++) c[s].b[b] = (w.b[b] >> (2 * s)) & 3;
  }
  static void base3(const V& w, V c[5]) {
    for (int b = 0; b < 32; b++) {
      uint32_t q = w.b[b];
      for (int i = 0; i < 5; i++) {
        c[i].b[b] = (uint8_t)(((q & 0xFF) * 3) >> 8);
        q *= 3;
      }
    }
  }

  static IA izero() { return IA{}; }
  template <int NV>
  static void idot(IA& a, const V* c, const int8_t* x) {
    for (int v = 0; v < NV; v++)
      for (int b = 0; b < 32; b++) a.l[b >> 2] += (int32_t)c[v].b[b] * x[32 * v + b];
  }
  static int32_t isum(const IA& a) {
    int32_t s = 0;
    for (int j = 0; j < 8; j++) s += a.l[j];
    return s;
  }
  static FV fvzero() { return FV{}; }
  static void iflush(IA& a, FV& f, float lo, float hi) {
    for (int j = 0; j < 8; j++) {
      f.l[j] += (float)a.l[j] * (j < 4 ? lo : hi);
      a.l[j] = 0;
    }
  }
  static float fvsum(const FV& f) {
    float s = 0;
    for (int j = 0; j < 8; j++) s += f.l[j];
    return s;
  }

  // float path: F8 = 8 float lanes; f8regs: how many F8 the register file holds (the
  // attention's register blocking, kernels/attention.h)
  struct F8 { float l[8]; };
  static constexpr int f8regs = 16;
  static F8 f8zero() { return F8{}; }
  static F8 f8add(F8 a, const F8& b) {
    for (int j = 0; j < 8; j++) a.l[j] += b.l[j];
    return a;
  }
  static F8 f8fmas(F8 acc, const F8& a, float s) {
    for (int j = 0; j < 8; j++) acc.l[j] += a.l[j] * s;
    return acc;
  }
  static float f8sum(const F8& a) {
    float s = 0;
    for (int j = 0; j < 8; j++) s += a.l[j];
    return s;
  }
  static F8 f8load(const float* p) {
    F8 v;
    for (int j = 0; j < 8; j++) v.l[j] = p[j];
    return v;
  }
  // f8load into a register the FMAs using it share (a plain load here; arch/x86.h keeps GCC
  // from folding it into every FMA)
  static F8 f8loadr(const float* p) { return f8load(p); }
  static F8 f8loadh(const uint16_t* p) {  // 8 float16 values (bits) as floats
    F8 v;
    for (int j = 0; j < 8; j++) v.l[j] = f16_to_f32(p[j]);
    return v;
  }
  static void f8store(float* p, const F8& v) {
    for (int j = 0; j < 8; j++) p[j] = v.l[j];
  }
  static F8 f8mul(F8 a, float s) {
    for (int j = 0; j < 8; j++) a.l[j] *= s;
    return a;
  }
  static F8 f8fma(F8 acc, const F8& w, const F8& x) {
    for (int j = 0; j < 8; j++) acc.l[j] += w.l[j] * x.l[j];
    return acc;
  }
  static F8 f8set(float v) {
    F8 r;
    for (int j = 0; j < 8; j++) r.l[j] = v;
    return r;
  }
  static F8 fma8(F8 acc, const F8& w, const float* x) {
    for (int j = 0; j < 8; j++) acc.l[j] += w.l[j] * x[j];
    return acc;
  }
  static F8 f8max(F8 a, const F8& b) {
    for (int j = 0; j < 8; j++) a.l[j] = std::max(a.l[j], b.l[j]);
    return a;
  }
  static float f8hmax(const F8& a) {
    float m = a.l[0];
    for (int j = 1; j < 8; j++) m = std::max(m, a.l[j]);
    return m;
  }
  // lane u = the sum of a[u]'s lanes
  static F8 f8tsum(const F8 a[8]) {
    F8 r;
    for (int u = 0; u < 8; u++) r.l[u] = f8sum(a[u]);
    return r;
  }
  static void fexpand(const V& c, F8 w[4]) {
    for (int b = 0; b < 32; b++) w[b / 8].l[b % 8] = (float)((int)c.b[b] - 1);
  }
};

// llama.cpp tables (kernels/kquants.h): lanes of int32 and float32, 8 each
struct KqScalar {
  static constexpr const char* name = "scalar";
  struct I8 { int32_t l[8]; };
  struct F8 { float l[8]; };
  static I8 izero() { return I8{}; }
  // lane c mod 8 += s * a[c] q[c] over n (16 or 32) columns
  template <int N>
  static I8 lanes(I8 acc, const int8_t* a, const int8_t* q, int32_t s) {
    for (int i = 0; i < N; i++) acc.l[i & 7] += s * (int32_t)(int16_t)(a[i] * q[i]);
    return acc;
  }
  static int32_t dot32(const int8_t* a, const int8_t* q) {
    int32_t s = 0;
    for (int i = 0; i < 32; i++) s += (int32_t)a[i] * q[i];
    return s;
  }
  // sums[l] += d * float(aux[l]) (a product, then a sum: no FMA, as ggml's C)
  static F8 scale_add(F8 sums, I8 aux, float d) {
    for (int l = 0; l < 8; l++) sums.l[l] += d * (float)aux.l[l];
    return sums;
  }
  static F8 fzero() { return F8{}; }
  // 8 float lanes: acc[i mod 8] = fma(w[i], x[i], acc) over n (a multiple of 8) columns
  static F8 fdot(F8 acc, const float* w, const float* x, int n) {
    for (int i = 0; i < n; i++) acc.l[i & 7] = std::fma(w[i], x[i], acc.l[i & 7]);
    return acc;
  }
  static void fstore(F8 v, float* out) { std::memcpy(out, v.l, 32); }
};

// ---------------------------------------------------------------------------------------------
// The kernels' vector pieces, portable: each "head" does the whole vectors of a loop and returns
// where the caller's scalar tail starts, so here it does nothing. arch/x86.h and arch/neon.h
// define the same names in their namespaces; arch/select.h aliases one as tk::native.
// ---------------------------------------------------------------------------------------------

// exp's input clamp (kernels/activation.h; the vector exps clamp the same way).
constexpr float EXP_CLAMP = 88.f;
// Accumulation chains per token of the dense kernel: they hide the FMA latency (kernels/dense.h).
constexpr int DENSE_CHAINS = 4;

namespace portable {

// A spin-wait's pause (kernels/threadpool.h, ops/localsum.h).
inline void cpu_pause() { std::this_thread::yield(); }

inline int64_t silu_mul_head(const float*, const float*, float*, int64_t i, int64_t) { return i; }
inline int64_t softmax_exp_head(float*, int64_t j, int64_t, float, float&) { return j; }
inline int64_t absmax_head(const float*, int64_t, float&) { return 0; }
inline int64_t round_clamp_head(float*, int64_t, float, float) { return 0; }
inline int64_t fast_order_head(const int8_t*, int64_t, int8_t*) { return 0; }
inline bool q8k_block_head(const float*, int64_t, int8_t*, float&) { return false; }
inline int64_t sum_i8_head(const int8_t*, int64_t, int32_t&) { return 0; }
inline bool f16x8_finite_to_f32(const uint16_t*, float*) { return false; }
// float16 bits widened to float32 over the whole vectors (F16C / FCVTL: NaN and infinity
// convert too, a signalling NaN comes out quiet, unlike f16_to_f32); returns the tail's start
inline int64_t f16_widen_head(const uint16_t*, int64_t, float*) { return 0; }
inline bool f16x8x8_finite_to_f32(const uint16_t*, int64_t, float*) { return false; }

// llama.cpp's tables: no rows of the ISA's own (kernels/kquants.h runs its generic loops)
template <class GL>
inline bool ggml_tile(const GL&, bool, int64_t, int64_t, int64_t, int64_t) { return false; }

constexpr const char* DENSE_ISA = "scalar";
constexpr int DENSE_TOKENS = 3;

template <int WD, int T, class DL>
void dense_block(const DL& L, int64_t n0, int64_t n1, int64_t m0) {
  for (int64_t n = n0; n < n1; n++)
    for (int t = 0; t < T; t++) {
      float y = 0.f;
      for (int64_t i = 0; i < L.k; i++)
        y += load_as_f32(L.w, WD, n * L.k + i) * L.x[(m0 + t) * L.k + i];
      store_from_f32(L.out, L.out_dtype, (m0 + t) * L.n + n, y);
    }
}

}  // namespace portable

}  // namespace tk
