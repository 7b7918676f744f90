// The geometry every ternary kernel shares, independent of MLX and of the ISA: dtypes and their
// conversions, the steps of a packed row (both layouts of docs/FORMAT.md), where Q8_K segments
// end in them, the prepared activations and the bound layer. The row kernels (ternary.h) and
// the Q8_K kernels (q8k.h) both include it; neither includes the other's header for it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
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


constexpr int Q8K_BLOCK = 256;  // ggml's QK_K
constexpr float Q8K_QMAX = 127.f;

constexpr int Q8K_TILE_ROWS = 2, Q8K_TILE_TOKENS = 4;  // rows of one pair, tokens of a tile
// int16 terms a lane may add up within one segment: each |term| <= 2 * 2 * 128
constexpr int Q8K_TILE_I16_TERMS = 32767 / 512;

// Whether rows_q8k_tile (below) applies: fast packing, every segment at most
// Q8K_TILE_I16_TERMS code vectors long.
inline bool q8k_tile_ok(const Geometry& g) {
  if (g.packing != FAST || !g.q8k_ok) return false;
  int64_t run = 0;
  for (const Step& st : g.steps) {
    run += g.nv;
    if (run > Q8K_TILE_I16_TERMS) return false;
    if (st.seg >= 0) run = 0;
  }
  return true;
}

// Whether the 512-bit windows (rows_q8k_wide_tile, rows_q8k_r8w) apply: the tiles do, and
// every segment is exactly two whole steps, window j = steps 2j and 2j + 1 = segment j (a
// row of whole 256-column blocks with one scale per block, row or tensor: TQ1_0 / TQ2_0 as
// llama.cpp writes them, converted to fast packing).
inline bool q8k_wide_ok(const Geometry& g) {
  const int64_t nsteps = (int64_t)g.steps.size();
  if (!g.q8k_tile || nsteps % 2 || g.nseg != nsteps / 2) return false;
  for (int64_t s = 0; s < nsteps; s++) {
    const Step& st = g.steps[s];
    if (st.valid != 32 || st.off != 32 * s || st.seg != (s % 2 ? s / 2 : -1)) return false;
  }
  return true;
}

// Segments of the row and the step that ends each. A step whose columns span two segments
// (compact rows longer than 320 columns with one scale, fast packing with groups of 64)
// leaves q8k_ok false: the Python side runs the reference twin there.
inline void plan_q8k(Geometry& g) {
  g.seg_len = g.group && g.group < Q8K_BLOCK ? g.group : Q8K_BLOCK;
  g.nseg = ceil_div(g.k, g.seg_len);
  g.nblocks8 = ceil_div(g.k, Q8K_BLOCK);
  g.q8k_ok = true;
  const int64_t per_step = (int64_t)g.nv * 32, nsteps = (int64_t)g.steps.size();
  std::vector<int64_t> seg_of(nsteps, -1);
  for (int64_t s = 0; s < nsteps; s++) {
    int64_t lo = -1, hi = -1;
    for (int64_t p = s * per_step; p < (s + 1) * per_step; p++) {
      const int64_t c = g.perm[p];
      if (c < 0) continue;
      lo = lo < 0 ? c : std::min(lo, c), hi = std::max(hi, c);
    }
    if (lo < 0) {  // no column: belongs to the segment before
      seg_of[s] = s ? seg_of[s - 1] : 0;
      continue;
    }
    if (lo / g.seg_len != hi / g.seg_len || (s && lo / g.seg_len < seg_of[s - 1]))
      g.q8k_ok = false;
    seg_of[s] = lo / g.seg_len;
  }
  for (int64_t s = 0; s < nsteps; s++)
    g.steps[s].seg = (s + 1 == nsteps || seg_of[s + 1] != seg_of[s]) ? (int32_t)seg_of[s] : -1;
  g.seg_group.resize(g.nseg), g.seg_block.resize(g.nseg);
  for (int64_t j = 0; j < g.nseg; j++) {
    g.seg_group[j] = (int32_t)(g.group ? j * g.seg_len / g.group : 0);
    g.seg_block[j] = (int32_t)(j * g.seg_len / Q8K_BLOCK);
  }
  g.q8k_tile = q8k_tile_ok(g);
  g.q8k_wide = q8k_wide_ok(g);
}

// One block of n <= 256 floats as ggml's Q8_K, in place (x becomes q, integer-valued floats);
// returns d. The AVX2 loops compute the same values as the scalar ones: max |x| is exact in
// any order, the product is one float32 multiply, and vroundps rounds half to even as

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

// std::allocator on 64-byte boundaries: rows whose bytes are a multiple of 64 start on a cache
// line, so that no 32-byte load of them straddles two (a large malloc returns 16 bytes past
// one: every other load split, measured 1.1x slower q8k tiles on AVX2, Zen 4).
template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return (T*)::operator new(n * sizeof(T), std::align_val_t(64)); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const LineAllocator<U>&) const { return true; }
};

struct Acts {
  std::vector<int8_t, LineAllocator<int8_t>> q;  // (M, xlen) int8
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

}  // namespace tk
