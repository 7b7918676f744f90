// x86-64 ternary inner operations: AVX2 (+ FMA), with the VNNI dot product where the CPU has
// it (AVX-VNNI, or AVX-512 VNNI on 256-bit vectors). Same contract as arch/scalar.h.
//
// Integer dot: unsigned codes c in {0,1,2} times signed int8 activations. AVX2 has no 8-bit
// multiply-accumulate, so pmaddubsw (u8 x s8 -> pairwise s16; |sum| <= 2*2*128 per pair, no
// saturation) feeds pmaddwd against ones (-> s32). VNNI does the same in one vpdpbusd.
// The -1 of t = c - 1 is applied once per row/group as - sum(x) (kernels/layer.h).
#pragma once

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../kernels/ggml_blocks.h"  // llama.cpp blocks (kqx)
#include "../kernels/layer.h"        // dtypes, their conversions, PREFETCH_BYTES
#include "scalar.h"            // the contracts

namespace tk {

struct Avx2Ops {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  static constexpr const char* name = "avx512vnni";
#elif defined(__AVXVNNI__)
  static constexpr const char* name = "avxvnni";
#else
  static constexpr const char* name = "avx2";
#endif
  using V = __m256i;
  using IA = __m256i;
  using FV = __m256;

  static V load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static V load_tail(const uint8_t* p, int n) {
    alignas(32) uint8_t buf[32] = {0};
    std::memcpy(buf, p, n);
    return _mm256_load_si256((const __m256i*)buf);
  }
  static void fast4(V w, V c[4]) {
    const __m256i m3 = _mm256_set1_epi8(3);
    c[0] = _mm256_and_si256(w, m3);
    c[1] = _mm256_and_si256(_mm256_srli_epi16(w, 2), m3);
    c[2] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m3);
    c[3] = _mm256_and_si256(_mm256_srli_epi16(w, 6), m3);
  }
  // Digit i of byte q is ((q * 3^i mod 256) * 3) >> 8, i.e. [q_i >= 86] + [q_i >= 171] with
  // q_i = q * 3^i mod 256: byte adds wrap mod 256, unsigned compares via the sign flip.
  static void base3(V q, V c[5]) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const __m256i t1 = _mm256_set1_epi8((char)(85 ^ 0x80));
    const __m256i t2 = _mm256_set1_epi8((char)(170 ^ 0x80));
    const __m256i zero = _mm256_setzero_si256();
    for (int i = 0; i < 5; i++) {
      __m256i s = _mm256_xor_si256(q, flip);
      __m256i m = _mm256_add_epi8(_mm256_cmpgt_epi8(s, t1), _mm256_cmpgt_epi8(s, t2));
      c[i] = _mm256_sub_epi8(zero, m);
      if (i < 4) q = _mm256_add_epi8(q, _mm256_add_epi8(q, q));
    }
  }

  static IA izero() { return _mm256_setzero_si256(); }
  template <int NV>
  static void idot(IA& a, const V* c, const int8_t* x) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    for (int v = 0; v < NV; v++) {
      __m256i xv = _mm256_loadu_si256((const __m256i*)(x + 32 * v));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      a = _mm256_dpbusd_epi32(a, c[v], xv);
#else
      a = _mm256_dpbusd_avx_epi32(a, c[v], xv);
#endif
    }
#else
    __m256i s = _mm256_maddubs_epi16(c[0], _mm256_loadu_si256((const __m256i*)x));
    for (int v = 1; v < NV; v++)
      s = _mm256_add_epi16(
          s, _mm256_maddubs_epi16(c[v], _mm256_loadu_si256((const __m256i*)(x + 32 * v))));
    a = _mm256_add_epi32(a, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
#endif
  }
  static int32_t isum(IA a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
  }
  static FV fvzero() { return _mm256_setzero_ps(); }
  static void iflush(IA& a, FV& f, float lo, float hi) {
    f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)),
                        f);
    a = _mm256_setzero_si256();
  }
  static float fvsum(FV f) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  // q8k tiles (q8k.h rows_q8k_tile): 2 rows x 4 tokens = 8 accumulators, one per lane of the
  // per-segment results (rows_q8k_r8: 8 rows x 1 token). Without VNNI the pmaddubsw pairs add up in int16 within a segment
  // (at most Q8K_TILE_I16_TERMS of them per lane: no overflow) and widen
  // to int32 once per segment.
  static constexpr bool has_q8k_tile = true;
#if defined(__AVX512VL__)
  static constexpr int q8k_tile_pairs = 2;  // 32 vector registers: tiles of 4 rows x 4 tokens
#endif
  using TA = __m256i;
  static TA tzero() { return _mm256_setzero_si256(); }
  static V code(V w, int v) {
    return _mm256_and_si256(_mm256_srli_epi16(w, 2 * v), _mm256_set1_epi8(3));
  }
  static V xload(const int8_t* x) { return _mm256_loadu_si256((const __m256i*)x); }
  static void tdot(TA& a, V c, V x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    a = _mm256_dpbusd_epi32(a, c, x);
#elif defined(__AVXVNNI__)
    a = _mm256_dpbusd_avx_epi32(a, c, x);
#else
    a = _mm256_add_epi16(a, _mm256_maddubs_epi16(c, x));
    __asm__("" : "+x"(a));  // keeps the compiler from reassociating the sums into spills
#endif
  }
  // the 4 code vectors c of a step against one token's 128 activations x, into a (tdot's
  // sums; without VNNI the 4 pmaddubsw add up in a tree before the accumulator)
  static void tdot4(TA& a, const V c[4], const int8_t* x) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    for (int v = 0; v < 4; v++) tdot(a, c[v], xload(x + 32 * v));
#else
    const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(c[0], xload(x)),
                                         _mm256_maddubs_epi16(c[1], xload(x + 32)));
    const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(c[2], xload(x + 64)),
                                         _mm256_maddubs_epi16(c[3], xload(x + 96)));
    a = _mm256_add_epi16(a, _mm256_add_epi16(p01, p23));
#endif
  }
  // lane i = the sum of all lanes of a[i] (as int32); a[] is reset to zero
  static __m256i tsum8(TA a[8]) {
    __m256i w[8];
    for (int i = 0; i < 8; i++) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
      w[i] = a[i];
#else
      w[i] = _mm256_madd_epi16(a[i], _mm256_set1_epi16(1));
#endif
      a[i] = _mm256_setzero_si256();
    }
#if defined(__AVX512VL__)
    __m256i h01 = _mm256_hadd_epi32(w[0], w[1]), h23 = _mm256_hadd_epi32(w[2], w[3]);
    __m256i h45 = _mm256_hadd_epi32(w[4], w[5]), h67 = _mm256_hadd_epi32(w[6], w[7]);
    __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                            _mm256_permute2x128_si256(lo, hi, 0x31));
#else
    __m256i p[4];
    for (int i = 0; i < 4; i++) p[i] = sum_pair(w[2 * i], w[2 * i + 1]);
    return sum_quads(p);
#endif
  }
  // tsum8's reduction without vphaddd (2 cycles each on Zen 4, 4 uops; 3 on Intel's cores),
  // in unpacks and adds: sum_pair(a, b) = lanes of a and b added in pairs (within 128-bit
  // halves: a01 b01 a23 b23), sum_quads(p) = lane i the sum of all of input i (wsum8's order).
  // Dword lanes of int32, or (I16) of two int16 lanes each, added as int16 (q8k_seg8).
  template <bool I16 = false>
  static __m256i dadd(__m256i a, __m256i b) {
    return I16 ? _mm256_add_epi16(a, b) : _mm256_add_epi32(a, b);
  }
  template <bool I16 = false>
  static __m256i sum_pair(__m256i a, __m256i b) {
    return dadd<I16>(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
  }
  template <bool I16 = false>
  static __m256i sum_quads(const __m256i p[4]) {
    const __m256i lo = dadd<I16>(_mm256_unpacklo_epi64(p[0], p[1]), _mm256_unpackhi_epi64(p[0], p[1]));
    const __m256i hi = dadd<I16>(_mm256_unpacklo_epi64(p[2], p[3]), _mm256_unpackhi_epi64(p[2], p[3]));
    return dadd<I16>(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
  // y + float(sumi - ssum) * (d * s), lane by lane: ssum, d for tokens 0-3 (both rows),
  // s0 / s1 the scales of rows 0 / 1
  static FV tstep(FV y, __m256i sumi, const int32_t* ssum4, const float* d4, float s0,
                  float s1) {
    __m256i ss = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)ssum4));
    __m256 d = _mm256_broadcast_ps((const __m128*)d4);
    __m256 s = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
    __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, ss));
    return _mm256_add_ps(y, _mm256_mul_ps(v, _mm256_mul_ps(d, s)));
  }
#if !defined(__AVX512VL__)
  // 16 vector registers: q8k.h rows_q8k_t8's tiles of 1 row x 8 tokens (8 accumulators and
  // the row's 4 code vectors), in place of 2 rows x 4 tokens, whose codes, activations and
  // accumulators do not fit in 16 (gcc spilled the accumulators at every step)
  static constexpr int q8k_tile_tokens = 8;
#endif
  // q8k.h rows_q8k_t8: lane t = token t of one row: y + float(sumi - ssum8[t]) * (d8[t] * s)
  static FV tstep_tokens(FV y, __m256i sumi, const int32_t* ssum8, const float* d8, float s) {
    const __m256 v = _mm256_cvtepi32_ps(
        _mm256_sub_epi32(sumi, _mm256_loadu_si256((const __m256i*)ssum8)));
    return _mm256_add_ps(y, _mm256_mul_ps(v, _mm256_mul_ps(_mm256_loadu_ps(d8), _mm256_set1_ps(s))));
  }
  // q8k.h rows_q8k_r8: lane r = row r of one token: y + float(sumi - ssum) * (d * s8)
  static FV tstep_rows(FV y, __m256i sumi, int32_t ssum, float d, const float* s8) {
    __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, _mm256_set1_epi32(ssum)));
    return _mm256_add_ps(y, _mm256_mul_ps(v, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(s8))));
  }
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
  // q8k.h rows_q8k_lin: one segment of two whole steps (w: 64 bytes of a row, x: its 256
  // prepared activations) as int16 lanes whose sum is the segment's sum(c q). With h = w >> 4
  // (16-bit lanes: the high byte's bits land above the masks), w & 3 and h & 3 are codes 0 and
  // 2, w & 0x0C and h & 0x0C four times codes 1 and 3: one shift, four masks a 32-byte step
  // and a single exact shift back for the four-times sums. A lane of S1 (the codes) adds 8
  // products c q, of S4 (four times the codes) 8 of 4 c q: |S1| <= 2048, |S4| <= 8192, and a
  // returned lane lies in [-4096, 4064] (codes c <= 2 and -128 <= q <= 127).
  static constexpr bool has_q8k_lin = true;
  static __m256i q8k_seg(const uint8_t* w, const int8_t* x) {
    const __m256i w0 = load(w), w1 = load(w + 32);
    const __m256i h0 = _mm256_srli_epi16(w0, 4), h1 = _mm256_srli_epi16(w1, 4);
    const __m256i m3 = _mm256_set1_epi8(3), m12 = _mm256_set1_epi8(0x0C);
    const __m256i s1 = _mm256_add_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w0, m3), xload(x)),
                         _mm256_maddubs_epi16(_mm256_and_si256(w1, m3), xload(x + 128))),
        _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(h0, m3), xload(x + 64)),
                         _mm256_maddubs_epi16(_mm256_and_si256(h1, m3), xload(x + 192))));
    const __m256i s4 = _mm256_add_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w0, m12), xload(x + 32)),
                         _mm256_maddubs_epi16(_mm256_and_si256(w1, m12), xload(x + 160))),
        _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(h0, m12), xload(x + 96)),
                         _mm256_maddubs_epi16(_mm256_and_si256(h1, m12), xload(x + 224))));
    return _mm256_add_epi16(s1, _mm256_srai_epi16(s4, 2));
  }
  // lane i = the sum of segment i of 8 (w + 64 i against x + xo[i]): tsum8's reduction of
  // their q8k_seg, the same lanes in the same places, but in int16 up to 8 lanes a sum
  // (|sum| <= 8 x 4096 = 32768, -32768 the only extreme that reaches it: exact) and widened
  // once for all 8 segments, as the segments are computed (a group's eight int16 accumulators
  // held to the end left gcc too few registers: 24 spills and reloads).
  static __m256i q8k_seg8(const uint8_t* w, const int8_t* x, const int32_t* xo) {
    __m256i p[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
      p[i] = sum_pair<true>(q8k_seg(w + 128 * i, x + xo[2 * i]),
                            q8k_seg(w + 128 * i + 64, x + xo[2 * i + 1]));
    return _mm256_madd_epi16(sum_quads<true>(p), _mm256_set1_epi16(1));
  }
#endif
  // q8k.h rows_q8k_lin: lane j = segment j of one row: float(sumi - ssum) * (d * s), the terms
  // tstep_rows adds
  static FV tterms(__m256i sumi, const int32_t* ssum8, const float* d8, const float* s8) {
    const __m256 v = _mm256_cvtepi32_ps(
        _mm256_sub_epi32(sumi, _mm256_loadu_si256((const __m256i*)ssum8)));
    return _mm256_mul_ps(v, _mm256_mul_ps(_mm256_loadu_ps(d8), _mm256_loadu_ps(s8)));
  }
  // ((y + t[0]) + t[1]) + ... + t[7]: the lanes added in order, in scalar float32
  static float fvadd_in_order(float y, FV t) {
    const __m128 lo = _mm256_castps256_ps128(t), hi = _mm256_extractf128_ps(t, 1);
    __m128 a = _mm_add_ss(_mm_set_ss(y), lo);
    a = _mm_add_ss(a, _mm_movehdup_ps(lo));
    a = _mm_add_ss(a, _mm_movehl_ps(lo, lo));
    a = _mm_add_ss(a, _mm_shuffle_ps(lo, lo, 3));
    a = _mm_add_ss(a, hi);
    a = _mm_add_ss(a, _mm_movehdup_ps(hi));
    a = _mm_add_ss(a, _mm_movehl_ps(hi, hi));
    a = _mm_add_ss(a, _mm_shuffle_ps(hi, hi, 3));
    return _mm_cvtss_f32(a);
  }
  static FV fvadd(FV a, FV b) { return _mm256_add_ps(a, b); }
  // c[i] lane r = p[r * stride + i]: 8 rows of 8 floats transposed (any alignment)
  static void ftranspose8(const float* p, int64_t stride, FV c[8]) {
    __m256 r[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(p + i * stride);
    for (int i = 0; i < 4; i++) {
      u[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      u[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
      r[4 * i + 0] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0x44);
      r[4 * i + 1] = _mm256_shuffle_ps(u[4 * i], u[4 * i + 2], 0xEE);
      r[4 * i + 2] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0x44);
      r[4 * i + 3] = _mm256_shuffle_ps(u[4 * i + 1], u[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
      c[i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x20);
      c[4 + i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x31);
    }
  }
  static void fvstore(float* p, FV v) { _mm256_storeu_ps(p, v); }
  static FV fvload(const float* p) { return _mm256_loadu_ps(p); }
  // kernels/ternary.h rows_int8_r8: int32 sums of 8 rows (lane = row) added up, and their
  // epilogue ((float)(sumi - gsum) * s8) * xs, lane by lane
  static __m256i tadd(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  static constexpr int int8_r8_tokens = 16;  // rows_int8_r8 for every decode batch (M <= 16)
#endif
  static FV int8_rows(__m256i sumi, int32_t gsum, const float* s8, float xs) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, _mm256_set1_epi32(gsum)));
    return _mm256_mul_ps(_mm256_mul_ps(v, _mm256_loadu_ps(s8)), _mm256_set1_ps(xs));
  }

#if !defined(__AVX512VL__)
  // q8k row panels on 256-bit vectors (q8k.h rows_q8k_panels; AVX-512 has its own below):
  // lane r = row r of an 8-row panel, word (s, d) = dword d of step s of each row; one
  // token's 4 activations of code v are broadcast to every lane (a vpbroadcastd load), so a
  // segment needs no horizontal sum - the 1 x 8 tiles' transpose and add per segment cost
  // about as much as a third of their pmaddubsw. The pairs add up in int16 over the whole
  // segment (Q8K_PANEL_I16_TERMS: exact) and pstep widens them once.
  static constexpr bool has_q8k_panel = true;
  static constexpr int q8k_panel_rows = 8;
  static constexpr int q8k_panel_pass = 1;  // 8 tokens' accumulators: half the registers
  // 8 tokens take the 1 x 8 tiles (q8k.h Q8K_PANEL_MIN_TOKENS: 0.93x through the panels)
  static constexpr int64_t q8k_panel_min_tokens = 9;
  using W = __m256i;  // a panel word, and an accumulator of int16 pairs (lane r: row r)
  using PF = __m256;  // 8 float lanes: the panel's rows
  static W wzero() { return _mm256_setzero_si256(); }
  static W wcode(W w, int v) { return code(w, v); }
  static W pbcast(const int8_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
  }
  static void wdot(W& a, W c, W x) {
    a = _mm256_add_epi16(a, _mm256_maddubs_epi16(c, x));
    __asm__("" : "+x"(a));  // keeps the compiler from reassociating the sums into spills
  }
  // The 8 words of one 32-byte step of 8 rows (w: the first row's step, rb bytes apart):
  // out + 32 d = dword d of rows 0-7 (an 8 x 8 dword transpose)
  static void ptranspose(const uint8_t* w, int64_t rb, uint8_t* out) {
    __m256i z[8], t[8], u[8];
    for (int i = 0; i < 8; i++) z[i] = _mm256_loadu_si256((const __m256i*)(w + i * rb));
    for (int i = 0; i < 8; i += 2)  // per 128-bit half: rows i, i + 1 interleaved
      t[i] = _mm256_unpacklo_epi32(z[i], z[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(z[i], z[i + 1]);
    for (int i = 0; i < 8; i += 4) {  // half h of u[i + k]: dword 4 h + k of rows i .. i + 3
      u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]), u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
      u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
      u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; k++) {
      _mm256_store_si256((__m256i*)(out + 32 * k), _mm256_permute2x128_si256(u[k], u[4 + k], 0x20));
      _mm256_store_si256((__m256i*)(out + 32 * (4 + k)),
                         _mm256_permute2x128_si256(u[k], u[4 + k], 0x31));
    }
  }
  static W pwload(const uint8_t* p) { return _mm256_load_si256((const __m256i*)p); }
  static PF pzero() { return _mm256_setzero_ps(); }
  static PF pload(const float* p) { return _mm256_load_ps(p); }
  static void pstore(float* p, PF v) { _mm256_store_ps(p, v); }
  static void pstoreu(float* p, PF v) { _mm256_storeu_ps(p, v); }
  static PF padd(PF a, PF b) { return _mm256_add_ps(a, b); }
  // the int16 pairs of acc widened and added (lane r: row r's segment sum), then
  // y + float(sumi - ssum) * (d * s), lane by lane (tstep_rows' order)
  static PF pstep(PF y, W acc, int32_t ssum, float d, PF s) {
    const __m256i sumi = _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
    const PF v = _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, _mm256_set1_epi32(ssum)));
    return _mm256_add_ps(y, _mm256_mul_ps(v, _mm256_mul_ps(_mm256_set1_ps(d), s)));
  }
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  // q8k windows (q8k.h rows_q8k_wide_tile, rows_q8k_r8w): two 32-byte steps of a row in one
  // 512-bit vector, so that one vpdpbusd does the work of two where the core has 512-bit
  // data paths. Code v of the window's byte b is column 4 b + v of its 256 columns; the
  // matching activations are step 2j's 32 bytes of code v, then step 2j + 1's.
  static constexpr bool has_q8k_wide = true;
  using W = __m512i;
  static W wzero() { return _mm512_setzero_si512(); }
  static W wload(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static W wcode(W w, int v) {
#if defined(__GFNI__)
    // (byte >> 2v) & 3 as one GF(2) affine map of each byte: output bit 0 is input bit 2v,
    // bit 1 is bit 2v + 1 (the matrix's byte 7 - i selects the input bits of output bit i)
    const uint64_t a = ((uint64_t)(1u << (2 * v)) << 56) | ((uint64_t)(1u << (2 * v + 1)) << 48);
    return v == 0 ? _mm512_and_si512(w, _mm512_set1_epi8(3))
                  : _mm512_gf2p8affine_epi64_epi8(w, _mm512_set1_epi64((long long)a), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(w, 2 * v), _mm512_set1_epi8(3));
#endif
  }
  static W wxload(const int8_t* x) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)x)),
                              _mm256_loadu_si256((const __m256i*)(x + 128)), 1);
  }
  static void wdot(W& a, W c, W x) { a = _mm512_dpbusd_epi32(a, c, x); }
  // lane i = the sum of all 16 lanes of a[i] (tsum8 for 512-bit accumulators): a transpose
  // and add within 128-bit lanes (pairs, then quads), then across them
  static __m256i wsum8(const W a[8]) {
    W p[4], q[2];
    for (int i = 0; i < 4; i++)
      p[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                              _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++)  // 128-bit lane l of q[i]: partial sums of a[4i .. 4i + 3]
      q[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(p[2 * i], p[2 * i + 1]),
                              _mm512_unpackhi_epi64(p[2 * i], p[2 * i + 1]));
    // [q0 lanes 0+1, q0 2+3, q1 0+1, q1 2+3], then [q0 all, q1 all] in the low 256 bits
    const W z = _mm512_add_epi32(_mm512_shuffle_i32x4(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_i32x4(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const W t = _mm512_add_epi32(_mm512_shuffle_i32x4(z, z, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_i32x4(z, z, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_castsi512_si256(t);
  }

  // q8k row panels (q8k.h rows_q8k_panels): lane r of a vector = row r of a 16-row panel,
  // whose words hold dword d of step s of each row (16 columns' codes); one token's 4
  // activations of code v are broadcast to every lane (vpdpbusd's memory operand {1to16}),
  // so a lane accumulates its row's whole segment and no horizontal sum is needed.
  static constexpr bool has_q8k_panel = true;
  using PF = __m512;  // 16 float lanes: the panel's rows
  static W pbcast(const int8_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
  }
  // The 8 words of one 32-byte step of 16 rows (w: the first row's step, rb bytes apart):
  // out + 64 d = dword d of rows 0-15. Rows r and r + 8 share a vector, an 8 x 8 dword
  // transpose runs in both halves at once, and the halves' 128-bit quarters are interleaved.
  static void ptranspose(const uint8_t* w, int64_t rb, uint8_t* out) {
    __m512i z[8], t[8], u[8];
    for (int i = 0; i < 8; i++)
      z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(w + i * rb))),
                                _mm256_loadu_si256((const __m256i*)(w + (i + 8) * rb)), 1);
    for (int i = 0; i < 8; i += 2)  // per 128-bit quarter: rows i, i + 1 interleaved
      t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    for (int i = 0; i < 8; i += 4) {  // quarter q of u[i + k]: dword (q odd: 4 +) k of 4 rows
      u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // dword k: quarters 0, 2 of u[k] (rows 0-3, 8-11) and of u[4 + k] (rows 4-7, 12-15);
    // dword 4 + k: their quarters 1, 3
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int k = 0; k < 4; k++) {
      _mm512_store_si512(out + 64 * k, _mm512_permutex2var_epi64(u[k], lo, u[4 + k]));
      _mm512_store_si512(out + 64 * (4 + k), _mm512_permutex2var_epi64(u[k], hi, u[4 + k]));
    }
  }
  static W pwload(const uint8_t* p) { return _mm512_load_si512(p); }
  static PF pzero() { return _mm512_setzero_ps(); }
  static PF pload(const float* p) { return _mm512_load_ps(p); }
  static void pstore(float* p, PF v) { _mm512_store_ps(p, v); }
  static void pstoreu(float* p, PF v) { _mm512_storeu_ps(p, v); }
  static PF padd(PF a, PF b) { return _mm512_add_ps(a, b); }
  // y + float(sumi - ssum) * (d * s), lane by lane (s: the 16 rows' scales; tstep_rows' order)
  static PF pstep(PF y, W sumi, int32_t ssum, float d, PF s) {
    const PF v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sumi, _mm512_set1_epi32(ssum)));
    return _mm512_add_ps(y, _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(d), s)));
  }
#endif

  // float path: F8 = 8 float lanes (16 registers, 32 where AVX-512 VL gives ymm16-31)
  using F8 = __m256;
#if defined(__AVX512VL__)
  static constexpr int f8regs = 32;
#else
  static constexpr int f8regs = 16;
#endif
  static F8 f8zero() { return _mm256_setzero_ps(); }
  static F8 f8add(F8 a, F8 b) { return _mm256_add_ps(a, b); }
  static F8 f8fmas(F8 acc, F8 a, float s) { return _mm256_fmadd_ps(a, _mm256_set1_ps(s), acc); }
  static float f8sum(F8 a) { return fvsum(a); }
  static F8 f8load(const float* p) { return _mm256_loadu_ps(p); }
  // f8load into a register that the FMAs using it share: without the empty asm GCC folds the
  // load into each FMA, one load per use (the attention's values: 20 loads per 16 FMAs)
  static F8 f8loadr(const float* p) {
    F8 v = _mm256_loadu_ps(p);
#if defined(__AVX512VL__)
    asm("" : "+v"(v));
#else
    asm("" : "+x"(v));
#endif
    return v;
  }
  // 8 float16 values (bits) as floats through F16C; NaN and infinity convert too (a
  // signalling NaN comes out quiet, unlike f16_to_f32)
  static F8 f8loadh(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  }
  static void f8store(float* p, F8 v) { _mm256_storeu_ps(p, v); }
  static F8 f8mul(F8 a, float s) { return _mm256_mul_ps(a, _mm256_set1_ps(s)); }
  static F8 f8fma(F8 a, F8 w, F8 x) { return _mm256_fmadd_ps(w, x, a); }
  static F8 f8set(float v) { return _mm256_set1_ps(v); }
  static F8 fma8(F8 a, F8 w, const float* x) { return _mm256_fmadd_ps(w, _mm256_loadu_ps(x), a); }
  static F8 f8max(F8 a, F8 b) { return _mm256_max_ps(a, b); }
  static float f8hmax(F8 a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  // lane u = the sum of a[u]'s lanes (a transpose and add)
  static F8 f8tsum(const F8 a[8]) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                         _mm256_permute2f128_ps(lo, hi, 0x31));
  }
  // t = c - 1 as floats, from bytes 0-7, 8-15, 16-23, 24-31 of a code vector
  static void fexpand(V c, F8 w[4]) {
    __m256i t = _mm256_sub_epi8(c, _mm256_set1_epi8(1));
    __m128i lo = _mm256_castsi256_si128(t), hi = _mm256_extracti128_si256(t, 1);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
  }
};

// llama.cpp tables (kernels/kquants.h): KqScalar's contract on AVX2 lanes
struct KqAvx2 {
  static constexpr const char* name = "avx2";
  using I8 = __m256i;
  using F8 = __m256;
  static I8 izero() { return _mm256_setzero_si256(); }
  // int16 products (|a q| <= 32 * 127), lanes i and i + 8 folded (then 16 more for N = 32):
  // at most 4 products per int16 before the widening, so no overflow.
  static __m256i prod16(const int8_t* a, const int8_t* q) {
    return _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)a)),
                              _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)q)));
  }
  template <int N>
  static I8 lanes(I8 acc, const int8_t* a, const int8_t* q, int32_t s) {
    __m256i p = prod16(a, q);
    if constexpr (N == 32) p = _mm256_add_epi16(p, prod16(a + 16, q + 16));
    __m128i f = _mm_add_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    return _mm256_add_epi32(
        acc, _mm256_mullo_epi32(_mm256_cvtepi16_epi32(f), _mm256_set1_epi32(s)));
  }
  static int32_t dot32(const int8_t* a, const int8_t* q) {
    __m256i s = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)a)),
                          _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)q))),
        _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(a + 16))),
                          _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + 16)))));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 1));
    return _mm_cvtsi128_si32(h);
  }
  static F8 scale_add(F8 sums, I8 aux, float d) {
    return _mm256_add_ps(sums, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(aux)));
  }
  static F8 fzero() { return _mm256_setzero_ps(); }
  static F8 fdot(F8 acc, const float* w, const float* x, int n) {
    for (int i = 0; i < n; i += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), acc);
    return acc;
  }
  static void fstore(F8 v, float* out) { _mm256_storeu_ps(out, v); }
};

// ---------------------------------------------------------------------------------------------
// llama.cpp's tables on AVX2: the same integer lanes as KqScalar's definition, computed on
// codes decoded straight into the kq_source order (qp) against the permuted activations
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// The kernels' AVX2 pieces (arch/scalar.h's portable namespace has their contracts)
// ---------------------------------------------------------------------------------------------

namespace x86 {

inline void cpu_pause() { _mm_pause(); }

// Cephes' expf on 8 lanes (kernels/activation.h describes it), inputs clamped to +-EXP_CLAMP.
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

// silu(g) * x over the whole vectors of [i0, i1); returns where the scalar tail starts.
inline int64_t silu_mul_head(const float* g, const float* x, float* out, int64_t i, int64_t i1) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= i1; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_xor_ps(gv, sign));
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(x + i)));
  }
  return i;
}

// scores[j] = exp(scores[j] - mx) over the whole vectors from j on, their sum added to
// `sum` (8 lanes, then in lane order); returns where the scalar tail starts.
inline int64_t softmax_exp_head(float* scores, int64_t j, int64_t n, float mx, float& sum) {
  __m256 acc8 = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 sv = _mm256_loadu_ps(scores + j);
    __m256 e = exp8(_mm256_sub_ps(sv, _mm256_set1_ps(mx)));
    // exp8 clamps its input: a dropped key (-inf) must weigh exactly 0, as std::exp gives
    e = _mm256_and_ps(e, _mm256_cmp_ps(sv, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
    _mm256_storeu_ps(scores + j, e);
    acc8 = _mm256_add_ps(acc8, e);
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, acc8);
  for (float p : part) sum += p;
  return j;
}

// max |x| over the whole vectors of x[0, n) into amax; returns where the scalar tail starts.
inline int64_t absmax_head(const float* x, int64_t n, float& amax) {
  int64_t i = 0;
  __m256 vm = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float v : lanes) amax = std::max(amax, v);
  return i;
}

// x = min(qmax, round_half_even(iscale * x)) over the whole vectors; returns the tail's start.
inline int64_t round_clamp_head(float* x, int64_t n, float iscale, float qmax) {
  int64_t i = 0;
  const __m256 vs = _mm256_set1_ps(iscale), vmax = _mm256_set1_ps(qmax);
  for (; i + 8 <= n; i += 8) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(vs, _mm256_loadu_ps(x + i)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_ps(x + i, _mm256_min_ps(r, vmax));
  }
  return i;
}

// One whole block of 256 floats as ggml's Q8_K codes at q, d (kernels/q8k.h q8k_block's values,
// 16 lanes at a time, or 8 without AVX-512: max |x| is exact in any order, the first column
// reaching it found by a compare mask, then q8k_block's multiply, half-to-even rounding and
// clamp); false where the block is shorter (q8k_block runs).
inline bool q8k_block_head(const float* x, int64_t n, int8_t* q, float& d) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (n != Q8K_BLOCK) return false;
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 vm = _mm512_setzero_ps();
  for (int i = 0; i < Q8K_BLOCK; i += 16) vm = _mm512_max_ps(vm, _mm512_andnot_ps(sign, _mm512_loadu_ps(x + i)));
  const float amax = _mm512_reduce_max_ps(vm);
  if (!(amax > 0.f)) {
    std::memset(q, 0, Q8K_BLOCK);
    d = 0.f;
    return true;
  }
  int top = 0;
  for (int i = 0; i < Q8K_BLOCK; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_andnot_ps(sign, _mm512_loadu_ps(x + i)),
                                            _mm512_set1_ps(amax), _CMP_EQ_OQ);
    if (eq) {
      top = i + __builtin_ctz(eq);
      break;
    }
  }
  const float iscale = -Q8K_QMAX / x[top];
  const __m512 vs = _mm512_set1_ps(iscale), vmax = _mm512_set1_ps(Q8K_QMAX);
  for (int i = 0; i < Q8K_BLOCK; i += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(vs, _mm512_loadu_ps(x + i)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i*)(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(r, vmax))));
  }
  d = 1.f / iscale;
  return true;
#else
  // 8 lanes: absmax_head's max (the scalar path's own), the first column reaching it through
  // a compare mask, round_clamp_head's multiply, rounding and clamp, packed to bytes
  if (n != Q8K_BLOCK) return false;
  float amax = 0.f;
  absmax_head(x, Q8K_BLOCK, amax);
  if (!(amax > 0.f)) {
    std::memset(q, 0, Q8K_BLOCK);
    d = 0.f;
    return true;
  }
  const __m256 sign = _mm256_set1_ps(-0.f), va = _mm256_set1_ps(amax);
  int top = 0;
  for (int i = 0; i < Q8K_BLOCK; i += 8) {
    const int eq = _mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), va, _CMP_EQ_OQ));
    if (eq) {
      top = i + __builtin_ctz(eq);
      break;
    }
  }
  const float iscale = -Q8K_QMAX / x[top];
  const __m256 vs = _mm256_set1_ps(iscale), vmax = _mm256_set1_ps(Q8K_QMAX);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < Q8K_BLOCK; i += 32) {
    __m256i r[4];
    for (int k = 0; k < 4; k++)
      r[k] = _mm256_cvtps_epi32(_mm256_min_ps(
          _mm256_round_ps(_mm256_mul_ps(vs, _mm256_loadu_ps(x + i + 8 * k)),
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          vmax));
    // packs work within 128-bit halves: dwords come out as 0 2 4 6 | 1 3 5 7 of 4-byte groups
    const __m256i b =
        _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256((__m256i*)(q + i), _mm256_permutevar8x32_epi32(b, order));
  }
  d = 1.f / iscale;
  return true;
#endif
}

// The sum of the int8 values q[0, n) over the whole 64-byte vectors (32-byte without AVX-512)
// into sum; returns where the scalar tail starts.
inline int64_t sum_i8_head(const int8_t* q, int64_t n, int32_t& sum) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512i acc = _mm512_setzero_si512();  // sums of 8 bytes q + 128, per 64-bit lane
  const __m512i flip = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
  for (; i + 64 <= n; i += 64)
    acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_xor_si512(_mm512_loadu_si512(q + i), flip), zero));
  sum += (int32_t)(_mm512_reduce_add_epi64(acc) - 128 * i);
#else
  __m256i acc = _mm256_setzero_si256();  // sums of 8 bytes q + 128, per 64-bit lane
  const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
  for (; i + 32 <= n; i += 32)
    acc = _mm256_add_epi64(
        acc, _mm256_sad_epu8(_mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(q + i)), flip), zero));
  alignas(32) int64_t lanes[4];
  _mm256_store_si256((__m256i*)lanes, acc);
  sum += (int32_t)(lanes[0] + lanes[1] + lanes[2] + lanes[3] - 128 * i);
#endif
  return i;
}

// Fast packing's activation order (kernels/q8k.h fast_order) for the whole 128-column steps;
// returns the positions written.
inline int64_t fast_order_head(const int8_t* c, int64_t k, int8_t* q) {
  int64_t s = 0;
  // per 16 columns: bytes grouped by v (4 each), then a 4 x 4 transpose of those dwords
  const __m128i by_v = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (; 128 * (s + 1) <= k; s++) {
    for (int half = 0; half < 2; half++) {
      __m128i y[4];
      for (int i = 0; i < 4; i++)
        y[i] = _mm_shuffle_epi8(
            _mm_loadu_si128((const __m128i*)(c + 128 * s + 64 * half + 16 * i)), by_v);
      __m128i a0 = _mm_unpacklo_epi32(y[0], y[1]), a1 = _mm_unpackhi_epi32(y[0], y[1]);
      __m128i a2 = _mm_unpacklo_epi32(y[2], y[3]), a3 = _mm_unpackhi_epi32(y[2], y[3]);
      __m128i t[4] = {_mm_unpacklo_epi64(a0, a2), _mm_unpackhi_epi64(a0, a2),
                      _mm_unpacklo_epi64(a1, a3), _mm_unpackhi_epi64(a1, a3)};
      for (int v = 0; v < 4; v++)
        _mm_storeu_si128((__m128i*)(q + 128 * s + 32 * v + 16 * half), t[v]);
    }
  }
  return 128 * s;
}

// Eight float16 values as float32 when none is NaN or infinite (exact); false otherwise.
inline bool f16x8_finite_to_f32(const uint16_t* v, float* out) {
  const __m128i hv = _mm_loadu_si128((const __m128i*)v);
  const __m128i ex = _mm_set1_epi16(0x7C00);
  if (_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(hv, ex), ex)) != 0) return false;
  _mm256_storeu_ps(out, _mm256_cvtph_ps(hv));
  return true;
}

// dst[i] = src[i] (float16 bits) as float32 over the whole vectors of [0, n) (Avx2Ops::f8loadh);
// returns where the scalar tail starts.
inline int64_t f16_widen_head(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, Avx2Ops::f8loadh(src + i));
  return i;
}

// An 8 x 8 block of float16 values - 8 rows of 8 (row r at v + r * stride) - transposed into
// float32, out + 8 j = value j of rows 0-7, when none is NaN or infinite (exact); false
// otherwise (nothing written). Kernels/q8k.h block_scales8: a decode block's scales, 8
// segments at a time.
inline bool f16x8x8_finite_to_f32(const uint16_t* v, int64_t stride, float* out) {
  __m128i a[8];
  const __m128i ex = _mm_set1_epi16(0x7C00);
  __m128i bad = _mm_setzero_si128();
  for (int r = 0; r < 8; r++) {
    a[r] = _mm_loadu_si128((const __m128i*)(v + r * stride));
    bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(a[r], ex), ex));
  }
  if (!_mm_testz_si128(bad, bad)) return false;
  __m128i t[8], u[8];
  for (int i = 0; i < 4; i++)  // rows 2i, 2i + 1 interleaved: values 0-3, then 4-7
    t[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]),
    t[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  for (int h = 0; h < 2; h++)  // rows 4h .. 4h + 3: values (0, 1), (2, 3), (4, 5), (6, 7)
    for (int i = 0; i < 2; i++)
      u[4 * h + 2 * i] = _mm_unpacklo_epi32(t[4 * h + i], t[4 * h + 2 + i]),
      u[4 * h + 2 * i + 1] = _mm_unpackhi_epi32(t[4 * h + i], t[4 * h + 2 + i]);
  for (int k = 0; k < 4; k++) {  // values 2k, 2k + 1 of rows 0-7
    _mm256_storeu_ps(out + 16 * k, _mm256_cvtph_ps(_mm_unpacklo_epi64(u[k], u[4 + k])));
    _mm256_storeu_ps(out + 16 * k + 8, _mm256_cvtph_ps(_mm_unpackhi_epi64(u[k], u[4 + k])));
  }
  return true;
}

// ---- the dense kernel (kernels/dense.h): tiles of R rows x T tokens, C vector accumulators per
// (row, token) (C = CHAINS: 1 on AVX-512, 2 on AVX2). A (row, token)'s sum is C chains - chain c
// takes the row's whole W-lane vectors c, c + C, c + 2C, ..., its lane l adding their column by
// FMA in order - then the chains added in order, the W lanes summed, the tail columns added in
// order: whatever R and T are, so a row of y depends neither on the tokens sharing the call nor
// on its tile's rows. The tile reads each weight vector once for its T tokens (the 8
// sequences of a batched decode step read the table once, in passes of up to DENSE_TOKENS)
// and each activation vector once for its R rows. One token takes dense_rows_one() rows side
// by side. AMD's Zen 4 reads one row at a time, a single linear stream, at 24 GB/s on one
// thread where 2, 4 or 8 interleaved rows read at 12-15 (a 128256 x 2560 float16 table: 27.5
// ms against 46-55), and a software prefetch 4 KB ahead only cost time (29-39 ms against 28-29
// without, for the previous kernel too). Intel's cores are the other way round: their L2
// streamer stops at each 4 KB page, and a 2048-column float16 row is one page, so one row at a
// time keeps one page's stream in flight (an Emerald Rapids Xeon, 32000 x 2048 float16, 2
// threads, from memory: 1 row 6.6 ms, 2 rows 5.7, 4 rows 5.9; from its L3: 5.5, 4.3, 3.3; a
// whole decode step 1.21x as fast with 4 rows, 1.11x with 2). From 2 tokens on, the rows'
// shared activation loads win.

#if defined(__AVX512F__)
constexpr const char* DENSE_ISA = "avx512-f16c";  // 16 lanes (cores with 512-bit data paths)
constexpr int DENSE_TOKENS = 8;
#else
constexpr const char* DENSE_ISA = "avx2-f16c";
constexpr int DENSE_TOKENS = 3;
#endif

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

// 8 lanes, 16 registers: R x T accumulators + R weight vectors + 1 activation vector
struct DenseYmm {
  using V = __m256;
  static constexpr int W = 8;
  template <int WD>
  static V load(const void* w, int64_t i) { return load8<WD>(w, i); }
  static V loadx(const float* x) { return _mm256_loadu_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V v) { return hsum8(v); }
  // Two chains a row: one 8-lane chain waits on its FMA's latency (16 GB/s on one thread),
  // and one token's rows side by side are streams that this Zen 4 reads slower than one (8 rows
  // of one chain: 32000 x 2048 float16, 2 threads, 3.6-4.1 ms; one row of two: 3.0-3.6). Then
  // 2 x R x T accumulators in 16 registers: up to 3 tokens a pass (DENSE_TOKENS).
  static constexpr int CHAINS = 2;
  static constexpr int rows(int t) { return t == 1 ? 1 : t == 2 ? 3 : 2; }
};

#if defined(__AVX512F__)
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

// 16 lanes, 32 registers
struct DenseZmm {
  using V = __m512;
  static constexpr int W = 16;
  template <int WD>
  static V load(const void* w, int64_t i) { return load16<WD>(w, i); }
  static V loadx(const float* x) { return _mm512_loadu_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static constexpr int CHAINS = 1;
  static constexpr int rows(int t) { return t == 1 ? 1 : t <= 6 ? 4 : 3; }
};
using DenseVec = DenseZmm;
#else
using DenseVec = DenseYmm;
#endif

// Rows n .. n + R - 1, tokens m0 .. m0 + T - 1.
template <class D, int WD, int R, int T, class DL>
inline void dense_tile(const DL& L, int64_t n, int64_t m0) {
  constexpr int C = D::CHAINS;
  const int64_t k = L.k, nv = k / D::W, kv = nv * D::W;
  const float* x = L.x + m0 * k;
  using V = typename D::V;
  V acc[C][R][T];
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++)
      for (int t = 0; t < T; t++) acc[c][r][t] = D::zero();
  auto vec = [&](V (&a)[R][T], int64_t i) {  // the weight vectors at column i into a
    V wv[R];
    for (int r = 0; r < R; r++) wv[r] = D::template load<WD>(L.w, (n + r) * k + i);
    for (int t = 0; t < T; t++) {
      V xv = D::loadx(x + t * k + i);
      asm("" : "+v"(xv));  // one load for the R rows (the compiler would fold it into each FMA)
      for (int r = 0; r < R; r++) a[r][t] = D::fma(wv[r], xv, a[r][t]);
    }
  };
  int64_t j = 0;  // vector j into chain j % C
  for (; j + C <= nv; j += C)
    for (int c = 0; c < C; c++) vec(acc[c], (j + c) * D::W);
  for (int c = 0; j + c < nv; c++) vec(acc[c], (j + c) * D::W);  // the last nv % C vectors
  for (int r = 0; r < R; r++)
    for (int t = 0; t < T; t++) {
      V s = acc[0][r][t];
      for (int c = 1; c < C; c++) s = D::add(s, acc[c][r][t]);
      float y = D::sum(s);
      for (int64_t i = kv; i < k; i++) y += load_as_f32(L.w, WD, (n + r) * k + i) * x[t * k + i];
      store_from_f32(L.out, L.out_dtype, (m0 + t) * L.n + n + r, y);
    }
}

// Rows a one-token pass reads side by side: 4 on Intel's cores, 1 elsewhere (above). The rows
// of a tile do not change any row's sum, so this choice changes no result.
inline int dense_rows_one() {
  static const int rows = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __cpuid(0, a, b, c, d);
    char vendor[13] = {0};
    std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
    return std::strcmp(vendor, "GenuineIntel") == 0 ? 4 : 1;
  }();
  return rows;
}

template <int WD, int T, int R, class DL>
void dense_rows_of(const DL& L, int64_t n0, int64_t n1, int64_t m0) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) dense_tile<DenseVec, WD, R, T>(L, n, m0);
  for (; n < n1; n++) dense_tile<DenseVec, WD, 1, T>(L, n, m0);
}

// Rows [n0, n1), tokens m0 .. m0 + T - 1 (T <= DENSE_TOKENS): whole tiles, then single rows
// (one token: L.rows_one rows a tile where set, else dense_rows_one()).
template <int WD, int T, class DL>
void dense_block(const DL& L, int64_t n0, int64_t n1, int64_t m0) {
  if constexpr (T == 1) {
    const int r = L.rows_one ? L.rows_one : dense_rows_one();
    if (r == 4) return dense_rows_of<WD, 1, 4>(L, n0, n1, m0);
    if (r == 2) return dense_rows_of<WD, 1, 2>(L, n0, n1, m0);
  }
  dense_rows_of<WD, T, DenseVec::rows(T)>(L, n0, n1, m0);
}

// ---- llama.cpp's tables (kernels/kquants.h ggml_rows): a tile of tokens in kqx's rows;
// false where kqx has none (Q8_0 with float numerics: the generic loop)
inline bool ggml_tile(const GgmlLayer& L, bool llama, int64_t m0, int64_t m1, int64_t n0,
                      int64_t n1) {
  if (llama) return kqx::rows_llama(L, m0, m1, n0, n1), true;
  return kqx::rows_float_k(L, m0, m1, n0, n1);
}

}  // namespace x86

}  // namespace tk
