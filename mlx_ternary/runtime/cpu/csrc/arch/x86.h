// x86-64 ternary inner operations: AVX2 (+ FMA), with the VNNI dot product where the CPU has
// it (AVX-VNNI, or AVX-512 VNNI on 256-bit vectors). Same contract as arch/scalar.h.
//
// Integer dot: unsigned codes c in {0,1,2} times signed int8 activations. AVX2 has no 8-bit
// multiply-accumulate, so pmaddubsw (u8 x s8 -> pairwise s16; |sum| <= 2*2*128 per pair, no
// saturation) feeds pmaddwd against ones (-> s32). VNNI does the same in one vpdpbusd.
// The -1 of t = c - 1 is applied once per row/group as - sum(x) (kernels/layer.h).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

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
    __m256i h01 = _mm256_hadd_epi32(w[0], w[1]), h23 = _mm256_hadd_epi32(w[2], w[3]);
    __m256i h45 = _mm256_hadd_epi32(w[4], w[5]), h67 = _mm256_hadd_epi32(w[6], w[7]);
    __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                            _mm256_permute2x128_si256(lo, hi, 0x31));
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
  // q8k.h rows_q8k_r8: lane r = row r of one token: y + float(sumi - ssum) * (d * s8)
  static FV tstep_rows(FV y, __m256i sumi, int32_t ssum, float d, const float* s8) {
    __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, _mm256_set1_epi32(ssum)));
    return _mm256_add_ps(y, _mm256_mul_ps(v, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(s8))));
  }
  static void fvstore(float* p, FV v) { _mm256_storeu_ps(p, v); }

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
#endif

  // float path: F8 = 8 float lanes
  using F8 = __m256;
  static F8 f8zero() { return _mm256_setzero_ps(); }
  static F8 f8add(F8 a, F8 b) { return _mm256_add_ps(a, b); }
  static F8 f8fmas(F8 acc, F8 a, float s) { return _mm256_fmadd_ps(a, _mm256_set1_ps(s), acc); }
  static float f8sum(F8 a) { return fvsum(a); }
  static F8 f8load(const float* p) { return _mm256_loadu_ps(p); }
  static void f8store(float* p, F8 v) { _mm256_storeu_ps(p, v); }
  static F8 f8mul(F8 a, float s) { return _mm256_mul_ps(a, _mm256_set1_ps(s)); }
  static F8 f8fma(F8 a, F8 w, F8 x) { return _mm256_fmadd_ps(w, x, a); }
  static F8 f8set(float v) { return _mm256_set1_ps(v); }
  static F8 fma8(F8 a, F8 w, const float* x) { return _mm256_fmadd_ps(w, _mm256_loadu_ps(x), a); }
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

}  // namespace tk
