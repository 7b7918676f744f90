// arm64 ternary inner operations: NEON, with the SDOT dot product where the CPU has it
// (ARMv8.2 dotprod: every Apple M-series core). Same contract as arch/scalar.h; a 32-byte
// step is two 16-byte registers, the first holding bytes 0-15 ("lo").
//
// Codes c in {0,1,2} are valid signed bytes, so sdot multiplies them with the int8
// activations directly; lane j of sdot sums bytes 4j..4j+3, the lane map of the contract.
#pragma once

#include <arm_neon.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../kernels/layer.h"  // dtypes, their conversions, PREFETCH_BYTES
#include "scalar.h"            // the contracts, and the portable pieces NEON lacks

namespace tk {

struct NeonOps {
#if defined(__ARM_FEATURE_DOTPROD) && defined(__ARM_FEATURE_MATMUL_INT8)
  static constexpr const char* name = "neon-dotprod-i8mm";
#elif defined(__ARM_FEATURE_DOTPROD)
  static constexpr const char* name = "neon-dotprod";
#else
  static constexpr const char* name = "neon";
#endif
  struct V { uint8x16_t lo, hi; };
  struct IA { int32x4_t lo, hi; };
  struct FV { float32x4_t lo, hi; };

  static V load(const uint8_t* p) { return V{vld1q_u8(p), vld1q_u8(p + 16)}; }
  static V load_tail(const uint8_t* p, int n) {
    uint8_t buf[32] = {0};
    std::memcpy(buf, p, n);
    return load(buf);
  }
  static void fast4(const V& w, V c[4]) {
    const uint8x16_t m3 = vdupq_n_u8(3);
    c[0] = V{vandq_u8(w.lo, m3), vandq_u8(w.hi, m3)};
    c[1] = V{vandq_u8(vshrq_n_u8(w.lo, 2), m3), vandq_u8(vshrq_n_u8(w.hi, 2), m3)};
    c[2] = V{vandq_u8(vshrq_n_u8(w.lo, 4), m3), vandq_u8(vshrq_n_u8(w.hi, 4), m3)};
    c[3] = V{vshrq_n_u8(w.lo, 6), vshrq_n_u8(w.hi, 6)};
  }
  static uint8x16_t digit(uint8x16_t q) {
    // [q >= 86] + [q >= 171]: each compare is 0xFF or 0; >> 7 makes it 1 or 0.
    return vaddq_u8(vshrq_n_u8(vcgeq_u8(q, vdupq_n_u8(86)), 7),
                    vshrq_n_u8(vcgeq_u8(q, vdupq_n_u8(171)), 7));
  }
  static void base3(V q, V c[5]) {
    const uint8x16_t three = vdupq_n_u8(3);
    for (int i = 0; i < 5; i++) {
      c[i] = V{digit(q.lo), digit(q.hi)};
      if (i < 4) q = V{vmulq_u8(q.lo, three), vmulq_u8(q.hi, three)};
    }
  }

  static IA izero() { return IA{vdupq_n_s32(0), vdupq_n_s32(0)}; }
  static int32x4_t dot16(int32x4_t a, uint8x16_t c, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(a, vreinterpretq_s8_u8(c), x);
#else
    // Lane j gets bytes 4j..4j+3, as sdot fills it (pairs of products in int16, |sum| <= 512,
    // then pairs of pairs): group-scaled layers flush lanes with their own scales, so the
    // order must be one.
    const int8x16_t cs = vreinterpretq_s8_u8(c);
    const int16x8_t lo = vmull_s8(vget_low_s8(cs), vget_low_s8(x));
    return vpadalq_s16(a, vpaddq_s16(lo, vmull_high_s8(cs, x)));
#endif
  }
  template <int NV>
  static void idot(IA& a, const V* c, const int8_t* x) {
    for (int v = 0; v < NV; v++) {
      a.lo = dot16(a.lo, c[v].lo, vld1q_s8(x + 32 * v));
      a.hi = dot16(a.hi, c[v].hi, vld1q_s8(x + 32 * v + 16));
    }
  }
  static int32_t isum(const IA& a) { return vaddvq_s32(vaddq_s32(a.lo, a.hi)); }
  static FV fvzero() { return FV{vdupq_n_f32(0), vdupq_n_f32(0)}; }
  static void iflush(IA& a, FV& f, float lo, float hi) {
    f.lo = vfmaq_n_f32(f.lo, vcvtq_f32_s32(a.lo), lo);
    f.hi = vfmaq_n_f32(f.hi, vcvtq_f32_s32(a.hi), hi);
    a = izero();
  }
  static float fvsum(const FV& f) { return vaddvq_f32(vaddq_f32(f.lo, f.hi)); }

  // q8k tiles (q8k.h rows_q8k_tile: 2 rows x 4 tokens; rows_q8k_r8: 8 rows x 1 token), with
  // SDOT where the CPU has it: one accumulator of 4 int32 lanes per (row, token), reduced at a
  // segment's end to one lane each (integer sums: exact in any order); the float32 epilogue
  // as x86's, lane by lane.
  static constexpr bool has_q8k_tile = true;
  using TA = int32x4_t;
  static TA tzero() { return vdupq_n_s32(0); }
  static V code(const V& w, int v) {
    const int8x16_t sh = vdupq_n_s8((int8_t)(-2 * v));
    const uint8x16_t m3 = vdupq_n_u8(3);
    return V{vandq_u8(vshlq_u8(w.lo, sh), m3), vandq_u8(vshlq_u8(w.hi, sh), m3)};
  }
  static V xload(const int8_t* x) { return load((const uint8_t*)x); }
  static void tdot(TA& a, const V& c, const V& x) {
    a = dot16(dot16(a, c.lo, vreinterpretq_s8_u8(x.lo)), c.hi, vreinterpretq_s8_u8(x.hi));
  }
  // lane i = the sum of all lanes of a[i]; a[] is reset to zero
  static IA tsum8(TA a[8]) {
    const IA r{vpaddq_s32(vpaddq_s32(a[0], a[1]), vpaddq_s32(a[2], a[3])),
               vpaddq_s32(vpaddq_s32(a[4], a[5]), vpaddq_s32(a[6], a[7]))};
    for (int i = 0; i < 8; i++) a[i] = tzero();
    return r;
  }
  // y + float(sumi - ssum) * (d * s): lanes 0-3 row 0 (tokens 0-3), lanes 4-7 row 1
  static FV tstep(FV y, const IA& sumi, const int32_t* ssum4, const float* d4, float s0,
                  float s1) {
    const int32x4_t ss = vld1q_s32(ssum4);
    const float32x4_t d = vld1q_f32(d4);
    const float32x4_t vlo = vcvtq_f32_s32(vsubq_s32(sumi.lo, ss));
    const float32x4_t vhi = vcvtq_f32_s32(vsubq_s32(sumi.hi, ss));
    return FV{vaddq_f32(y.lo, vmulq_f32(vlo, vmulq_n_f32(d, s0))),
              vaddq_f32(y.hi, vmulq_f32(vhi, vmulq_n_f32(d, s1)))};
  }
  // lane r = row r of one token: y + float(sumi - ssum) * (d * s8)
  static FV tstep_rows(FV y, const IA& sumi, int32_t ssum, float d, const float* s8) {
    const int32x4_t ss = vdupq_n_s32(ssum);
    const float32x4_t vlo = vcvtq_f32_s32(vsubq_s32(sumi.lo, ss));
    const float32x4_t vhi = vcvtq_f32_s32(vsubq_s32(sumi.hi, ss));
    return FV{vaddq_f32(y.lo, vmulq_f32(vlo, vmulq_n_f32(vld1q_f32(s8), d))),
              vaddq_f32(y.hi, vmulq_f32(vhi, vmulq_n_f32(vld1q_f32(s8 + 4), d)))};
  }
  static void fvstore(float* p, const FV& v) { vst1q_f32(p, v.lo), vst1q_f32(p + 4, v.hi); }
  // kernels/ternary.h rows_int8_r8: int32 sums of 8 rows (lane = row) added up, and their
  // epilogue ((float)(sumi - gsum) * s8) * xs, lane by lane (x86's operations and order)
  static IA tadd(const IA& a, const IA& b) {
    return IA{vaddq_s32(a.lo, b.lo), vaddq_s32(a.hi, b.hi)};
  }
  static FV int8_rows(const IA& sumi, int32_t gsum, const float* s8, float xs) {
    const int32x4_t gs = vdupq_n_s32(gsum);
    const float32x4_t vlo = vcvtq_f32_s32(vsubq_s32(sumi.lo, gs));
    const float32x4_t vhi = vcvtq_f32_s32(vsubq_s32(sumi.hi, gs));
    return FV{vmulq_n_f32(vmulq_f32(vlo, vld1q_f32(s8)), xs),
              vmulq_n_f32(vmulq_f32(vhi, vld1q_f32(s8 + 4)), xs)};
  }

#if defined(__ARM_FEATURE_MATMUL_INT8)
  // i8mm (SMMLA) prefill tiles of 4 rows x 4 tokens (Q8K_TILE_TOKENS): q8k (kernels/q8k.h rows_q8k_tiled hands
  // its token tiles to q8k_mmla_tile) and per-token int8 with tensor or row scales
  // (kernels/ternary.h rows_all: int8_mmla_rows). SMMLA multiplies 8 bytes of two rows with
  // 8 bytes of two tokens into 2 x 2 int32 sums: twice SDOT's products an instruction. Each
  // step pairs the rows' bytes once (8 of row 2q, then 8 of row 2q + 1; the codes are
  // bytewise, so they decode paired) and each token tile pairs its activations once
  // (pair_tokens). The int32 sums are exact in any order and the epilogues are the SDOT
  // tile's tstep and rows_int's, lane by lane: the same bits as every other path.
  static constexpr bool has_mmla = true;
  // lanes (row 2q, token 2p), (2q, 2p + 1), (2q + 1, 2p), (2q + 1, 2p + 1) of row pair q and
  // token pair p
  using MA = int32x4_t;
  static int8x16_t zip64(uint8x16_t a, uint8x16_t b, bool hi) {
    const uint64x2_t x = vreinterpretq_u64_u8(a), y = vreinterpretq_u64_u8(b);
    return vreinterpretq_s8_u64(hi ? vzip2q_u64(x, y) : vzip1q_u64(x, y));
  }
  // row 2q's sums (lanes 0-3: tokens 0-3) and row 2q + 1's (lanes 4-7), from token pairs 0, 1
  static IA mmla_rows2(const MA a[2]) {
    const int64x2_t x = vreinterpretq_s64_s32(a[0]), y = vreinterpretq_s64_s32(a[1]);
    return IA{vreinterpretq_s32_s64(vzip1q_s64(x, y)), vreinterpretq_s32_s64(vzip2q_s64(x, y))};
  }
  template <int V>
  static int8x16_t mcode(int8x16_t w) {  // (w >> 2V) & 3, bytewise
    const uint8x16_t u = vreinterpretq_u8_s8(w);
    if constexpr (V == 0) return vreinterpretq_s8_u8(vandq_u8(u, vdupq_n_u8(3)));
    else if constexpr (V == 3) return vreinterpretq_s8_u8(vshrq_n_u8(u, 6));
    else return vreinterpretq_s8_u8(vandq_u8(vshrq_n_u8(u, 2 * V), vdupq_n_u8(3)));
  }
  // Tokens m0 .. m0 + 3 (the last of `valid` repeated) as two pairs at out, 2 xlen bytes
  // each: for every 8 activations, token 2p's, then token 2p + 1's.
  static void pair_tokens(const Acts& a, int64_t xlen, int64_t m0, int valid, int8_t* out) {
    for (int p = 0; p < 2; p++) {
      const int8_t* x0 = a.q.data() + (m0 + std::min(2 * p, valid - 1)) * xlen;
      const int8_t* x1 = a.q.data() + (m0 + std::min(2 * p + 1, valid - 1)) * xlen;
      int8_t* o = out + 2 * xlen * p;
      for (int64_t k = 0; k < xlen; k += 8)
        vst1q_s8(o + 2 * k, vcombine_s8(vld1_s8(x0 + k), vld1_s8(x1 + k)));
    }
  }
  // code V of the paired rows times the paired tokens, at activation position off + 32 V
  template <int V, int RP>
  static void mmla_code(MA (&acc)[RP][2], const int8x16_t (&wp)[RP][4], const int8_t* xp,
                        int64_t xlen, int64_t off) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {  // bytes 8j .. 8j + 7 of the step: positions 32 V + 8 j ...
      const int8_t* x = xp + 2 * (off + 32 * V + 8 * j);
      const int8x16_t x0 = vld1q_s8(x), x1 = vld1q_s8(x + 2 * xlen);
#pragma GCC unroll 2
      for (int q = 0; q < RP; q++) {
        const int8x16_t c = mcode<V>(wp[q][j]);
        acc[q][0] = vmmlaq_s32(acc[q][0], c, x0);
        acc[q][1] = vmmlaq_s32(acc[q][1], c, x1);
      }
    }
  }
  // Rows row[0 .. 2 RP) (their partial last steps zero-padded in tail, 32 bytes a row) against
  // the paired tokens xp: flush(acc, seg) at the end of each q8k segment (SEGMENTS) or of the
  // row, the accumulators zeroed after it.
  template <int RP, bool SEGMENTS, class Flush>
  static void mmla_block(const Geometry& g, const uint8_t* const* row, const uint8_t* tail,
                         const int8_t* xp, Flush&& flush) {
    const int64_t nsteps = (int64_t)g.steps.size(), xlen = g.xlen();
    MA acc[RP][2];
    for (int q = 0; q < RP; q++) acc[q][0] = acc[q][1] = vdupq_n_s32(0);
    for (int64_t s = 0; s < nsteps; s++) {
      const Step& st = g.steps[s];
      int8x16_t wp[RP][4];
#pragma GCC unroll 2
      for (int q = 0; q < RP; q++) {
        const uint8_t *p0 = tail + 64 * q, *p1 = p0 + 32;
        if (st.valid == 32) {
          p0 = row[2 * q] + st.off, p1 = row[2 * q + 1] + st.off;
          __builtin_prefetch(p0 + PREFETCH_BYTES), __builtin_prefetch(p1 + PREFETCH_BYTES);
        }
        const uint8x16_t a0 = vld1q_u8(p0), a1 = vld1q_u8(p0 + 16);
        const uint8x16_t b0 = vld1q_u8(p1), b1 = vld1q_u8(p1 + 16);
        wp[q][0] = zip64(a0, b0, false), wp[q][1] = zip64(a0, b0, true);
        wp[q][2] = zip64(a1, b1, false), wp[q][3] = zip64(a1, b1, true);
      }
      const int64_t off = 128 * s;
      mmla_code<0, RP>(acc, wp, xp, xlen, off);
      mmla_code<1, RP>(acc, wp, xp, xlen, off);
      mmla_code<2, RP>(acc, wp, xp, xlen, off);
      mmla_code<3, RP>(acc, wp, xp, xlen, off);
      if (SEGMENTS ? st.seg >= 0 : s + 1 == nsteps) {
        flush(acc, st.seg);
        for (int q = 0; q < RP; q++) acc[q][0] = acc[q][1] = vdupq_n_s32(0);
      }
    }
  }
  // Rows [n, n + 2 RP) of [n, n1) (past n1: row n1 - 1 again, not stored), with the
  // zero-padded partial last steps of the rows in tail; returns the rows stored.
  template <int RP>
  static int mmla_rows(const Geometry& g, const uint8_t* w, int64_t n, int64_t n1,
                       const uint8_t* row[2 * RP], uint8_t* tail) {
    const Step& last = g.steps.back();
    for (int r = 0; r < 2 * RP; r++) {
      row[r] = w + std::min(n + r, n1 - 1) * g.row_bytes;
      if (last.valid != 32) {
        std::memset(tail + 32 * r, 0, 32);
        std::memcpy(tail + 32 * r, row[r] + last.off, last.valid);
      }
    }
    return (int)std::min<int64_t>(2 * RP, n1 - n);
  }
  // Outputs of rows n + 2q, n + 2q + 1 (lanes 0-3 / 4-7 of y: tokens m0 ..) with their biases,
  // the first `valid` tokens and `rows` rows from n
  static void mmla_store(const Layer& L, int64_t n, int q, int rows, int64_t m0, int valid,
                         const FV& y) {
    const int64_t N = L.g.n, i = m0 * N + n + 2 * q;
    if (L.out_dtype == F32 && 2 * q + 1 < rows) {
      // float32 and both rows: each token's two outputs are adjacent, one 64-bit store
      const float32x2_t b = {L.bias_at(n + 2 * q), L.bias_at(n + 2 * q + 1)};
      const float32x4_t bb = vcombine_f32(b, b);
      const float32x4_t t01 = vaddq_f32(vzip1q_f32(y.lo, y.hi), bb);  // (row, token) 00 10 01 11
      const float32x4_t t23 = vaddq_f32(vzip2q_f32(y.lo, y.hi), bb);
      const float32x2_t part[4] = {vget_low_f32(t01), vget_high_f32(t01), vget_low_f32(t23),
                                   vget_high_f32(t23)};
      for (int t = 0; t < valid; t++) vst1_f32((float*)L.out + i + t * N, part[t]);
      return;
    }
    alignas(16) float out[8];
    fvstore(out, y);
    for (int r = 0; r < 2 && 2 * q + r < rows; r++) {
      const float b = L.bias_at(n + 2 * q + r);
      for (int t = 0; t < valid; t++) store_from_f32(L.out, L.out_dtype, i + r + t * N, out[4 * r + t] + b);
    }
  }
  // q8k: rows [n0, n1) for tokens m0 .. m0 + valid - 1, rows_q8k_tile's contract (seg4, d4:
  // the 4 lanes' segment sums and block scales per segment; sc: the rows' scales per segment)
  template <int RP>
  static void q8k_mmla(const Layer& L, int64_t n0, int64_t n, int64_t n1, int64_t m0, int valid,
                       const int8_t* xp, const int32_t* seg4, const float* d4, const float* sc,
                       int64_t nsc) {
    const Geometry& g = L.g;
    const uint8_t* row[2 * RP];
    alignas(16) uint8_t tail[64 * RP];
    const int rows = mmla_rows<RP>(g, L.w, n, n1, row, tail);
    FV y[RP];
    for (int q = 0; q < RP; q++) y[q] = fvzero();
    mmla_block<RP, true>(g, row, tail, xp, [&](MA(&acc)[RP][2], int32_t seg) {
      for (int q = 0; q < RP; q++) {
        const int64_t r0 = std::min(n + 2 * q, n1 - 1) - n0, r1 = std::min(n + 2 * q + 1, n1 - 1) - n0;
        y[q] = tstep(y[q], mmla_rows2(acc[q]), seg4 + Q8K_TILE_TOKENS * seg,
                     d4 + Q8K_TILE_TOKENS * g.seg_block[seg], sc[r0 * nsc + seg], sc[r1 * nsc + seg]);
      }
    });
    for (int q = 0; q < RP; q++) mmla_store(L, n, q, rows, m0, valid, y[q]);
  }
  static void q8k_mmla_tile(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0,
                            int valid, const int32_t* seg4, const float* d4, const float* sc,
                            int64_t nsc) {
    thread_local std::vector<int8_t> pairs;
    pairs.resize(4 * L.g.xlen());
    int8_t* xp = pairs.data();
    pair_tokens(a, L.g.xlen(), m0, valid, xp);
    for (int64_t n = n0; n < n1; n += 4)
      if (n1 - n > 2) q8k_mmla<2>(L, n0, n, n1, m0, valid, xp, seg4, d4, sc, nsc);
      else q8k_mmla<1>(L, n0, n, n1, m0, valid, xp, seg4, d4, sc, nsc);
  }
  // Per-token int8, tensor or row scales: all M tokens of rows [n0, n1), rows_int's epilogue
  // ((float)(sum - gsum) * s) * x_scale + bias lane by lane.
  static void int8_mmla_rows(const Layer& L, const Acts& a, int64_t M, int64_t n0, int64_t n1) {
    const Geometry& g = L.g;
    thread_local std::vector<int8_t> pairs;
    pairs.resize(4 * g.xlen());
    int8_t* xp = pairs.data();
    for (int64_t m0 = 0; m0 < M; m0 += Q8K_TILE_TOKENS) {
      const int valid = (int)std::min<int64_t>(Q8K_TILE_TOKENS, M - m0);
      pair_tokens(a, g.xlen(), m0, valid, xp);
      alignas(16) int32_t gs[Q8K_TILE_TOKENS];
      alignas(16) float xs[Q8K_TILE_TOKENS];
      for (int t = 0; t < Q8K_TILE_TOKENS; t++) {
        const int64_t m = m0 + std::min(t, valid - 1);
        gs[t] = a.gsum[m * g.ngroups], xs[t] = a.xs[m];
      }
      const int32x4_t gs4 = vld1q_s32(gs);
      const float32x4_t xs4 = vld1q_f32(xs);
      for (int64_t n = n0; n < n1; n += 4) {
        const uint8_t* row[4];
        alignas(16) uint8_t tail[128];
        const int rows = mmla_rows<2>(g, L.w, n, n1, row, tail);
        FV y[2];
        mmla_block<2, false>(g, row, tail, xp, [&](MA(&acc)[2][2], int32_t) {
          for (int q = 0; q < 2; q++) {
            const IA sumi = mmla_rows2(acc[q]);
            const float s0 = L.scale(std::min(n + 2 * q, n1 - 1), 0);
            const float s1 = L.scale(std::min(n + 2 * q + 1, n1 - 1), 0);
            y[q] = FV{vmulq_f32(vmulq_n_f32(vcvtq_f32_s32(vsubq_s32(sumi.lo, gs4)), s0), xs4),
                      vmulq_f32(vmulq_n_f32(vcvtq_f32_s32(vsubq_s32(sumi.hi, gs4)), s1), xs4)};
          }
        });
        for (int q = 0; q < 2; q++) mmla_store(L, n, q, rows, m0, valid, y[q]);
      }
    }
  }
#endif

  // float path: F8 = 8 float lanes in two registers
  struct F8 { float32x4_t a, b; };
  static constexpr int f8regs = 16;  // 32 q registers
  static F8 f8zero() { return F8{vdupq_n_f32(0), vdupq_n_f32(0)}; }
  static F8 f8add(F8 x, F8 y) { return F8{vaddq_f32(x.a, y.a), vaddq_f32(x.b, y.b)}; }
  static F8 f8fmas(F8 acc, F8 x, float s) {
    return F8{vfmaq_n_f32(acc.a, x.a, s), vfmaq_n_f32(acc.b, x.b, s)};
  }
  static float f8sum(F8 x) { return vaddvq_f32(vaddq_f32(x.a, x.b)); }
  static F8 f8load(const float* p) { return F8{vld1q_f32(p), vld1q_f32(p + 4)}; }
  static F8 f8loadr(const float* p) { return f8load(p); }
  static F8 f8loadh(const uint16_t* p) {  // a signalling NaN comes out quiet (FCVTL)
    return F8{vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))),
              vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4)))};
  }
  static void f8store(float* p, F8 v) { vst1q_f32(p, v.a), vst1q_f32(p + 4, v.b); }
  static F8 f8mul(F8 x, float s) { return F8{vmulq_n_f32(x.a, s), vmulq_n_f32(x.b, s)}; }
  static F8 f8fma(F8 acc, F8 w, F8 x) {
    return F8{vfmaq_f32(acc.a, w.a, x.a), vfmaq_f32(acc.b, w.b, x.b)};
  }
  static F8 f8set(float v) { return F8{vdupq_n_f32(v), vdupq_n_f32(v)}; }
  static F8 fma8(F8 acc, F8 w, const float* x) {
    return F8{vfmaq_f32(acc.a, w.a, vld1q_f32(x)), vfmaq_f32(acc.b, w.b, vld1q_f32(x + 4))};
  }
  static F8 f8max(F8 x, F8 y) { return F8{vmaxq_f32(x.a, y.a), vmaxq_f32(x.b, y.b)}; }
  static float f8hmax(F8 x) { return vmaxvq_f32(vmaxq_f32(x.a, x.b)); }
  // lane u = the sum of a[u]'s lanes (pairwise adds)
  static F8 f8tsum(const F8 a[8]) {
    float32x4_t s[8];
    for (int u = 0; u < 8; u++) s[u] = vaddq_f32(a[u].a, a[u].b);
    return F8{vpaddq_f32(vpaddq_f32(s[0], s[1]), vpaddq_f32(s[2], s[3])),
              vpaddq_f32(vpaddq_f32(s[4], s[5]), vpaddq_f32(s[6], s[7]))};
  }
  static F8 cvt8(int8x8_t t) {
    int16x8_t w = vmovl_s8(t);
    return F8{vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(w)))};
  }
  // t = c - 1 as floats, from bytes 0-7, 8-15, 16-23, 24-31 of a code vector
  static void fexpand(const V& c, F8 w[4]) {
    int8x16_t lo = vreinterpretq_s8_u8(vsubq_u8(c.lo, vdupq_n_u8(1)));
    int8x16_t hi = vreinterpretq_s8_u8(vsubq_u8(c.hi, vdupq_n_u8(1)));
    w[0] = cvt8(vget_low_s8(lo)), w[1] = cvt8(vget_high_s8(lo));
    w[2] = cvt8(vget_low_s8(hi)), w[3] = cvt8(vget_high_s8(hi));
  }
};

// ---------------------------------------------------------------------------------------------
// The kernels' NEON pieces. What arm64 lacks is visible here as what is not defined:
//   - NeonOps has the q8k tile (kernels/q8k.h rows_q8k_tile, rows_q8k_r8; SDOT or the
//     fallback dot product) and the 8-row per-token int8 block (kernels/ternary.h
//     rows_int8_r8) but no 512-bit windows (has_q8k_wide) and no i8mm (SMMLA) tile;
//   - no KqNeon and no ggml_tile: llama.cpp's tables run KqScalar's generic loops;
//   - the heads below come from arch/scalar.h (no vector exp, absmax, rounding, fast order or
//     float16 scales), so SwiGLU, softmax and the Q8_K quantizer run their scalar loops.
// ---------------------------------------------------------------------------------------------

namespace neon {

inline void cpu_pause() { asm volatile("yield"); }

using portable::absmax_head;
using portable::f16x8_finite_to_f32;
using portable::f16x8x8_finite_to_f32;
using portable::fast_order_head;
using portable::ggml_tile;
using portable::q8k_block_head;
using portable::round_clamp_head;
using portable::silu_mul_head;
using portable::softmax_exp_head;
using portable::sum_i8_head;

// dst[i] = src[i] (float16 bits) as float32 over the whole vectors of [0, n) (NeonOps::f8loadh);
// returns where the scalar tail starts.
inline int64_t f16_widen_head(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) NeonOps::f8store(dst + i, NeonOps::f8loadh(src + i));
  return i;
}

constexpr const char* DENSE_ISA = "neon";
constexpr int DENSE_TOKENS = 4;  // 4 x DENSE_CHAINS accumulators in 32 registers

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

template <int WD, int T, class DL>
void dense_block(const DL& L, int64_t n0, int64_t n1, int64_t m0) {
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

}  // namespace neon

}  // namespace tk
