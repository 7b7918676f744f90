// arm64 ternary inner operations: NEON, with the SDOT dot product where the CPU has it
// (ARMv8.2 dotprod: every Apple M-series core). Same contract as arch/scalar.h; a 32-byte
// step is two 16-byte registers, the first holding bytes 0-15 ("lo").
//
// Codes c in {0,1,2} are valid signed bytes, so sdot multiplies them with the int8
// activations directly; lane j of sdot sums bytes 4j..4j+3, the lane map of the contract.
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include <cstring>

namespace tk {

struct NeonOps {
#if defined(__ARM_FEATURE_DOTPROD)
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
    int8x16_t cs = vreinterpretq_s8_u8(c);
    int16x8_t p = vmull_s8(vget_low_s8(cs), vget_low_s8(x));
    p = vmlal_s8(p, vget_high_s8(cs), vget_high_s8(x));
    return vpadalq_s16(a, p);
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

  // float path: F8 = 8 float lanes in two registers
  struct F8 { float32x4_t a, b; };
  static F8 f8zero() { return F8{vdupq_n_f32(0), vdupq_n_f32(0)}; }
  static F8 f8add(F8 x, F8 y) { return F8{vaddq_f32(x.a, y.a), vaddq_f32(x.b, y.b)}; }
  static F8 f8fmas(F8 acc, F8 x, float s) {
    return F8{vfmaq_n_f32(acc.a, x.a, s), vfmaq_n_f32(acc.b, x.b, s)};
  }
  static float f8sum(F8 x) { return vaddvq_f32(vaddq_f32(x.a, x.b)); }
  static F8 f8load(const float* p) { return F8{vld1q_f32(p), vld1q_f32(p + 4)}; }
  static void f8store(float* p, F8 v) { vst1q_f32(p, v.a), vst1q_f32(p + 4, v.b); }
  static F8 f8mul(F8 x, float s) { return F8{vmulq_n_f32(x.a, s), vmulq_n_f32(x.b, s)}; }
  static F8 f8fma(F8 acc, F8 w, F8 x) {
    return F8{vfmaq_f32(acc.a, w.a, x.a), vfmaq_f32(acc.b, w.b, x.b)};
  }
  static F8 f8set(float v) { return F8{vdupq_n_f32(v), vdupq_n_f32(v)}; }
  static F8 fma8(F8 acc, F8 w, const float* x) {
    return F8{vfmaq_f32(acc.a, w.a, vld1q_f32(x)), vfmaq_f32(acc.b, w.b, vld1q_f32(x + 4))};
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

}  // namespace tk
