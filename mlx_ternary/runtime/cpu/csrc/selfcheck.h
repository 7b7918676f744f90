// A self-check of the SIMD paths this build selected (arch/select.h: NativeOps, KqNative) of it against the portable
// path and a direct computation from the format's definition. The extension runs the check
// once when it is loaded and refuses to serve if it fails, so a SIMD path that could only be
// compiled here (AVX-512 VNNI, NEON on an x86 build machine) never gives a wrong answer
// silently; selftest.cpp runs the same check as a standalone program (cross-compiled + qemu).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "arch/select.h"
#include "kernels/attention.h"
#include "kernels/dense.h"
#include "kernels/kquants.h"
#include "kernels/ternary.h"

namespace tk {

// FNV-1a digests of the bits of the integer-activation outputs the check computes:
// [0] the exact records (int8 with a tensor or row scale, q8k): the same on every ISA, by
// -ffp-contract=off; [1] group-scaled int8: float32 sums of lanes in the lane contract's order,
// the same on every build of one vector width (armv8-a and +dotprod). check_native_isas.sh
// compares them between its builds.
inline uint64_t* int8_digests() {
  static uint64_t h[2] = {1469598103934665603ull, 1469598103934665603ull};
  return h;
}
inline void fold_digest(int which, const std::vector<float>& y) {
  uint64_t& h = int8_digests()[which];
  for (float v : y) {
    uint32_t u = 0x7FC00000u;  // a NaN as one value: x86 and arm64 make different default NaNs
    if (!std::isnan(v)) std::memcpy(&u, &v, 4);
    for (int i = 0; i < 4; i++) h = (h ^ ((u >> (8 * i)) & 255)) * 1099511628211ull;
  }
}

inline std::vector<uint8_t> pack_rows(const std::vector<int8_t>& t, const Geometry& g) {
  std::vector<uint8_t> out(g.n * g.row_bytes, 0);
  for (int64_t n = 0; n < g.n; n++) {
    uint8_t* row = out.data() + n * g.row_bytes;
    if (g.packing == FAST) {
      for (int64_t col = 0; col < g.row_bytes * 4; col++) {
        int code = col < g.k ? t[n * g.k + col] + 1 : 1;
        row[col / 4] |= (uint8_t)(code << (2 * (col % 4)));
      }
    } else {
      int64_t nblocks = ceil_div(g.k, g.block_len);
      for (int64_t b = 0; b < nblocks; b++)
        for (int64_t j = 0; j < g.block_bytes; j++) {
          uint32_t v = 0;
          for (int i = 0; i < 5; i++) {
            int64_t local = 5 * j + i, col = b * g.block_len + local;
            int d = (local < g.block_len && col < g.k) ? t[n * g.k + col] + 1 : 1;
            v = v * 3 + d;
          }
          row[b * g.block_bytes + j] = (uint8_t)((v * 256 + 242) / 243);
        }
    }
  }
  return out;
}

template <class O>
inline void run_rows(const Layer& L, const Acts& a, int64_t M) {
  rows_dispatch<O>(L, a, M, 0, L.g.n);
}

// One random case; returns "" or what differed.
inline std::string check_case(int packing, int64_t M, int64_t N, int64_t K, int group,
                              int scale_kind, bool act, bool bias, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> trit(-1, 1);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> unif(0.5f, 1.5f);
  Geometry g = make_geometry(packing, N, K, scale_kind == 2 ? group : 0);
  std::vector<int8_t> t(N * K);
  for (auto& v : t) v = (int8_t)trit(rng);
  std::vector<uint8_t> w = pack_rows(t, g);
  int64_t ns = scale_kind == 0 ? 1 : scale_kind == 1 ? N : N * g.ngroups;
  std::vector<float> s(ns), b(N), x(M * K);
  for (auto& v : s) v = unif(rng);
  for (auto& v : b) v = normal(rng);
  for (auto& v : x) v = normal(rng) * (1 + (rng() % 4));
  if (K > 3) x[1] = 0.f, x[2] = -x[0];  // zeros and ties
  Layer L(g);
  L.w = w.data();
  L.scales = s.data();
  L.scale_kind = scale_kind;
  L.bias = bias ? b.data() : nullptr;
  L.act_quant = act;
  Acts a;
  std::vector<float> tmp(K);
  if (act) {
    a.q.assign(M * g.xlen(), 0), a.xs.assign(M, 0.f), a.gsum.assign(M * g.ngroups, 0);
    for (int64_t m = 0; m < M; m++) quantize_token(g, x.data(), F32, m, a, tmp.data());
  } else {
    a.f.assign(M * g.xlen(), 0.f);
    for (int64_t m = 0; m < M; m++) permute_token(g, x.data(), F32, m, a);
  }
  std::vector<float> y_native(M * N), y_scalar(M * N), wd(N * K);
  L.out = y_native.data();
  run_rows<NativeOps>(L, a, M);
  L.out = y_scalar.data();
  run_rows<ScalarOps>(L, a, M);
  if (act) fold_digest(scale_kind == 2, y_native);
  dequantize_rows(L, wd.data(), 0, N);
  std::vector<double> xd(M * K);  // the activations the layer multiplies
  for (int64_t m = 0; m < M; m++) {
    float am = 0;
    for (int64_t i = 0; i < K; i++) am = std::max(am, std::fabs(x[m * K + i]));
    float sc = 127.f / std::max(am, 1e-5f);
    for (int64_t i = 0; i < K; i++) {
      float v = x[m * K + i];
      xd[m * K + i] = act ? std::min(127.f, std::max(-128.f, std::nearbyint(v * sc))) / (double)sc : v;
    }
  }
  for (int64_t m = 0; m < M; m++) {
    for (int64_t n = 0; n < N; n++) {
      // direct: the dequantized weight (from the format definition) times the activations
      double want = 0, mag = 0;
      for (int64_t col = 0; col < K; col++) {
        double xv = xd[m * K + col];
        int tv = t[n * K + col];
        double sv = scale_kind == 0 ? s[0] : scale_kind == 1 ? s[n] : s[n * g.ngroups + col / group];
        if ((double)wd[n * K + col] != tv * sv) return "dequantize_rows disagrees with the trits";
        want += xv * tv * sv, mag += std::fabs(xv * sv);
      }
      want += bias ? b[n] : 0.0;
      mag += std::fabs(bias ? b[n] : 0.0) + 1e-6;
      double yn = y_native[m * N + n], ys = y_scalar[m * N + n];
      bool exact = act && scale_kind != 2;  // integer accumulation: identical bits
      if (exact ? yn != ys : std::fabs(yn - ys) > 1e-5 * mag)
        return std::string(NativeOps::name) + " and scalar paths differ";
      if (std::fabs(yn - want) > 1e-5 * mag) return "result differs from the direct computation";
    }
  }
  return "";
}

// q8k: NativeOps and ScalarOps bit-identical, and both equal to ggml's sum computed here from
// the definition (Q8_K per 256 columns, integer dot products per segment, float32 in order).
// f16_scales: the scales as float16, the first one infinite where there are several (the kernels' F16C conversion and
// its fallback for a non-finite half); extreme: rows of all +1 and all -1 trits against
// tokens of one value (codes ±127): the largest segment sums there are (AVX2's panels add
// them up in int16: 32512 a lane)
inline std::string check_q8k_case(int packing, int64_t M, int64_t N, int64_t K, int group,
                                  int scale_kind, uint32_t seed, bool bias = false,
                                  bool f16_scales = false, bool extreme = false) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> trit(-1, 1);
  std::normal_distribution<float> normal(0.f, 1.f);
  Geometry g = make_geometry(packing, N, K, scale_kind == 2 ? group : 0);
  if (!g.q8k_ok) return "";
  std::vector<int8_t> t(N * K);
  for (auto& v : t) v = (int8_t)trit(rng);
  std::vector<uint8_t> w = pack_rows(t, g);
  std::vector<float> s(scale_kind == 0 ? 1 : scale_kind == 1 ? N : N * g.ngroups), x(M * K);
  for (auto& v : s) v = 0.5f + (rng() % 1000) / 1000.f;
  std::vector<uint16_t> s16(s.size());
  if (f16_scales) {
    if (s.size() > 1) s[0] = INFINITY;
    for (size_t i = 0; i < s.size(); i++) s16[i] = f32_to_f16(s[i]), s[i] = f16_to_f32(s16[i]);
  }
  for (auto& v : x) v = normal(rng) * (1 + (rng() % 4));
  if (K > 3) x[1] = 0.f, x[2] = -x[0];  // zeros and a tie of magnitudes
  if (M > 1) std::fill(x.begin() + K, x.begin() + K + std::min<int64_t>(K, Q8K_BLOCK), 0.f);
  if (extreme) {
    for (int64_t n = 0; n < N; n++)
      std::fill(t.begin() + n * K, t.begin() + (n + 1) * K, n % 2 ? -1 : 1);
    w = pack_rows(t, g);
    for (int64_t m = 0; m < M; m++)
      std::fill(x.begin() + m * K, x.begin() + (m + 1) * K, (m % 2 ? -1.f : 1.f) * (1 + m));
  }
  std::vector<float> b(N);
  for (auto& v : b) v = normal(rng);
  Layer L(g);
  L.w = w.data(), L.scales = s.data(), L.scale_kind = scale_kind;
  if (f16_scales) L.scales = s16.data(), L.scale_dtype = F16;
  if (bias) L.bias = b.data();
  L.act_quant = L.q8k = true;
  Acts a;
  a.q.assign(M * g.xlen(), 0), a.d8.assign(M * g.nblocks8, 0.f), a.ssum.assign(M * g.nseg, 0);
  std::vector<float> tmp(q8k_tmp_floats(K)), y_native(M * N), y_scalar(M * N);
  for (int64_t m = 0; m < M; m++) quantize_token_q8k(g, x.data(), F32, m, a, tmp.data());
  L.out = y_native.data();
  run_rows<NativeOps>(L, a, M);
  L.out = y_scalar.data();
  run_rows<ScalarOps>(L, a, M);
  fold_digest(0, y_native);
  for (int64_t m = 0; m < M; m++) {
    std::vector<float> d(g.nblocks8, 0.f);
    std::vector<int> q(K, 0);
    for (int64_t b = 0; b < g.nblocks8; b++) {
      float amax = 0.f, top = 0.f;
      for (int64_t i = b * Q8K_BLOCK; i < std::min<int64_t>(K, (b + 1) * Q8K_BLOCK); i++)
        if (std::fabs(x[m * K + i]) > amax) amax = std::fabs(x[m * K + i]), top = x[m * K + i];
      if (amax == 0.f) continue;
      float is = -127.f / top;
      for (int64_t i = b * Q8K_BLOCK; i < std::min<int64_t>(K, (b + 1) * Q8K_BLOCK); i++)
        q[i] = std::min(127, (int)std::lrint(is * x[m * K + i]));
      d[b] = 1.f / is;
    }
    for (int64_t n = 0; n < N; n++) {
      float want = 0.f;
      for (int64_t sg = 0; sg < g.nseg; sg++) {
        int32_t sumi = 0;
        for (int64_t i = sg * g.seg_len; i < std::min<int64_t>(K, (sg + 1) * g.seg_len); i++)
          sumi += q[i] * t[n * K + i];
        int64_t gi = scale_kind == 2 ? sg * g.seg_len / group : 0;
        float sv = scale_kind == 0 ? s[0] : scale_kind == 1 ? s[n] : s[n * g.ngroups + gi];
        want += (float)sumi * (d[sg * g.seg_len / Q8K_BLOCK] * sv);
      }
      if (bias) want += b[n];
      const float yn = y_native[m * N + n], ys = y_scalar[m * N + n];
      if (std::memcmp(&yn, &ys, 4) != 0)
        return std::string(NativeOps::name) + " and scalar paths differ (q8k)";
      if (yn != want && !(std::isnan(yn) && std::isnan(want)))
        return "q8k result differs from ggml's definition";
    }
  }
  return "";
}

inline std::string check_dense(int wd, int64_t M, int64_t N, int64_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> wf(N * K), x(M * K), y(M * N);
  std::vector<uint16_t> wh(N * K);
  for (auto& v : wf) v = normal(rng);
  for (auto& v : x) v = normal(rng);
  for (int64_t i = 0; i < N * K; i++) {
    if (wd == F16) wh[i] = f32_to_f16(wf[i]), wf[i] = f16_to_f32(wh[i]);
    if (wd == BF16) wh[i] = f32_to_bf16(wf[i]), wf[i] = bf16_to_f32(wh[i]);
  }
  DenseLayer L;
  L.w = wd == F32 ? (const void*)wf.data() : (const void*)wh.data();
  L.w_dtype = wd, L.n = N, L.k = K, L.x = x.data(), L.out = y.data();
  dense_rows(L, M, 0, N);
  for (int rows : {1, 2, 4}) {  // x86's rows of a one-token tile: the same bits
    std::vector<float> yr(M * N);
    DenseLayer Lr = L;
    Lr.rows_one = rows, Lr.out = yr.data();
    dense_rows(Lr, M, 0, N);
    if (std::memcmp(yr.data(), y.data(), 4 * M * N) != 0) return "dense rows differ by tile height";
  }
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      double want = 0, mag = 1e-6;
      for (int64_t i = 0; i < K; i++) {
        want += (double)wf[n * K + i] * x[m * K + i];
        mag += std::fabs((double)wf[n * K + i] * x[m * K + i]);
      }
      if (std::fabs(y[m * N + n] - want) > 1e-5 * mag) return "dense rows differ";
    }
  return "";
}

template <class O>
inline void run_attention(const AttnShape& sh, const float* q, const void* k, const void* v,
                          float* out) {
  attention<O>(sh, q, k, v, out, [](int64_t n, const auto& f) {
    for (int64_t i = 0; i < n; i++) f(i);
  });
}

// The tiled attention (float32 or float16 K/V, chunks merged in one task or across tasks)
// against a direct float64 computation, with this build's ops and the portable ones.
inline std::string check_attention(int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lk,
                                   int64_t D, bool causal, bool half, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t kpad = D + 3;  // keys and values with a row stride that is not D
  AttnShape sh{B, Hq, Hkv, Lq, Lk, D, {Hq * Lq * D, Lq * D, D},
               {Hkv * Lk * kpad, Lk * kpad, kpad}, {Hkv * Lk * kpad, Lk * kpad, kpad},
               {Hq * Lq * D, Lq * D, D}, 1.f / std::sqrt((float)D), causal};
  sh.kv_half = half;
  std::vector<float> q(B * Hq * Lq * D), k(B * Hkv * Lk * kpad), v(k.size()), y(q.size()),
      ys(q.size());
  std::vector<uint16_t> kh(k.size()), vh(v.size());
  for (auto& x : q) x = normal(rng);
  for (size_t i = 0; i < k.size(); i++) {  // values a float16 holds exactly
    kh[i] = f32_to_f16(normal(rng)), k[i] = f16_to_f32(kh[i]);
    vh[i] = f32_to_f16(normal(rng)), v[i] = f16_to_f32(vh[i]);
  }
  const void* kp = half ? (const void*)kh.data() : k.data();
  const void* vp = half ? (const void*)vh.data() : v.data();
  run_attention<NativeOps>(sh, q.data(), kp, vp, y.data());
  run_attention<ScalarOps>(sh, q.data(), kp, vp, ys.data());
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < Hq; h++)
      for (int64_t i = 0; i < Lq; i++) {
        const int64_t kh0 = (b * Hkv + h / (Hq / Hkv)) * Lk * kpad;
        const int64_t n = causal ? std::min(Lk, i + Lk - Lq + 1) : Lk;
        const float* qi = q.data() + ((b * Hq + h) * Lq + i) * D;
        std::vector<double> p(n);
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < n; j++) {
          double dot = 0;
          for (int64_t d = 0; d < D; d++) dot += (double)qi[d] * k[kh0 + j * kpad + d];
          p[j] = dot * sh.scale, mx = std::max(mx, p[j]);
        }
        for (auto& x : p) sum += (x = std::exp(x - mx));
        for (int64_t d = 0; d < D; d++) {
          double want = 0;
          for (int64_t j = 0; j < n; j++) want += p[j] / sum * v[kh0 + j * kpad + d];
          const int64_t o = ((b * Hq + h) * Lq + i) * D + d;
          if (std::fabs(y[o] - want) > 1e-5 || std::fabs(ys[o] - want) > 1e-5)
            return "attention differs from the direct computation (D " + std::to_string(D) +
                   ", Lq " + std::to_string(Lq) + ", Lk " + std::to_string(Lk) +
                   (half ? ", float16 K/V" : "") + ")";
        }
      }
  return "";
}

// Every packing, scale kind, group size, activation mode, token tile and tail; "" when all
// agree, else the first failing case.
inline std::string selfcheck() {
  const int64_t Ks[] = {7, 33, 130, 301, 517};
  const int64_t Ms[] = {1, 2, 3, 4, 5, 9, 13, 30};  // token tiles, remainders, the panel path
  uint32_t seed = 1;
  for (int packing : {FAST, COMPACT})
    for (int sk = 0; sk < 3; sk++)
      for (int group : {64, 128, 256})
        for (int act = 0; act < 2; act++)
          for (int64_t K : Ks) {
            if (sk != 2 && group != 64) continue;
            int64_t M = Ms[seed % 8], N = 3 + seed % 7;
            std::string e = check_case(packing, M, N, K, group, sk, act, seed % 2, seed);
            seed++;
            if (!e.empty())
              return e + " (packing " + std::to_string(packing) + ", scale kind " +
                     std::to_string(sk) + ", group " + std::to_string(group) + ", act " +
                     std::to_string(act) + ", M " + std::to_string(M) + ", K " +
                     std::to_string(K) + ")";
          }
  for (int packing : {FAST, COMPACT})
    for (int sk = 0; sk < 3; sk++)
      for (int group : {64, 128, 256})
        for (int64_t K : {7, 256, 300, 704}) {
          if (sk != 2 && group != 64) continue;
          int64_t M = 1 + seed % 9, N = 3 + seed % 7;
          std::string e = check_q8k_case(packing, M, N, K, group, sk, seed++);
          if (!e.empty())
            return e + " (packing " + std::to_string(packing) + ", scale kind " +
                   std::to_string(sk) + ", group " + std::to_string(group) + ", M " +
                   std::to_string(M) + ", K " + std::to_string(K) + ")";
        }
  // the 8-row decode blocks (q8k.h rows_q8k_r8): whole blocks, a tail, tokens 1-3 and a tile
  for (auto [M, N, K, group, sk] : {std::tuple{1, 19, 300, 256, 2}, std::tuple{2, 8, 512, 128, 2},
                                    std::tuple{3, 17, 256, 256, 1}, std::tuple{5, 9, 700, 256, 0},
                                    std::tuple{1, 16, 7, 256, 1},
                                    // the 512-bit windows: whole 256-column blocks, a row
                                    // tail, tokens 1 and tiles with a short one
                                    std::tuple{1, 21, 512, 256, 2}, std::tuple{6, 13, 768, 256, 2},
                                    std::tuple{4, 8, 256, 256, 0}, std::tuple{9, 11, 1024, 256, 1}}) {
    std::string e = check_q8k_case(FAST, M, N, K, group, sk, seed++);
    if (!e.empty())
      return e + " (8-row blocks, M " + std::to_string(M) + ", N " + std::to_string(N) + ", K " +
             std::to_string(K) + ")";
  }
  // decode one row at a time (q8k.h rows_q8k_lin, AVX2 without VNNI; the 8-row blocks
  // elsewhere): rows in blocks of 8 and a partial one, a block's segments in groups of 8
  // across the rows' ends and a partial last group, 1-3 tokens, every scale kind, float16
  // scales (an infinite one), a bias, rows of one segment, BitNet 2B4T's 10 and 27 segments,
  // a row too long for the kernel's buffer (rows_r8)
  for (auto [M, N, K, sk, bias, f16] :
       {std::tuple{1, 13, 2304, 2, false, true}, std::tuple{2, 7, 4096, 1, true, false},
        std::tuple{3, 21, 1792, 2, true, true}, std::tuple{1, 16, 2048, 0, false, true},
        std::tuple{2, 9, 5632, 2, false, false}, std::tuple{1, 9, 16640, 2, true, true},
        std::tuple{1, 19, 2560, 2, true, true}, std::tuple{3, 11, 6912, 2, false, true},
        std::tuple{2, 13, 256, 1, false, false}, std::tuple{1, 10, 2560, 0, false, true}}) {
    std::string e = check_q8k_case(FAST, M, N, K, 256, sk, seed++, bias, f16);
    if (!e.empty())
      return e + " (one row at a time, M " + std::to_string(M) + ", N " + std::to_string(N) +
             ", K " + std::to_string(K) + ")";
  }
  // prefill through the row panels (q8k.h rows_q8k_panels, where the ISA has them): short
  // token tiles of 1, 4, 5 and 7 tokens, passes of two panels and of one, a partial last panel,
  // every scale kind, a bias; the largest sums (AVX2's int16 lanes at their bound)
  for (auto [M, N, K, sk, extreme] : {std::tuple{13, 37, 512, 2, false}, std::tuple{23, 48, 768, 1, false},
                                      std::tuple{9, 16, 256, 0, false}, std::tuple{20, 70, 1024, 2, false},
                                      std::tuple{10, 12, 512, 2, true}}) {
    std::string e = check_q8k_case(FAST, M, N, K, 256, sk, seed++, true, false, extreme);
    if (!e.empty())
      return e + " (row panels, M " + std::to_string(M) + ", N " + std::to_string(N) + ", K " +
             std::to_string(K) + ")";
  }
  // the 1-row x 8-token tiles (q8k.h rows_q8k_t8, AVX2): whole tiles, a short one of 5-7,
  // a rest of 4-token tiles or of one token, a row tail, groups of 128, rows in parts
  for (auto [M, N, K, group, sk] : {std::tuple{8, 5, 300, 256, 2}, std::tuple{13, 7, 704, 256, 1},
                                    std::tuple{12, 3, 512, 128, 2}, std::tuple{17, 4, 256, 256, 0},
                                    std::tuple{6, 9, 1000, 256, 2}, std::tuple{9, 5, 2600, 256, 2},
                                    std::tuple{8, 3, 4500, 128, 1}}) {
    std::string e = check_q8k_case(FAST, M, N, K, group, sk, seed++);
    if (!e.empty())
      return e + " (8-token tiles, M " + std::to_string(M) + ", N " + std::to_string(N) + ", K " +
             std::to_string(K) + ")";
  }
  // the per-token int8 8-row decode blocks (ternary.h rows_int8_r8): a row tail, tokens 1-3
  // (and 6, 16: VNNI runs the blocks for every decode batch),
  // a partial last step, rows long enough for the int16 sums to be widened mid-row
  for (auto [M, N, K, sk, bias] : {std::tuple{1, 19, 517, 1, true}, std::tuple{3, 16, 130, 0, false},
                                   std::tuple{2, 9, 2100, 1, false}, std::tuple{1, 8, 4000, 0, true},
                                   std::tuple{6, 17, 600, 1, true}, std::tuple{16, 9, 300, 0, false}}) {
    std::string e = check_case(FAST, M, N, K, 64, sk, true, bias, seed++);
    if (!e.empty())
      return e + " (int8 8-row blocks, M " + std::to_string(M) + ", N " + std::to_string(N) +
             ", K " + std::to_string(K) + ")";
  }
  // tiles, chunks (300 keys: two), chunks merged in a task (16 tasks) and across tasks, a
  // head size with a tail, float16 K/V; whole tiles every row sees: a decode group of 8 and
  // of 4 + 2 rows reading V in place (float16, float32), a prefill task's 32 rows from vbuf
  for (auto [b, hq, hkv, lq, lk, d, causal, half] :
       {std::tuple{1, 4, 2, 5, 9, 64, true, false}, std::tuple{1, 2, 2, 1, 7, 40, false, true},
        std::tuple{2, 6, 3, 3, 3, 128, true, false}, std::tuple{1, 8, 2, 1, 300, 20, true, true},
        std::tuple{1, 16, 16, 1, 300, 8, false, true}, std::tuple{1, 4, 1, 40, 45, 16, true, false},
        std::tuple{1, 8, 1, 1, 100, 64, false, true}, std::tuple{1, 6, 1, 1, 70, 32, true, false},
        std::tuple{1, 8, 1, 40, 100, 16, true, true}}) {
    std::string e = check_attention(b, hq, hkv, lq, lk, d, causal, half, seed++);
    if (!e.empty()) return e;
  }
  for (int wd : {F32, F16, BF16})
    for (int64_t K : {5, 64, 77})
      for (int64_t M : {1, 2, 4, 5, 9}) {  // whole tiles of every ISA, single rows, the passes' splits
        std::string e = check_dense(wd, M, 19, K, seed++);
        if (!e.empty()) return e + " (dtype " + std::to_string(wd) + ", K " + std::to_string(K) + ")";
      }
  return "";
}

// ---------------------------------------------------------------------------------------------
// Self-check: KqNative against KqScalar (bit for bit, both numerics) on random blocks
// ---------------------------------------------------------------------------------------------

inline std::string kq_check_case(int type, int64_t M, int64_t N, int64_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  const GgmlGeom g = ggml_geom(type);
  const int64_t nb = K / g.block;
  std::vector<uint8_t> w(N * nb * g.bytes);
  for (auto& b : w) b = (uint8_t)(rng() & 0xFF);
  for (int64_t i = 0; i < N * nb; i++) {  // finite scales: d (and dmin) small float16s
    uint8_t* blk = w.data() + i * g.bytes;
    const int off = type == GQ6_K ? 208 : 0;
    const uint16_t h = f32_to_f16(std::ldexp((float)(rng() % 1000) + 1.f, -16));
    std::memcpy(blk + off, &h, 2);
    if (type == GQ4_K || type == GQ5_K) std::memcpy(blk + 2, &h, 2);
  }
  std::vector<float> x(M * K);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : x) v = nd(rng);
  KActs a;
  size_acts(type, M, K, a);
  for (int64_t m = 0; m < M; m++) quantize_token_ggml(type, x.data(), K, m, a);
  for (int llama = 0; llama < 2; llama++) {
    std::vector<float> y0(M * N), y1(M * N);
    GgmlLayer L;
    L.w = w.data(), L.type = type, L.n = N, L.k = K, L.x = x.data(), L.acts = &a;
    L.out = y0.data();
    ggml_rows<KqScalar>(L, llama, M, 0, N);
    L.out = y1.data();
    ggml_rows<KqNative>(L, llama, M, 0, N);
    if (std::memcmp(y0.data(), y1.data(), y0.size() * 4) != 0)
      return std::string("ggml table kernel (") + KqNative::name + ") differs from the portable one (type " +
             std::to_string(type) + (llama ? ", llama" : ", float") + " numerics)";
  }
  return "";
}

inline std::string kq_selfcheck() {
  uint32_t seed = 7;
  for (int type : {GQ8_0, GQ4_K, GQ5_K, GQ6_K})
    for (int64_t M : {1, 3, 9}) {
      std::string e = kq_check_case(type, M, 5, 512, seed++);
      if (!e.empty()) return e;
    }
  return "";
}

}  // namespace tk
