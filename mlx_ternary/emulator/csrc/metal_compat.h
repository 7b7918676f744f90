// The subset of the Metal Shading Language that the emulator supports, as
// C++17 for g++. Kernels reach it after translate.py has rewritten address
// spaces (device pointers -> emu::device_ptr, constant ones -> emu::constant_ptr,
// threadgroup arrays -> emu::tg_storage), swizzles (v.xy -> v.template swz<0, 1>()) and attributes.
//
// No <cmath> or <cstdlib>: their global ::abs, ::exp... would make unqualified
// calls in kernels ambiguous with metal::. Math goes through GCC builtins.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <limits>
#include <type_traits>
#include <utility>

#include "emu_abi.h"

#define __METAL_VERSION__ 310
#define __HAVE_BFLOAT__ 1
#define MLX_TERNARY_EMULATOR 1
#define METAL_FUNC inline
#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define HUGE_VALF (__builtin_huge_valf())
#define MAXFLOAT __FLT_MAX__
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define FLT_EPSILON __FLT_EPSILON__
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)0.0009765625f)
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.78539816339744830962f
#define M_1_PI_F 0.31830988618379067154f
#define M_2_PI_F 0.63661977236758134308f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.43429448190325182765f
#define M_LN2_F 0.69314718055994530942f
#define M_LN10_F 2.30258509299404568402f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.70710678118654752440f

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

// ---------------------------------------------------------------------------
// bfloat16: as Metal 3.1's bfloat, float and half convert to it only
// explicitly; it converts to float implicitly. Each operation rounds to
// nearest even, as if computed in float.

namespace emu {
constexpr uint16_t f32_to_bf16(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);
  u += ((u >> 16) & 1u) + 0x7FFFu;
  return uint16_t(u >> 16);
}
constexpr float bf16_to_f32(uint16_t b) {
  return __builtin_bit_cast(float, uint32_t(b) << 16);
}
template <class T>
constexpr bool is_num_v = std::is_arithmetic_v<T> || std::is_same_v<T, _Float16>;
}  // namespace emu

struct bfloat16_t {
  uint16_t bits_;
  bfloat16_t() = default;
  template <class T, std::enable_if_t<emu::is_num_v<T>, int> = 0>
  constexpr explicit bfloat16_t(T x) : bits_(emu::f32_to_bf16(static_cast<float>(x))) {}
  constexpr operator float() const { return emu::bf16_to_f32(bits_); }

  friend constexpr bfloat16_t operator-(bfloat16_t a) {
    bfloat16_t r = a;
    r.bits_ ^= 0x8000u;
    return r;
  }
  friend constexpr bfloat16_t operator+(bfloat16_t a) { return a; }

#define EMU_BF_OP(op)                                                                       \
  friend constexpr bfloat16_t operator op(bfloat16_t a, bfloat16_t b) {                     \
    return bfloat16_t(float(a) op float(b));                                                \
  }                                                                                         \
  friend constexpr float operator op(bfloat16_t a, float b) { return float(a) op b; }       \
  friend constexpr float operator op(float a, bfloat16_t b) { return a op float(b); }       \
  friend constexpr float operator op(bfloat16_t a, _Float16 b) { return float(a) op float(b); } \
  friend constexpr float operator op(_Float16 a, bfloat16_t b) { return float(a) op float(b); } \
  EMU_BF_INT_OP(op, int) EMU_BF_INT_OP(op, unsigned) EMU_BF_INT_OP(op, long)                \
  EMU_BF_INT_OP(op, unsigned long)                                                          \
  template <class U>                                                                        \
  constexpr bfloat16_t& operator op##=(const U& u) {                                        \
    *this = bfloat16_t(float(*this) op static_cast<float>(u));                              \
    return *this;                                                                           \
  }
#define EMU_BF_INT_OP(op, I)                                                                  \
  friend constexpr bfloat16_t operator op(bfloat16_t a, I b) { return bfloat16_t(float(a) op float(b)); } \
  friend constexpr bfloat16_t operator op(I a, bfloat16_t b) { return bfloat16_t(float(a) op float(b)); }
  EMU_BF_OP(+)
  EMU_BF_OP(-)
  EMU_BF_OP(*)
  EMU_BF_OP(/)
#undef EMU_BF_OP
#undef EMU_BF_INT_OP
};
typedef bfloat16_t bfloat;

inline uint16_t bfloat16_to_uint16(const bfloat16_t x) { return x.bits_; }
inline bfloat16_t uint16_to_bfloat16(const uint16_t x) {
  bfloat16_t r;
  r.bits_ = x;
  return r;
}

// ---------------------------------------------------------------------------
// Type traits and limits

namespace metal {
using std::conditional;
using std::conditional_t;
using std::decay;
using std::decay_t;
using std::enable_if;
using std::enable_if_t;
using std::false_type;
using std::integral_constant;
using std::is_const;
using std::is_const_v;
using std::is_convertible;
using std::is_convertible_v;
using std::is_integral;
using std::is_integral_v;
using std::is_pointer;
using std::is_pointer_v;
using std::is_same;
using std::is_same_v;
using std::is_signed;
using std::is_signed_v;
using std::is_unsigned;
using std::is_unsigned_v;
using std::make_signed;
using std::make_signed_t;
using std::make_unsigned;
using std::make_unsigned_t;
using std::remove_const;
using std::remove_const_t;
using std::remove_cv;
using std::remove_cv_t;
using std::remove_reference;
using std::remove_reference_t;
using std::true_type;

template <class T>
struct is_floating_point
    : integral_constant<bool, std::is_floating_point_v<T> || is_same_v<remove_cv_t<T>, half> ||
                                  is_same_v<remove_cv_t<T>, bfloat16_t>> {};
template <class T>
constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T>
struct is_arithmetic : integral_constant<bool, is_integral_v<T> || is_floating_point_v<T>> {};
template <class T>
constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T>
constexpr bool is_scalar_v = is_arithmetic_v<T>;

template <class T>
struct numeric_limits : std::numeric_limits<T> {};

template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 11;
  static constexpr int radix = 2;
  static constexpr half b(uint16_t x) { return __builtin_bit_cast(half, x); }
  static constexpr half min() { return b(0x0400); }
  static constexpr half max() { return b(0x7BFF); }
  static constexpr half lowest() { return b(0xFBFF); }
  static constexpr half epsilon() { return b(0x1400); }
  static constexpr half infinity() { return b(0x7C00); }
  static constexpr half quiet_NaN() { return b(0x7E00); }
  static constexpr half denorm_min() { return b(0x0001); }
};

template <>
struct numeric_limits<bfloat16_t> {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = 8;
  static constexpr int radix = 2;
  static constexpr bfloat16_t b(uint16_t x) { return __builtin_bit_cast(bfloat16_t, x); }
  static constexpr bfloat16_t min() { return b(0x0080); }
  static constexpr bfloat16_t max() { return b(0x7F7F); }
  static constexpr bfloat16_t lowest() { return b(0xFF7F); }
  static constexpr bfloat16_t epsilon() { return b(0x3C00); }
  static constexpr bfloat16_t infinity() { return b(0x7F80); }
  static constexpr bfloat16_t quiet_NaN() { return b(0x7FC0); }
  static constexpr bfloat16_t denorm_min() { return b(0x0001); }
};
}  // namespace metal

// ---------------------------------------------------------------------------
// Vectors: Metal sizes and alignments (a 3-vector takes the room of 4).

namespace metal {
template <class T, int N>
struct vec;
}

namespace emu {
template <class T, int N>
struct vec_base;
template <class T>
struct vec_base<T, 2> {
  union {
    T v_[2];
    struct { T x, y; };
    struct { T r, g; };
  };
};
template <class T>
struct vec_base<T, 3> {
  union {
    T v_[4];
    struct { T x, y, z; };
    struct { T r, g, b; };
  };
};
template <class T>
struct vec_base<T, 4> {
  union {
    T v_[4];
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
  };
};

// `v.xy = ...` and other swizzles on the left of an assignment.
template <class T, int N, int... I>
struct swz_ref {
  metal::vec<T, N>* p;
  using R = metal::vec<T, int(sizeof...(I))>;
  operator R() const { return p->template swz<I...>(); }
  swz_ref& operator=(const R& r) {
    int k = 0;
    ((p->v_[I] = r.v_[k++]), ...);
    return *this;
  }
#define EMU_SWZ_OP(op)                      \
  template <class U>                        \
  swz_ref& operator op##=(const U& u) {     \
    return *this = R(R(*this) op u);        \
  }
  EMU_SWZ_OP(+) EMU_SWZ_OP(-) EMU_SWZ_OP(*) EMU_SWZ_OP(/) EMU_SWZ_OP(%)
  EMU_SWZ_OP(&) EMU_SWZ_OP(|) EMU_SWZ_OP(^) EMU_SWZ_OP(<<) EMU_SWZ_OP(>>)
#undef EMU_SWZ_OP
};
}  // namespace emu

namespace metal {
template <class T, int N>
struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec : emu::vec_base<T, N> {
  static_assert(N >= 2 && N <= 4, "Metal vectors have 2, 3 or 4 components");
  using value_type = T;

  vec() = default;
  vec(T s) {
    for (int i = 0; i < N; i++) this->v_[i] = s;
  }
  template <int M = N, std::enable_if_t<M == 2, int> = 0>
  vec(T a, T b) { set(a, b); }
  template <int M = N, std::enable_if_t<M == 3, int> = 0>
  vec(T a, T b, T c) { set(a, b, c); }
  template <int M = N, std::enable_if_t<M == 3, int> = 0>
  vec(const vec<T, 2>& a, T c) { set(a.v_[0], a.v_[1], c); }
  template <int M = N, std::enable_if_t<M == 3, int> = 0>
  vec(T a, const vec<T, 2>& b) { set(a, b.v_[0], b.v_[1]); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(T a, T b, T c, T d) { set(a, b, c, d); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(const vec<T, 2>& a, T c, T d) { set(a.v_[0], a.v_[1], c, d); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(T a, const vec<T, 2>& b, T d) { set(a, b.v_[0], b.v_[1], d); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(T a, T b, const vec<T, 2>& c) { set(a, b, c.v_[0], c.v_[1]); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(const vec<T, 2>& a, const vec<T, 2>& b) { set(a.v_[0], a.v_[1], b.v_[0], b.v_[1]); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(const vec<T, 3>& a, T d) { set(a.v_[0], a.v_[1], a.v_[2], d); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(T a, const vec<T, 3>& b) { set(a, b.v_[0], b.v_[1], b.v_[2]); }
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; i++) this->v_[i] = static_cast<T>(o.v_[i]);
  }

  T& operator[](int i) { return this->v_[i]; }
  const T& operator[](int i) const { return this->v_[i]; }

  template <int... I>
  vec<T, int(sizeof...(I))> swz() const {
    static_assert(((I < N) && ...), "swizzle component out of range");
    return vec<T, int(sizeof...(I))>(this->v_[I]...);
  }
  template <int... I>
  emu::swz_ref<T, N, I...> swzref() {
    static_assert(((I < N) && ...), "swizzle component out of range");
    return {this};
  }

#define EMU_VEC_OP(op)                                                              \
  friend vec operator op(const vec& a, const vec& b) {                              \
    vec r;                                                                          \
    for (int i = 0; i < N; i++) r.v_[i] = static_cast<T>(a.v_[i] op b.v_[i]);       \
    return r;                                                                       \
  }                                                                                 \
  friend vec operator op(const vec& a, T b) {                                       \
    vec r;                                                                          \
    for (int i = 0; i < N; i++) r.v_[i] = static_cast<T>(a.v_[i] op b);             \
    return r;                                                                       \
  }                                                                                 \
  friend vec operator op(T a, const vec& b) {                                       \
    vec r;                                                                          \
    for (int i = 0; i < N; i++) r.v_[i] = static_cast<T>(a op b.v_[i]);             \
    return r;                                                                       \
  }                                                                                 \
  vec& operator op##=(const vec& b) {                                               \
    for (int i = 0; i < N; i++) this->v_[i] = static_cast<T>(this->v_[i] op b.v_[i]); \
    return *this;                                                                   \
  }                                                                                 \
  vec& operator op##=(T b) {                                                        \
    for (int i = 0; i < N; i++) this->v_[i] = static_cast<T>(this->v_[i] op b);    \
    return *this;                                                                   \
  }
  EMU_VEC_OP(+) EMU_VEC_OP(-) EMU_VEC_OP(*) EMU_VEC_OP(/) EMU_VEC_OP(%)
  EMU_VEC_OP(&) EMU_VEC_OP(|) EMU_VEC_OP(^) EMU_VEC_OP(<<) EMU_VEC_OP(>>)
#undef EMU_VEC_OP

#define EMU_VEC_CMP(op)                                                          \
  friend vec<bool, N> operator op(const vec& a, const vec& b) {                  \
    vec<bool, N> r;                                                              \
    for (int i = 0; i < N; i++) r.v_[i] = a.v_[i] op b.v_[i];                    \
    return r;                                                                    \
  }                                                                              \
  friend vec<bool, N> operator op(const vec& a, T b) {                           \
    vec<bool, N> r;                                                              \
    for (int i = 0; i < N; i++) r.v_[i] = a.v_[i] op b;                          \
    return r;                                                                    \
  }                                                                              \
  friend vec<bool, N> operator op(T a, const vec& b) {                           \
    vec<bool, N> r;                                                              \
    for (int i = 0; i < N; i++) r.v_[i] = a op b.v_[i];                          \
    return r;                                                                    \
  }
  EMU_VEC_CMP(==) EMU_VEC_CMP(!=) EMU_VEC_CMP(<) EMU_VEC_CMP(>) EMU_VEC_CMP(<=)
  EMU_VEC_CMP(>=) EMU_VEC_CMP(&&) EMU_VEC_CMP(||)
#undef EMU_VEC_CMP

  friend vec operator-(const vec& a) {
    vec r;
    for (int i = 0; i < N; i++) r.v_[i] = static_cast<T>(-a.v_[i]);
    return r;
  }
  friend vec operator+(const vec& a) { return a; }
  friend vec operator~(const vec& a) {
    vec r;
    for (int i = 0; i < N; i++) r.v_[i] = static_cast<T>(~a.v_[i]);
    return r;
  }
  friend vec<bool, N> operator!(const vec& a) {
    vec<bool, N> r;
    for (int i = 0; i < N; i++) r.v_[i] = !a.v_[i];
    return r;
  }

 private:
  template <class... A>
  void set(A... a) {
    int i = 0;
    ((this->v_[i++] = a), ...);
    if (N == 3) this->v_[3] = T();
  }
};

// packed_floatN and friends: no padding, element alignment.
template <class T, int N>
struct packed_vec {
  T v_[N];
  packed_vec() = default;
  packed_vec(const vec<T, N>& o) {
    for (int i = 0; i < N; i++) v_[i] = o.v_[i];
  }
  operator vec<T, N>() const {
    vec<T, N> r;
    for (int i = 0; i < N; i++) r.v_[i] = v_[i];
    return r;
  }
  T& operator[](int i) { return v_[i]; }
  const T& operator[](int i) const { return v_[i]; }
};

#define EMU_VEC_TYPES(T, name)                                        \
  typedef vec<T, 2> name##2;                                          \
  typedef vec<T, 3> name##3;                                          \
  typedef vec<T, 4> name##4;                                          \
  typedef packed_vec<T, 2> packed_##name##2;                          \
  typedef packed_vec<T, 3> packed_##name##3;                          \
  typedef packed_vec<T, 4> packed_##name##4;
EMU_VEC_TYPES(float, float)
EMU_VEC_TYPES(half, half)
EMU_VEC_TYPES(bfloat16_t, bfloat)
EMU_VEC_TYPES(int, int)
EMU_VEC_TYPES(uint, uint)
EMU_VEC_TYPES(short, short)
EMU_VEC_TYPES(ushort, ushort)
EMU_VEC_TYPES(char, char)
EMU_VEC_TYPES(uchar, uchar)
EMU_VEC_TYPES(long, long)
EMU_VEC_TYPES(ulong, ulong)
EMU_VEC_TYPES(bool, bool)
#undef EMU_VEC_TYPES
}  // namespace metal

// ---------------------------------------------------------------------------
// Checked pointers. A device or constant pointer carries its buffer, so every
// access is bounds-checked and counted, including after pointer arithmetic
// and casts. Threadgroup arrays check each index against their extents.

namespace emu {

inline void check(emu_buf* d, const char* a, uint32_t n, uint32_t align, int write) {
  uintptr_t x = reinterpret_cast<uintptr_t>(a);
  if (__builtin_expect(x < reinterpret_cast<uintptr_t>(d->lo) ||
                           x + n > reinterpret_cast<uintptr_t>(d->hi),
                       0))
    emu_rt_oob(d, a, n, write, 0);
  // Alignment relative to the buffer start: Metal buffers start page-aligned,
  // host arrays need not.
  if (__builtin_expect(((x - reinterpret_cast<uintptr_t>(d->base)) & (align - 1)) != 0, 0))
    emu_rt_oob(d, a, n, write, align);
}

inline char* offset(char* p, ptrdiff_t bytes) {
  return reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(p) + bytes);
}

template <class T>
constexpr uint32_t align_of() {
  if constexpr (std::is_void_v<T>) return 1;
  else return alignof(T);
}

template <class I>
constexpr bool is_index_v = std::is_integral_v<I> || std::is_enum_v<I>;

template <class T>
struct device_ref;
template <class T>
struct device_ptr;
template <class T>
struct tg_ptr;

// Shared arithmetic of the pointer types.
#define EMU_PTR_ARITH(P)                                                               \
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>                         \
  friend P operator+(const P& p, I i) {                                                \
    P r = p;                                                                           \
    r.p_ = offset(p.p_, ptrdiff_t(i) * ptrdiff_t(sizeof(E)));                          \
    return r;                                                                          \
  }                                                                                    \
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>                         \
  friend P operator+(I i, const P& p) { return p + i; }                                \
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>                         \
  friend P operator-(const P& p, I i) {                                                \
    P r = p;                                                                           \
    r.p_ = offset(p.p_, -ptrdiff_t(i) * ptrdiff_t(sizeof(E)));                         \
    return r;                                                                          \
  }                                                                                    \
  friend ptrdiff_t operator-(const P& a, const P& b) {                                 \
    return (reinterpret_cast<intptr_t>(a.p_) - reinterpret_cast<intptr_t>(b.p_)) /     \
           ptrdiff_t(sizeof(E));                                                       \
  }                                                                                    \
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>                         \
  P& operator+=(I i) { return *this = *this + i; }                                     \
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>                         \
  P& operator-=(I i) { return *this = *this - i; }                                     \
  P& operator++() { return *this = *this + 1; }                                        \
  P& operator--() { return *this = *this - 1; }                                        \
  P operator++(int) { P t = *this; *this = *this + 1; return t; }                      \
  P operator--(int) { P t = *this; *this = *this - 1; return t; }

#define EMU_PTR_CMP(P)                                                                 \
  friend bool operator==(const P& a, const P& b) { return a.p_ == b.p_; }              \
  friend bool operator!=(const P& a, const P& b) { return a.p_ != b.p_; }              \
  friend bool operator<(const P& a, const P& b) { return a.p_ < b.p_; }                \
  friend bool operator>(const P& a, const P& b) { return a.p_ > b.p_; }                \
  friend bool operator<=(const P& a, const P& b) { return a.p_ <= b.p_; }              \
  friend bool operator>=(const P& a, const P& b) { return a.p_ >= b.p_; }              \
  friend bool operator==(const P& a, std::nullptr_t) { return a.p_ == nullptr; }       \
  friend bool operator!=(const P& a, std::nullptr_t) { return a.p_ != nullptr; }       \
  explicit operator bool() const { return p_ != nullptr; }

// A checked, counted read of element i from a device or constant buffer.
template <class T>
inline const T& checked_read(char* p, emu_buf* d, ptrdiff_t i, const char* space) {
  char* a = offset(p, i * ptrdiff_t(sizeof(T)));
  if (__builtin_expect(!d, 0)) {
    emu_rt_fail(space[0] == 'd' ? "read through a null device pointer"
                                : "read through a null constant pointer");
  }
  check(d, a, sizeof(T), align_of<T>(), 0);
  d->read += sizeof(T);
  return *reinterpret_cast<const T*>(a);
}

template <class T>
struct device_ptr<const T> {
  using E = const T;
  char* p_ = nullptr;
  emu_buf* d_ = nullptr;

  device_ptr() = default;
  device_ptr(std::nullptr_t) {}
  explicit device_ptr(emu_buf* d) : p_(d->base), d_(d) {}
  device_ptr(char* p, emu_buf* d) : p_(p), d_(d) {}
  template <class U, std::enable_if_t<!std::is_same_v<std::remove_cv_t<U>, std::remove_cv_t<T>>, int> = 0>
  explicit device_ptr(const device_ptr<U>& o) : p_(o.p_), d_(o.d_) {}

  const T& at(ptrdiff_t i) const { return checked_read<T>(p_, d_, i, "device"); }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  const T& operator[](I i) const { return at(ptrdiff_t(i)); }
  const T& operator*() const { return at(0); }
  const T* operator->() const { return &at(0); }

  EMU_PTR_ARITH(device_ptr)
  EMU_PTR_CMP(device_ptr)
};

template <class T>
struct device_ptr : device_ptr<const T> {
  using E = T;
  using device_ptr<const T>::device_ptr;
  using device_ptr<const T>::p_;
  using device_ptr<const T>::d_;
  device_ptr() = default;
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
  explicit device_ptr(const device_ptr<U>& o) : device_ptr<const T>(o.p_, o.d_) {}

  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  device_ref<T> operator[](I i) const {
    return device_ref<T>(offset(p_, ptrdiff_t(i) * ptrdiff_t(sizeof(T))), d_);
  }
  device_ref<T> operator*() const { return (*this)[0]; }
  T* operator->() const {
    if (__builtin_expect(!d_, 0)) emu_rt_fail("write through a null device pointer");
    check(d_, p_, sizeof(T), align_of<T>(), 1);
    d_->written += sizeof(T);
    return reinterpret_cast<T*>(p_);
  }

  EMU_PTR_ARITH(device_ptr)
  EMU_PTR_CMP(device_ptr)
};

// A pointer into the `constant` address space (program-scope tables aside):
// MLX binds inputs of fewer than 8 elements and the _shape/_strides arrays
// this way. A distinct type, so that casting it to a `device` pointer (or
// passing it where a `device` pointer is expected) fails to compile, as it
// does in Apple's compiler. Reads are checked and counted like device reads.
template <class T>
struct constant_ptr {
  using E = const std::remove_const_t<T>;
  using V = std::remove_const_t<T>;
  char* p_ = nullptr;
  emu_buf* d_ = nullptr;

  constant_ptr() = default;
  constant_ptr(std::nullptr_t) {}
  explicit constant_ptr(emu_buf* d) : p_(d->base), d_(d) {}
  constant_ptr(char* p, emu_buf* d) : p_(p), d_(d) {}
  template <class U, std::enable_if_t<!std::is_same_v<std::remove_cv_t<U>, V>, int> = 0>
  explicit constant_ptr(const constant_ptr<U>& o) : p_(o.p_), d_(o.d_) {}

  const V& at(ptrdiff_t i) const { return checked_read<V>(p_, d_, i, "constant"); }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  const V& operator[](I i) const { return at(ptrdiff_t(i)); }
  const V& operator*() const { return at(0); }
  const V* operator->() const { return &at(0); }

  EMU_PTR_ARITH(constant_ptr)
  EMU_PTR_CMP(constant_ptr)
};

// An element of a writable device buffer: reads and writes are counted when
// they happen. `auto v = out[i]` keeps a reference, not a copy.
template <class T>
struct device_ref {
  char* a_;
  emu_buf* d_;
  device_ref(char* a, emu_buf* d) : a_(a), d_(d) {}
  device_ref(const device_ref&) = default;

  T* get(int write) const {
    if (__builtin_expect(!d_, 0)) emu_rt_fail("access through a null device pointer");
    check(d_, a_, sizeof(T), align_of<T>(), write);
    return reinterpret_cast<T*>(a_);
  }
  operator T() const {
    T* p = get(0);
    d_->read += sizeof(T);
    return *p;
  }
  const device_ref& operator=(const T& v) const {
    T* p = get(1);
    d_->written += sizeof(T);
    *p = v;
    return *this;
  }
  const device_ref& operator=(const device_ref& o) const { return *this = T(o); }
#define EMU_REF_OP(op)                              \
  template <class U>                                \
  const device_ref& operator op##=(const U& u) const { \
    T v = *this;                                    \
    v op##= u;                                      \
    return *this = v;                               \
  }
  EMU_REF_OP(+) EMU_REF_OP(-) EMU_REF_OP(*) EMU_REF_OP(/) EMU_REF_OP(%)
  EMU_REF_OP(&) EMU_REF_OP(|) EMU_REF_OP(^) EMU_REF_OP(<<) EMU_REF_OP(>>)
#undef EMU_REF_OP
  const device_ref& operator++() const { T v = *this; ++v; return *this = v; }
  const device_ref& operator--() const { T v = *this; --v; return *this = v; }
  T operator++(int) const { T v = *this; T w = v; ++w; *this = w; return v; }
  T operator--(int) const { T v = *this; T w = v; --w; *this = w; return v; }
  device_ptr<T> operator&() const { return device_ptr<T>(a_, d_); }
};

// Threadgroup pointers: checked when they come from a threadgroup array,
// unchecked (d_ == nullptr) when made from a raw address such as &x.
template <class T, size_t N, size_t... R>
struct tg_array;

template <class T>
struct tg_ptr<const T> {
  using E = const T;
  char* p_ = nullptr;
  emu_buf* d_ = nullptr;
  tg_ptr() = default;
  tg_ptr(std::nullptr_t) {}
  tg_ptr(const T* p) : p_(reinterpret_cast<char*>(const_cast<T*>(p))) {}
  tg_ptr(char* p, emu_buf* d) : p_(p), d_(d) {}
  template <class U, std::enable_if_t<!std::is_same_v<std::remove_cv_t<U>, std::remove_cv_t<T>>, int> = 0>
  explicit tg_ptr(const tg_ptr<U>& o) : p_(o.p_), d_(o.d_) {}
  template <class U, size_t... D>
  explicit tg_ptr(const tg_array<U, D...>& o) : p_(o.p_), d_(o.d_) {}

  T* addr(ptrdiff_t i, int write) const {
    char* a = offset(p_, i * ptrdiff_t(sizeof(T)));
    if (d_) check(d_, a, sizeof(T), align_of<T>(), write);
    return reinterpret_cast<T*>(a);
  }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  const T& operator[](I i) const { return *addr(ptrdiff_t(i), 0); }
  const T& operator*() const { return *addr(0, 0); }
  const T* operator->() const { return addr(0, 0); }

  EMU_PTR_ARITH(tg_ptr)
  EMU_PTR_CMP(tg_ptr)
};

template <class T>
struct tg_ptr : tg_ptr<const T> {
  using E = T;
  using tg_ptr<const T>::tg_ptr;
  using tg_ptr<const T>::p_;
  using tg_ptr<const T>::d_;
  tg_ptr() = default;
  tg_ptr(T* p) : tg_ptr<const T>(reinterpret_cast<char*>(p), nullptr) {}
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
  explicit tg_ptr(const tg_ptr<U>& o) : tg_ptr<const T>(o.p_, o.d_) {}
  template <class U, size_t... D>
  explicit tg_ptr(const tg_array<U, D...>& o) : tg_ptr<const T>(o.p_, o.d_) {}

  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  T& operator[](I i) const { return *this->addr(ptrdiff_t(i), 1); }
  T& operator*() const { return *this->addr(0, 1); }
  T* operator->() const { return this->addr(0, 1); }

  EMU_PTR_ARITH(tg_ptr)
  EMU_PTR_CMP(tg_ptr)
};

template <class T, size_t N, size_t... R>
struct tg_array {
  char* p_;
  emu_buf* d_;
  tg_array(char* p, emu_buf* d) : p_(p), d_(d) {}
  static constexpr size_t stride = sizeof(T) * (R * ... * size_t(1));
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  tg_array<T, R...> operator[](I i) const {
    char* a = offset(p_, ptrdiff_t(i) * ptrdiff_t(stride));
    if (size_t(i) >= N) emu_rt_oob(d_, a, sizeof(T), 0, 0);
    return tg_array<T, R...>(a, d_);
  }
};

template <class T, size_t N>
struct tg_array<T, N> : tg_ptr<T> {
  tg_array(char* p, emu_buf* d) : tg_ptr<T>(p, d) {}
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  T& operator[](I i) const {
    char* a = offset(this->p_, ptrdiff_t(i) * ptrdiff_t(sizeof(T)));
    if (size_t(i) >= N) emu_rt_oob(this->d_, a, sizeof(T), 0, 0);
    return *reinterpret_cast<T*>(a);
  }
};

// The storage of one `threadgroup` declaration: one per worker thread, shared
// by the fibers of the threadgroup it runs, filled with 0xFF bytes when a new
// threadgroup first reaches it (Metal leaves it uninitialized).
template <class T, size_t... D>
struct tg_storage {
  static constexpr size_t count = (D * ... * size_t(1));
  static constexpr size_t bytes = sizeof(T) * count;
  alignas(alignof(T) > 16 ? alignof(T) : 16) unsigned char data_[bytes == 0 ? 1 : bytes];
  uint64_t gen_;
  emu_buf buf_;

  decltype(auto) enter(const char* name) {
    uint64_t g = emu_rt_tg_enter(gen_, bytes, name);
    if (g != gen_) {
      __builtin_memset(data_, 0xFF, sizeof(data_));
      gen_ = g;
      char* p = reinterpret_cast<char*>(data_);
      buf_ = emu_buf{p, p, p + bytes, 0, 0, name, EMU_BUF_THREADGROUP, int32_t(sizeof(T))};
    }
    if constexpr (sizeof...(D) == 0) {
      return *reinterpret_cast<T*>(data_);
    } else {
      return tg_array<T, D...>(reinterpret_cast<char*>(data_), &buf_);
    }
  }
};

// The value type behind a proxy: device_ref<T> -> T, swizzle -> vector.
template <class X>
struct value_of {
  using type = std::remove_cv_t<std::remove_reference_t<X>>;
};
template <class T>
struct value_of<device_ref<T>> {
  using type = T;
};
template <class T, int N, int... I>
struct value_of<swz_ref<T, N, I...>> {
  using type = metal::vec<T, int(sizeof...(I))>;
};
template <class X>
using val_t = typename value_of<std::remove_cv_t<std::remove_reference_t<X>>>::type;

template <class T>
struct is_fat_ptr : std::false_type {};
template <class T>
struct is_fat_ptr<device_ptr<T>> : std::true_type {};
template <class T>
struct is_fat_ptr<tg_ptr<T>> : std::true_type {};
template <class T>
struct is_fat_ptr<constant_ptr<T>> : std::true_type {};

template <class To, class From>
To reinterpret_cast_(From&& f) {
  if constexpr (is_fat_ptr<std::remove_cv_t<To>>::value) {
    return To(f);
  } else {
    return reinterpret_cast<To>(f);
  }
}
template <class To, class From>
To const_cast_(From&& f) {
  if constexpr (is_fat_ptr<std::remove_cv_t<To>>::value) {
    return To(f);
  } else {
    return const_cast<To>(f);
  }
}
}  // namespace emu

// ---------------------------------------------------------------------------
// as_type

namespace metal {
template <class To, class From>
inline To as_type(const From& f) {
  using F = emu::val_t<From>;
  F v = f;
  static_assert(sizeof(To) == sizeof(F), "as_type<> needs types of the same size");
  return __builtin_bit_cast(To, v);
}
}  // namespace metal

// ---------------------------------------------------------------------------
// Math. half and bfloat16 compute in float and round the result.

namespace metal {

#define EMU_F1(name, expr)                                                    \
  inline float name(float x) { return expr; }                                \
  inline half name(half x) { return half(name(float(x))); }                  \
  inline bfloat16_t name(bfloat16_t x) { return bfloat16_t(name(float(x))); } \
  template <class T, int N>                                                   \
  inline vec<T, N> name(const vec<T, N>& v) {                                 \
    vec<T, N> r;                                                              \
    for (int i = 0; i < N; i++) r[i] = name(v[i]);                            \
    return r;                                                                 \
  }

EMU_F1(fabs, __builtin_fabsf(x))
EMU_F1(acos, __builtin_acosf(x))
EMU_F1(acosh, __builtin_acoshf(x))
EMU_F1(asin, __builtin_asinf(x))
EMU_F1(asinh, __builtin_asinhf(x))
EMU_F1(atan, __builtin_atanf(x))
EMU_F1(atanh, __builtin_atanhf(x))
EMU_F1(cbrt, __builtin_cbrtf(x))
EMU_F1(ceil, __builtin_ceilf(x))
EMU_F1(cos, __builtin_cosf(x))
EMU_F1(cosh, __builtin_coshf(x))
EMU_F1(cospi, __builtin_cosf(x * M_PI_F))
EMU_F1(exp, __builtin_expf(x))
EMU_F1(exp2, __builtin_exp2f(x))
EMU_F1(exp10, __builtin_powf(10.0f, x))
EMU_F1(floor, __builtin_floorf(x))
EMU_F1(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
EMU_F1(log, __builtin_logf(x))
EMU_F1(log2, __builtin_log2f(x))
EMU_F1(log10, __builtin_log10f(x))
EMU_F1(rint, __builtin_rintf(x))
EMU_F1(round, __builtin_roundf(x))
EMU_F1(rsqrt, 1.0f / __builtin_sqrtf(x))
EMU_F1(sin, __builtin_sinf(x))
EMU_F1(sinh, __builtin_sinhf(x))
EMU_F1(sinpi, __builtin_sinf(x * M_PI_F))
EMU_F1(sqrt, __builtin_sqrtf(x))
EMU_F1(tan, __builtin_tanf(x))
EMU_F1(tanh, __builtin_tanhf(x))
EMU_F1(tanpi, __builtin_tanf(x * M_PI_F))
EMU_F1(trunc, __builtin_truncf(x))
EMU_F1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
EMU_F1(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x))
EMU_F1(erf, __builtin_erff(x))
EMU_F1(expm1, __builtin_expm1f(x))
#undef EMU_F1

#define EMU_PRED(name, expr)                                              \
  inline bool name(float x) { return expr; }                             \
  inline bool name(half x) { return name(float(x)); }                    \
  inline bool name(bfloat16_t x) { return name(float(x)); }              \
  template <class T, int N>                                               \
  inline vec<bool, N> name(const vec<T, N>& v) {                          \
    vec<bool, N> r;                                                       \
    for (int i = 0; i < N; i++) r[i] = name(v[i]);                        \
    return r;                                                             \
  }
EMU_PRED(isnan, __builtin_isnan(x))
EMU_PRED(isinf, __builtin_isinf(x))
EMU_PRED(isfinite, __builtin_isfinite(x))
EMU_PRED(isnormal, __builtin_isnormal(x))
EMU_PRED(signbit, __builtin_signbit(x) != 0)
#undef EMU_PRED

#define EMU_F2(name, expr)                                                          \
  inline float name(float x, float y) { return expr; }                             \
  inline half name(half x, half y) { return half(name(float(x), float(y))); }      \
  inline bfloat16_t name(bfloat16_t x, bfloat16_t y) {                             \
    return bfloat16_t(name(float(x), float(y)));                                   \
  }                                                                                 \
  template <class T, int N>                                                         \
  inline vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) {                   \
    vec<T, N> r;                                                                    \
    for (int i = 0; i < N; i++) r[i] = name(a[i], b[i]);                            \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N>                                                         \
  inline vec<T, N> name(const vec<T, N>& a, typename std::common_type<T>::type b) { \
    return name(a, vec<T, N>(b));                                                   \
  }
EMU_F2(atan2, __builtin_atan2f(x, y))
EMU_F2(copysign, __builtin_copysignf(x, y))
EMU_F2(fdim, __builtin_fdimf(x, y))
EMU_F2(fmax, __builtin_fmaxf(x, y))
EMU_F2(fmin, __builtin_fminf(x, y))
EMU_F2(fmod, __builtin_fmodf(x, y))
EMU_F2(pow, __builtin_powf(x, y))
EMU_F2(powr, __builtin_powf(x, y))
EMU_F2(nextafter, __builtin_nextafterf(x, y))
EMU_F2(step, y < x ? 0.0f : 1.0f)
EMU_F2(divide, x / y)
#undef EMU_F2

inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return half(__builtin_fmaf(float(a), float(b), float(c))); }
inline bfloat16_t fma(bfloat16_t a, bfloat16_t b, bfloat16_t c) {
  return bfloat16_t(__builtin_fmaf(float(a), float(b), float(c)));
}
template <class T, int N>
inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
inline float ldexp(float x, int e) { return __builtin_ldexpf(x, e); }
inline float frexp(float x, int& e) { return __builtin_frexpf(x, &e); }
inline float modf(float x, float& ip) { return __builtin_modff(x, &ip); }
inline float sincos(float x, float& c) {
  c = __builtin_cosf(x);
  return __builtin_sinf(x);
}

// min, max, clamp, abs: scalars of mixed types take their common type, as
// in C++ arithmetic (bfloat16 with an integer stays bfloat16).
}  // namespace metal

namespace emu {
template <class A, class B>
struct common {
  using type = std::common_type_t<A, B>;
};
template <class B>
struct common<bfloat16_t, B> {
  using type = std::conditional_t<std::is_integral_v<B> || std::is_same_v<B, bfloat16_t>, bfloat16_t,
                                  std::conditional_t<std::is_same_v<B, half>, float, std::common_type_t<float, B>>>;
};
template <class A>
struct common<A, bfloat16_t> : common<bfloat16_t, A> {};
template <>
struct common<bfloat16_t, bfloat16_t> {
  using type = bfloat16_t;
};
template <class A, class B>
using common_t = typename common<A, B>::type;
template <class A, class B>
using if_scalars = std::enable_if_t<metal::is_arithmetic_v<val_t<A>> && metal::is_arithmetic_v<val_t<B>>,
                                    common_t<val_t<A>, val_t<B>>>;

template <class T>
inline T max1(T a, T b) {
  if constexpr (metal::is_floating_point_v<T>) return T(__builtin_fmaxf(float(a), float(b)));
  else return a > b ? a : b;
}
template <class T>
inline T min1(T a, T b) {
  if constexpr (metal::is_floating_point_v<T>) return T(__builtin_fminf(float(a), float(b)));
  else return a < b ? a : b;
}
}  // namespace emu

namespace metal {
template <class A, class B>
inline emu::if_scalars<A, B> max(const A& a, const B& b) {
  using C = emu::if_scalars<A, B>;
  return emu::max1(C(emu::val_t<A>(a)), C(emu::val_t<B>(b)));
}
template <class A, class B>
inline emu::if_scalars<A, B> min(const A& a, const B& b) {
  using C = emu::if_scalars<A, B>;
  return emu::min1(C(emu::val_t<A>(a)), C(emu::val_t<B>(b)));
}
template <class X, class L, class H>
inline auto clamp(const X& x, const L& lo, const H& hi)
    -> std::enable_if_t<is_arithmetic_v<emu::val_t<X>>, emu::common_t<emu::if_scalars<X, L>, emu::val_t<H>>> {
  return min(max(x, lo), hi);
}
template <class T, int N>
inline vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = emu::max1(a[i], b[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = emu::min1(a[i], b[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> max(const vec<T, N>& a, typename std::common_type<T>::type b) { return max(a, vec<T, N>(b)); }
template <class T, int N>
inline vec<T, N> min(const vec<T, N>& a, typename std::common_type<T>::type b) { return min(a, vec<T, N>(b)); }
template <class T, int N>
inline vec<T, N> clamp(const vec<T, N>& x, const vec<T, N>& lo, const vec<T, N>& hi) {
  return min(max(x, lo), hi);
}
template <class T, int N>
inline vec<T, N> clamp(const vec<T, N>& x, typename std::common_type<T>::type lo,
                       typename std::common_type<T>::type hi) {
  return min(max(x, vec<T, N>(lo)), vec<T, N>(hi));
}

template <class X>
inline auto abs(const X& x) -> std::enable_if_t<is_arithmetic_v<emu::val_t<X>>, emu::val_t<X>> {
  using T = emu::val_t<X>;
  T v = x;
  if constexpr (is_floating_point_v<T>) return T(__builtin_fabsf(float(v)));
  else if constexpr (std::is_signed_v<T>) return v < 0 ? T(-v) : v;
  else return v;
}
template <class T, int N>
inline vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = abs(v[i]);
  return r;
}

template <class T>
inline T mix(T x, T y, T a) { return x + (y - x) * a; }
template <class T, int N>
inline vec<T, N> mix(const vec<T, N>& x, const vec<T, N>& y, typename std::common_type<T>::type a) {
  return x + (y - x) * a;
}
inline float smoothstep(float e0, float e1, float x) {
  float t = __builtin_fminf(__builtin_fmaxf((x - e0) / (e1 - e0), 0.0f), 1.0f);
  return t * t * (3.0f - 2.0f * t);
}

// select(a, b, c) is c ? b : a.
template <class A, class B>
inline emu::if_scalars<A, B> select(const A& a, const B& b, bool c) {
  using C = emu::if_scalars<A, B>;
  return c ? C(emu::val_t<B>(b)) : C(emu::val_t<A>(a));
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) { return c ? b : a; }

template <int N>
inline bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; i++)
    if (!v[i]) return false;
  return true;
}
template <int N>
inline bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; i++)
    if (v[i]) return true;
  return false;
}
inline bool all(bool v) { return v; }
inline bool any(bool v) { return v; }

template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; i++) s = s + a[i] * b[i];
  return s;
}
template <class T, int N>
inline T length_squared(const vec<T, N>& a) { return dot(a, a); }
template <class T, int N>
inline T length(const vec<T, N>& a) { return sqrt(dot(a, a)); }
template <class T, int N>
inline T distance(const vec<T, N>& a, const vec<T, N>& b) { return length(a - b); }
template <class T, int N>
inline vec<T, N> normalize(const vec<T, N>& a) { return a * rsqrt(dot(a, a)); }
template <class T>
inline vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
  return vec<T, 3>(a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0]);
}

// Integer functions.
template <class T>
inline std::enable_if_t<std::is_integral_v<T>, T> popcount(T x) {
  return T(__builtin_popcountll(static_cast<unsigned long long>(std::make_unsigned_t<T>(x))));
}
template <class T>
inline std::enable_if_t<std::is_integral_v<T>, T> clz(T x) {
  using U = std::make_unsigned_t<T>;
  U u = U(x);
  if (!u) return T(sizeof(T) * 8);
  return T(__builtin_clzll(u) - (64 - sizeof(T) * 8));
}
template <class T>
inline std::enable_if_t<std::is_integral_v<T>, T> ctz(T x) {
  using U = std::make_unsigned_t<T>;
  U u = U(x);
  if (!u) return T(sizeof(T) * 8);
  return T(__builtin_ctzll(u));
}
template <class T>
inline std::enable_if_t<std::is_integral_v<T>, T> reverse_bits(T x) {
  using U = std::make_unsigned_t<T>;
  U u = U(x), r = 0;
  for (size_t i = 0; i < sizeof(T) * 8; i++) r = U((r << 1) | ((u >> i) & 1));
  return T(r);
}
template <class T>
inline std::enable_if_t<std::is_integral_v<T>, T> rotate(T v, T n) {
  using U = std::make_unsigned_t<T>;
  constexpr unsigned W = sizeof(T) * 8;
  unsigned s = unsigned(U(n)) % W;
  U u = U(v);
  return s ? T(U(u << s) | U(u >> (W - s))) : v;
}
template <class T>
inline std::enable_if_t<std::is_integral_v<T>, T> extract_bits(T x, uint offset, uint bits) {
  using U = std::make_unsigned_t<T>;
  if (bits == 0) return T(0);
  U u = U(U(x) >> offset);
  if (bits < sizeof(T) * 8) u &= U((U(1) << bits) - 1);
  if constexpr (std::is_signed_v<T>) {
    if (bits < sizeof(T) * 8 && ((u >> (bits - 1)) & 1)) u |= U(~((U(1) << bits) - 1));
  }
  return T(u);
}
template <class T>
inline std::enable_if_t<std::is_integral_v<T>, T> insert_bits(T base, T insert, uint offset, uint bits) {
  using U = std::make_unsigned_t<T>;
  U mask = bits >= sizeof(T) * 8 ? U(~U(0)) : U((U(1) << bits) - 1);
  mask = U(mask << offset);
  return T((U(base) & ~mask) | ((U(insert) << offset) & mask));
}
inline int mulhi(int a, int b) { return int((long(a) * long(b)) >> 32); }
inline uint mulhi(uint a, uint b) { return uint((ulong(a) * ulong(b)) >> 32); }
template <class T>
inline std::enable_if_t<std::is_integral_v<T>, std::make_unsigned_t<T>> absdiff(T a, T b) {
  return a > b ? std::make_unsigned_t<T>(a - b) : std::make_unsigned_t<T>(b - a);
}

// precise:: and fast:: name the same functions; the emulator computes both
// in IEEE float (Metal's fast:: variants are less accurate on the GPU).
namespace precise {
using namespace ::metal;
}
namespace fast {
using namespace ::metal;
}

// ---------------------------------------------------------------------------
// Synchronization

enum class mem_flags : uint {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags(uint(a) & uint(b)); }

enum memory_order {
  memory_order_relaxed = 0,
  memory_order_acquire = 2,
  memory_order_release = 3,
  memory_order_acq_rel = 4,
  memory_order_seq_cst = 5,
};
enum thread_scope {
  thread_scope_thread = 0,
  thread_scope_threadgroup = 1,
  thread_scope_device = 2,
  thread_scope_simdgroup = 4,
};

inline void threadgroup_barrier(mem_flags = mem_flags::mem_none) { emu_rt_barrier(); }
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none) { emu_rt_simd(nullptr, nullptr, nullptr); }
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope = thread_scope_device) {}

// ---------------------------------------------------------------------------
// SIMD-group and quad-group functions. Each is a collective: the runtime
// gathers the lanes that reached the same call and runs one of the functions
// below over them. Lanes that have exited or wait elsewhere do not take part;
// reading from such a lane gives zero.

struct simd_vote {
  using vote_t = uint64_t;
  vote_t v_ = 0;
  vote_t active_ = 0;
  constexpr simd_vote() = default;
  explicit constexpr simd_vote(vote_t v) : v_(v), active_(~vote_t(0)) {}
  constexpr simd_vote(vote_t v, vote_t a) : v_(v), active_(a) {}
  explicit constexpr operator vote_t() const { return v_; }
  constexpr bool all() const { return (v_ & active_) == active_; }
  constexpr bool any() const { return v_ != 0; }
};
}  // namespace metal

namespace emu {
template <class T>
struct wide {
  using type = T;
};
template <>
struct wide<half> {
  using type = float;
};
template <>
struct wide<bfloat16_t> {
  using type = float;
};
template <class T, int N>
struct wide<metal::vec<T, N>> {
  using type = std::conditional_t<std::is_same_v<typename wide<T>::type, T>, metal::vec<T, N>,
                                  metal::vec<typename wide<T>::type, N>>;
};

template <class T>
inline T widen_back(const typename wide<T>::type& w) {
  if constexpr (std::is_same_v<typename wide<T>::type, T>) return w;
  else return T(w);
}

enum RedOp { R_SUM, R_PROD, R_MIN, R_MAX, R_AND, R_OR, R_XOR };

template <int Op, class W>
inline W combine(const W& a, const W& b) {
  if constexpr (Op == R_SUM) return a + b;
  else if constexpr (Op == R_PROD) return a * b;
  else if constexpr (Op == R_MIN) return metal::min(a, b);
  else if constexpr (Op == R_MAX) return metal::max(a, b);
  else if constexpr (Op == R_AND) return a & b;
  else if constexpr (Op == R_OR) return a | b;
  else return a ^ b;
}

template <class T>
inline T get(const emu_simd_group* g, int lane) {
  return *static_cast<const T*>(g->in[lane]);
}
template <class T>
inline void put(const emu_simd_group* g, int lane, const T& v) {
  *static_cast<T*>(g->out[lane]) = v;
}
inline bool active(const emu_simd_group* g, int lane) { return lane >= 0 && lane < 32 && ((g->mask >> lane) & 1); }

// Reduction over each group of W lanes, a pairwise tree over the active lanes.
template <class T, int Op, int W>
const char* reduce_fn(const emu_simd_group* g) {
  using Wd = typename wide<T>::type;
  for (int base = 0; base < 32; base += W) {
    Wd vals[W];
    int n = 0;
    for (int l = base; l < base + W; l++)
      if (active(g, l)) vals[n++] = Wd(get<T>(g, l));
    if (!n) continue;
    for (int step = 1; step < n; step *= 2)
      for (int i = 0; i + step < n; i += 2 * step) vals[i] = combine<Op>(vals[i], vals[i + step]);
    T r = widen_back<T>(vals[0]);
    for (int l = base; l < base + W; l++)
      if (active(g, l)) put<T>(g, l, r);
  }
  return nullptr;
}

// Inclusive or exclusive prefix over the active lanes of each group.
template <class T, int Op, int W, bool Inclusive>
const char* prefix_fn(const emu_simd_group* g) {
  using Wd = typename wide<T>::type;
  for (int base = 0; base < 32; base += W) {
    bool any = false;
    Wd acc = Op == R_PROD ? Wd(T(1)) : Wd(T(0));
    for (int l = base; l < base + W; l++) {
      if (!active(g, l)) continue;
      Wd v = Wd(get<T>(g, l));
      if (Inclusive) {
        acc = any ? combine<Op>(acc, v) : v;
        put<T>(g, l, widen_back<T>(acc));
      } else {
        put<T>(g, l, widen_back<T>(acc));
        acc = combine<Op>(acc, v);
      }
      any = true;
    }
  }
  return nullptr;
}

template <class T>
struct lane_arg {
  T v;
  int arg;
};
template <class T>
struct fill_arg {
  T v;
  T fill;
  int delta;
  int modulo;
};

enum ShufKind { S_IDX, S_UP, S_DOWN, S_XOR, S_ROT_UP, S_ROT_DOWN, S_BCAST, S_FIRST };

template <class T, int Kind, int W>
const char* shuffle_fn(const emu_simd_group* g) {
  int first = -1;
  for (int l = 0; l < 32; l++)
    if (active(g, l)) {
      first = l;
      break;
    }
  for (int l = 0; l < 32; l++) {
    if (!active(g, l)) continue;
    const lane_arg<T>& me = get<lane_arg<T>>(g, l);
    int base = l - l % W, i = l % W, src;
    if (Kind == S_IDX || Kind == S_BCAST) src = base + me.arg % W;
    else if (Kind == S_UP) src = i >= me.arg ? l - me.arg : l;
    else if (Kind == S_DOWN) src = i + me.arg < W ? l + me.arg : l;
    else if (Kind == S_XOR) src = base + ((i ^ me.arg) % W);
    else if (Kind == S_ROT_UP) src = base + ((i - me.arg % W + W) % W);
    else if (Kind == S_ROT_DOWN) src = base + ((i + me.arg) % W);
    else src = W == 32 ? first : -1;
    if (Kind == S_FIRST && W != 32) {
      src = -1;
      for (int k = base; k < base + W; k++)
        if (active(g, k)) {
          src = k;
          break;
        }
    }
    T r;
    if (active(g, src)) r = get<lane_arg<T>>(g, src).v;
    else __builtin_memset(static_cast<void*>(&r), 0, sizeof(T));
    put<T>(g, l, r);
  }
  return nullptr;
}

template <class T, bool Up>
const char* fill_fn(const emu_simd_group* g) {
  for (int l = 0; l < 32; l++) {
    if (!active(g, l)) continue;
    const fill_arg<T>& me = get<fill_arg<T>>(g, l);
    int seg = me.modulo > 0 && me.modulo <= 32 ? me.modulo : 32;
    int base = l - l % seg, i = l % seg, j = Up ? i - me.delta : i + me.delta;
    T r;
    __builtin_memset(static_cast<void*>(&r), 0, sizeof(T));
    if (j >= 0 && j < seg) {
      if (active(g, base + j)) r = get<fill_arg<T>>(g, base + j).v;
    } else {
      int k = base + (Up ? j + seg : j - seg);
      if (active(g, k)) r = get<fill_arg<T>>(g, k).fill;
    }
    put<T>(g, l, r);
  }
  return nullptr;
}

template <int W, int Kind>  // 0 all, 1 any, 2 ballot, 3 is_first, 4 active mask
const char* vote_fn(const emu_simd_group* g) {
  for (int base = 0; base < 32; base += W) {
    uint64_t ballot = 0, act = 0;
    int first = -1;
    for (int l = base; l < base + W; l++) {
      if (!active(g, l)) continue;
      if (first < 0) first = l;
      act |= uint64_t(1) << l;
      if (Kind < 3 && get<bool>(g, l)) ballot |= uint64_t(1) << l;
    }
    for (int l = base; l < base + W; l++) {
      if (!active(g, l)) continue;
      if (Kind == 0) put<bool>(g, l, ballot == act);
      else if (Kind == 1) put<bool>(g, l, ballot != 0);
      else if (Kind == 2) put<metal::simd_vote>(g, l, metal::simd_vote(ballot, act));
      else if (Kind == 3) put<bool>(g, l, l == first);
      else put<metal::simd_vote>(g, l, metal::simd_vote(act, act));
    }
  }
  return nullptr;
}

template <class T, int Op, int W>
inline T reduce(const T& v) {
  T r;
  emu_rt_simd(&v, &r, &reduce_fn<T, Op, W>);
  return r;
}
template <class T, int Op, int W, bool Inc>
inline T prefix(const T& v) {
  T r;
  emu_rt_simd(&v, &r, &prefix_fn<T, Op, W, Inc>);
  return r;
}
template <class T, int Kind, int W>
inline T shuffle(const T& v, int arg) {
  lane_arg<T> in{v, arg};
  T r;
  emu_rt_simd(&in, &r, &shuffle_fn<T, Kind, W>);
  return r;
}
template <class T, bool Up>
inline T fill(const T& v, const T& f, int delta, int modulo) {
  fill_arg<T> in{v, f, delta, modulo};
  T r;
  emu_rt_simd(&in, &r, &fill_fn<T, Up>);
  return r;
}
template <class R, int W, int Kind>
inline R vote(bool b) {
  R r;
  emu_rt_simd(&b, &r, &vote_fn<W, Kind>);
  return r;
}
}  // namespace emu

namespace metal {
#define EMU_RED(name, op, W) \
  template <class X> inline emu::val_t<X> name(const X& x) { return emu::reduce<emu::val_t<X>, emu::op, W>(x); }
EMU_RED(simd_sum, R_SUM, 32)
EMU_RED(simd_product, R_PROD, 32)
EMU_RED(simd_min, R_MIN, 32)
EMU_RED(simd_max, R_MAX, 32)
EMU_RED(simd_and, R_AND, 32)
EMU_RED(simd_or, R_OR, 32)
EMU_RED(simd_xor, R_XOR, 32)
EMU_RED(quad_sum, R_SUM, 4)
EMU_RED(quad_product, R_PROD, 4)
EMU_RED(quad_min, R_MIN, 4)
EMU_RED(quad_max, R_MAX, 4)
EMU_RED(quad_and, R_AND, 4)
EMU_RED(quad_or, R_OR, 4)
EMU_RED(quad_xor, R_XOR, 4)
#undef EMU_RED

#define EMU_PREFIX(name, op, W, inc) \
  template <class X> inline emu::val_t<X> name(const X& x) { return emu::prefix<emu::val_t<X>, emu::op, W, inc>(x); }
EMU_PREFIX(simd_prefix_inclusive_sum, R_SUM, 32, true)
EMU_PREFIX(simd_prefix_exclusive_sum, R_SUM, 32, false)
EMU_PREFIX(simd_prefix_inclusive_product, R_PROD, 32, true)
EMU_PREFIX(simd_prefix_exclusive_product, R_PROD, 32, false)
EMU_PREFIX(quad_prefix_inclusive_sum, R_SUM, 4, true)
EMU_PREFIX(quad_prefix_exclusive_sum, R_SUM, 4, false)
EMU_PREFIX(quad_prefix_inclusive_product, R_PROD, 4, true)
EMU_PREFIX(quad_prefix_exclusive_product, R_PROD, 4, false)
#undef EMU_PREFIX

#define EMU_SHUF(name, kind, W)                                         \
  template <class X>                                                    \
  inline emu::val_t<X> name(const X& x, ushort arg) {                   \
    return emu::shuffle<emu::val_t<X>, emu::kind, W>(x, int(arg));      \
  }
EMU_SHUF(simd_shuffle, S_IDX, 32)
EMU_SHUF(simd_broadcast, S_BCAST, 32)
EMU_SHUF(simd_shuffle_up, S_UP, 32)
EMU_SHUF(simd_shuffle_down, S_DOWN, 32)
EMU_SHUF(simd_shuffle_xor, S_XOR, 32)
EMU_SHUF(simd_shuffle_rotate_up, S_ROT_UP, 32)
EMU_SHUF(simd_shuffle_rotate_down, S_ROT_DOWN, 32)
EMU_SHUF(quad_shuffle, S_IDX, 4)
EMU_SHUF(quad_broadcast, S_BCAST, 4)
EMU_SHUF(quad_shuffle_up, S_UP, 4)
EMU_SHUF(quad_shuffle_down, S_DOWN, 4)
EMU_SHUF(quad_shuffle_xor, S_XOR, 4)
EMU_SHUF(quad_shuffle_rotate_up, S_ROT_UP, 4)
EMU_SHUF(quad_shuffle_rotate_down, S_ROT_DOWN, 4)
#undef EMU_SHUF
template <class X>
inline emu::val_t<X> simd_broadcast_first(const X& x) { return emu::shuffle<emu::val_t<X>, emu::S_FIRST, 32>(x, 0); }
template <class X>
inline emu::val_t<X> quad_broadcast_first(const X& x) { return emu::shuffle<emu::val_t<X>, emu::S_FIRST, 4>(x, 0); }

template <class X, class F>
inline emu::val_t<X> simd_shuffle_and_fill_up(const X& x, const F& f, ushort delta, ushort modulo = 32) {
  using T = emu::val_t<X>;
  return emu::fill<T, true>(T(x), T(f), delta, modulo);
}
template <class X, class F>
inline emu::val_t<X> simd_shuffle_and_fill_down(const X& x, const F& f, ushort delta, ushort modulo = 32) {
  using T = emu::val_t<X>;
  return emu::fill<T, false>(T(x), T(f), delta, modulo);
}
template <class X, class F>
inline emu::val_t<X> quad_shuffle_and_fill_up(const X& x, const F& f, ushort delta, ushort modulo = 4) {
  using T = emu::val_t<X>;
  return emu::fill<T, true>(T(x), T(f), delta, modulo);
}
template <class X, class F>
inline emu::val_t<X> quad_shuffle_and_fill_down(const X& x, const F& f, ushort delta, ushort modulo = 4) {
  using T = emu::val_t<X>;
  return emu::fill<T, false>(T(x), T(f), delta, modulo);
}

inline bool simd_all(bool b) { return emu::vote<bool, 32, 0>(b); }
inline bool simd_any(bool b) { return emu::vote<bool, 32, 1>(b); }
inline simd_vote simd_ballot(bool b) { return emu::vote<simd_vote, 32, 2>(b); }
inline bool simd_is_first() { return emu::vote<bool, 32, 3>(true); }
inline simd_vote simd_active_threads_mask() { return emu::vote<simd_vote, 32, 4>(true); }
inline bool simd_is_helper_thread() { return false; }
inline bool quad_all(bool b) { return emu::vote<bool, 4, 0>(b); }
inline bool quad_any(bool b) { return emu::vote<bool, 4, 1>(b); }
inline simd_vote quad_ballot(bool b) { return emu::vote<simd_vote, 4, 2>(b); }
inline bool quad_is_first() { return emu::vote<bool, 4, 3>(true); }
inline simd_vote quad_active_threads_mask() { return emu::vote<simd_vote, 4, 4>(true); }

// ---------------------------------------------------------------------------
// Atomics

template <class T>
struct atomic {
  T v_;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;
}  // namespace metal

namespace emu {
template <class P>
struct atomic_ptr;
template <class T>
struct atomic_ptr<metal::atomic<T>*> {
  using type = T;
  static T* addr(metal::atomic<T>* p, int) { return &p->v_; }
};
template <class T>
struct atomic_ptr<const metal::atomic<T>*> {
  using type = T;
  static T* addr(const metal::atomic<T>* p, int) { return const_cast<T*>(&p->v_); }
};
template <class T>
struct atomic_ptr<device_ptr<metal::atomic<T>>> {
  using type = T;
  static T* addr(const device_ptr<metal::atomic<T>>& p, int rw) {
    if (!p.d_) emu_rt_fail("atomic on a null device pointer");
    check(p.d_, p.p_, sizeof(T), alignof(T), rw >> 1);
    // Another thread's atomic may run concurrently on another worker.
    if (rw & 1) __atomic_fetch_add(&p.d_->read, sizeof(T), __ATOMIC_RELAXED);
    if (rw & 2) __atomic_fetch_add(&p.d_->written, sizeof(T), __ATOMIC_RELAXED);
    return reinterpret_cast<T*>(p.p_);
  }
};
template <class T>
struct atomic_ptr<device_ptr<const metal::atomic<T>>> {
  using type = T;
  static T* addr(const device_ptr<const metal::atomic<T>>& p, int) {
    check(p.d_, p.p_, sizeof(T), alignof(T), 0);
    p.d_->read += sizeof(T);
    return reinterpret_cast<T*>(p.p_);
  }
};
template <class T>
struct atomic_ptr<tg_ptr<metal::atomic<T>>> {
  using type = T;
  static T* addr(const tg_ptr<metal::atomic<T>>& p, int rw) { return &p.addr(0, rw >> 1)->v_; }
};
template <class T, size_t N>
struct atomic_ptr<tg_array<metal::atomic<T>, N>> : atomic_ptr<tg_ptr<metal::atomic<T>>> {};

template <class P>
using atomic_t = typename atomic_ptr<std::remove_cv_t<std::remove_reference_t<P>>>::type;
template <class P>
inline atomic_t<P>* atomic_addr(const P& p, int rw) {
  return atomic_ptr<std::remove_cv_t<std::remove_reference_t<P>>>::addr(p, rw);
}

template <class T, class F>
inline T atomic_update(T* p, F f) {
  if constexpr (std::is_integral_v<T> && sizeof(T) >= 4) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(p, &old, T(f(old)), true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
  } else {
    using U = std::conditional_t<sizeof(T) == 4, uint32_t, std::conditional_t<sizeof(T) == 8, uint64_t,
                                 std::conditional_t<sizeof(T) == 2, uint16_t, uint8_t>>>;
    U* q = reinterpret_cast<U*>(p);
    U old = __atomic_load_n(q, __ATOMIC_RELAXED);
    for (;;) {
      T o = __builtin_bit_cast(T, old);
      U nw = __builtin_bit_cast(U, T(f(o)));
      if (__atomic_compare_exchange_n(q, &old, nw, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return o;
    }
  }
}
}  // namespace emu

namespace metal {
template <class P, class... S>
inline emu::atomic_t<P> atomic_load_explicit(const P& p, memory_order, S...) {
  using T = emu::atomic_t<P>;
  T* a = emu::atomic_addr(p, 1);
  return __builtin_bit_cast(T, __atomic_load_n(reinterpret_cast<std::conditional_t<
      sizeof(T) == 8, uint64_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint8_t>>*>(a), __ATOMIC_RELAXED));
}
template <class P, class U, class... S>
inline void atomic_store_explicit(const P& p, U v, memory_order, S...) {
  using T = emu::atomic_t<P>;
  T* a = emu::atomic_addr(p, 2);
  emu::atomic_update(a, [&](T) { return T(v); });
}
template <class P, class U, class... S>
inline emu::atomic_t<P> atomic_exchange_explicit(const P& p, U v, memory_order, S...) {
  using T = emu::atomic_t<P>;
  return emu::atomic_update(emu::atomic_addr(p, 3), [&](T) { return T(v); });
}
#define EMU_ATOMIC_RMW(name, expr)                                              \
  template <class P, class U, class... S>                                       \
  inline emu::atomic_t<P> name(const P& p, U v, memory_order, S...) {           \
    using T = emu::atomic_t<P>;                                                 \
    T b = T(v);                                                                 \
    return emu::atomic_update(emu::atomic_addr(p, 3), [&](T a) { return expr; }); \
  }
EMU_ATOMIC_RMW(atomic_fetch_add_explicit, T(a + b))
EMU_ATOMIC_RMW(atomic_fetch_sub_explicit, T(a - b))
EMU_ATOMIC_RMW(atomic_fetch_and_explicit, T(a & b))
EMU_ATOMIC_RMW(atomic_fetch_or_explicit, T(a | b))
EMU_ATOMIC_RMW(atomic_fetch_xor_explicit, T(a ^ b))
EMU_ATOMIC_RMW(atomic_fetch_min_explicit, (b < a ? b : a))
EMU_ATOMIC_RMW(atomic_fetch_max_explicit, (b > a ? b : a))
#undef EMU_ATOMIC_RMW

template <class P, class E, class U, class... S>
inline bool atomic_compare_exchange_weak_explicit(const P& p, E expected, U desired, memory_order,
                                                  memory_order, S...) {
  using T = emu::atomic_t<P>;
  T* a = emu::atomic_addr(p, 3);
  T want = *expected;
  T d = T(desired);
  bool done = false;
  T old = emu::atomic_update(a, [&](T cur) {
    done = __builtin_memcmp(&cur, &want, sizeof(T)) == 0;
    return done ? d : cur;
  });
  if (!done) *expected = old;
  return done;
}
template <class P, class E, class U, class... S>
inline bool atomic_compare_exchange_strong_explicit(const P& p, E expected, U desired, memory_order a,
                                                    memory_order b, S... s) {
  return atomic_compare_exchange_weak_explicit(p, expected, desired, a, b, s...);
}

// ---------------------------------------------------------------------------
// simdgroup_matrix: 8x8, two elements per lane in the layout MLX's steel
// kernels rely on (lane l holds row (l/4 & 4) + (l/2) % 4, columns
// (l/4 & 2) * 2 + (l % 2) * 2 and the next one).

template <class T, int R, int C>
struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "the emulator supports 8x8 simdgroup matrices");
  vec<T, 2> e_;
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diag) {
    uint l = emu_rt_lane();
    uint row = ((l / 4) & 4) + (l / 2) % 4, col = ((l / 4) & 2) * 2 + (l % 2) * 2;
    e_[0] = row == col ? diag : T(0);
    e_[1] = row == col + 1 ? diag : T(0);
  }
  vec<T, 2>& thread_elements() { return e_; }
  const vec<T, 2>& thread_elements() const { return e_; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat16_t, 8, 8> simdgroup_bfloat8x8;

template <class T, int R, int C>
inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, R, C> m;
  m.e_ = vec<T, 2>(v);
  return m;
}
}  // namespace metal

namespace emu {
inline void frag_coord(uint l, uint& row, uint& col) {
  row = ((l / 4) & 4) + (l / 2) % 4;
  col = ((l / 4) & 2) * 2 + (l % 2) * 2;
}
struct mma_in {
  const void* a;
  const void* b;
  const void* c;  // null: no accumulator
};
template <class TD, class TA, class TB, class TC>
const char* mma_fn(const emu_simd_group* g) {
  if (g->mask != 0xFFFFFFFFu)
    return "simdgroup_multiply_accumulate needs all 32 lanes of the simdgroup active";
  float A[8][8], B[8][8], Cm[8][8];
  for (uint l = 0; l < 32; l++) {
    const mma_in& in = get<mma_in>(g, l);
    uint r, c;
    frag_coord(l, r, c);
    for (int k = 0; k < 2; k++) {
      A[r][c + k] = float(static_cast<const metal::vec<TA, 2>*>(in.a)->v_[k]);
      B[r][c + k] = float(static_cast<const metal::vec<TB, 2>*>(in.b)->v_[k]);
      Cm[r][c + k] = in.c ? float(static_cast<const metal::vec<TC, 2>*>(in.c)->v_[k]) : 0.0f;
    }
  }
  for (uint l = 0; l < 32; l++) {
    uint r, c;
    frag_coord(l, r, c);
    metal::vec<TD, 2>* out = static_cast<metal::vec<TD, 2>*>(g->out[l]);
    for (int k = 0; k < 2; k++) {
      float acc = Cm[r][c + k];
      for (int i = 0; i < 8; i++) acc = __builtin_fmaf(A[r][i], B[i][c + k], acc);
      out->v_[k] = TD(acc);
    }
  }
  return nullptr;
}
}  // namespace emu

namespace metal {
template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b,
                                          const simdgroup_matrix<TC, 8, 8>& c) {
  emu::mma_in in{&a.e_, &b.e_, &c.e_};
  vec<TD, 2> r;
  emu_rt_simd(&in, &r, &emu::mma_fn<TD, TA, TB, TC>);
  d.e_ = r;
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b) {
  emu::mma_in in{&a.e_, &b.e_, nullptr};
  vec<TD, 2> r;
  emu_rt_simd(&in, &r, &emu::mma_fn<TD, TA, TB, TD>);
  d.e_ = r;
}

// Each lane loads and stores its own two elements.
template <class T, class P>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const P& src, size_t elements_per_row = 8,
                           vec<ulong, 2> origin = vec<ulong, 2>(0), bool transpose = false) {
  uint r, c;
  emu::frag_coord(emu_rt_lane(), r, c);
  for (uint k = 0; k < 2; k++) {
    uint row = transpose ? c + k : r, col = transpose ? r : c + k;
    d.e_[k] = T(src[(origin[1] + row) * elements_per_row + origin[0] + col]);
  }
}
template <class T, class P>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& a, const P& dst, size_t elements_per_row = 8,
                            vec<ulong, 2> origin = vec<ulong, 2>(0), bool transpose = false) {
  uint r, c;
  emu::frag_coord(emu_rt_lane(), r, c);
  for (uint k = 0; k < 2; k++) {
    uint row = transpose ? c + k : r, col = transpose ? r : c + k;
    dst[(origin[1] + row) * elements_per_row + origin[0] + col] = a.e_[k];
  }
}
}  // namespace metal

using namespace metal;
