// llama.cpp's activation numerics for ternary layers (runtime/q8k.py is the reference twin):
// each 256-column block of a token is quantized as ggml's Q8_K - amax = max |x|, top = the
// signed x of the first column reaching it, iscale = -127 / top, q = min(127, round(iscale x))
// half to even, d = 1 / iscale, all zero for an all-zero block - and a row's output is
//     y = sum over segments, in column order, of float(sum q t) * (d_block * s)
// where a segment is one block (ggml's TQ1_0/TQ2_0 x Q8_K dot product), cut at the scale
// groups where those are smaller (64, 128). K is zero-padded to whole blocks.
//
// The int8 row kernel's machinery is reused: codes c = t + 1 accumulate sum(c q) in int32
// lanes; at the step that ends a segment the lanes are summed, the segment's sum(q)
// subtracted, and the float accumulation of ggml done in scalar float32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../arch/select.h"
#include "layer.h"

namespace tk {

// nearbyint does.
inline float q8k_block(float* x, int64_t n) {
  float amax = 0.f;
  int64_t i = 0;
  i = native::absmax_head(x, n, amax);
  for (; i < n; i++) amax = std::max(amax, std::fabs(x[i]));
  if (!(amax > 0.f)) {
    std::fill(x, x + n, 0.f);
    return 0.f;
  }
  float top = 0.f;
  for (i = 0; i < n; i++)
    if (std::fabs(x[i]) == amax) {
      top = x[i];
      break;
    }
  const float iscale = -Q8K_QMAX / top;
  i = 0;
  i = native::round_clamp_head(x, n, iscale, Q8K_QMAX);
  for (; i < n; i++) x[i] = std::min(Q8K_QMAX, std::nearbyint(iscale * x[i]));
  return 1.f / iscale;
}

// Fast packing's activation order (layer.h column_of) for the whole 128-column steps of
// codes c: position 32 v + b of a step holds column 4 b + v. Returns the positions written.
inline int64_t fast_order(const int8_t* c, int64_t k, int8_t* q) {
  int64_t s = 0;
  s = native::fast_order_head(c, k, q) / 128;
  return 128 * s;
}

// Floats of quantize_token_q8k's scratch: K floats, then K + 1 bytes.
inline int64_t q8k_tmp_floats(int64_t k) { return k + (k + 4) / 4; }

// One block of n <= 256 floats of x as ggml's Q8_K codes at q; returns d. The ISA's whole-block
// body where it has one (native::q8k_block_head: the same values), else q8k_block on a copy in
// tmp (n floats).
inline float q8k_block_codes(const float* x, int64_t n, int8_t* q, float* tmp) {
  float d;
  if (native::q8k_block_head(x, n, q, d)) return d;
  std::memcpy(tmp, x, n * sizeof(float));
  d = q8k_block(tmp, n);
  for (int64_t i = 0; i < n; i++) q[i] = (int8_t)tmp[i];
  return d;
}

// Token m of x -> ggml's Q8_K codes at a.q[m] (permuted), d at a.d8[m], segment sums at
// a.ssum[m]; tmp holds q8k_tmp_floats(K).
inline void quantize_token_q8k(const Geometry& g, const void* x, int dtype, int64_t m, Acts& a,
                               float* tmp) {
  const int64_t k = g.k;
  const float* xf = (const float*)x + m * k;
  if (dtype != F32) {  // float16 widened by vectors (exact; only a signalling NaN turns quiet)
    int64_t i = dtype == F16 ? native::f16_widen_head((const uint16_t*)x + m * k, k, tmp) : 0;
    for (; i < k; i++) tmp[i] = load_as_f32(x, dtype, m * k + i);
    xf = tmp;
  }
  int8_t* qc = (int8_t*)(tmp + k);  // the codes in column order, a zero after them
  float* d = a.d8.data() + m * g.nblocks8;
  for (int64_t b = 0; b < g.nblocks8; b++) {
    const int64_t i0 = b * Q8K_BLOCK, i1 = std::min<int64_t>(k, i0 + Q8K_BLOCK);
    d[b] = q8k_block_codes(xf + i0, i1 - i0, qc + i0, tmp + i0);
  }
  int32_t* ss = a.ssum.data() + m * g.nseg;
  for (int64_t j = 0; j < g.nseg; j++) {
    const int64_t i0 = j * g.seg_len, n = std::min<int64_t>(k, (j + 1) * g.seg_len) - i0;
    int32_t sum = 0;
    for (int64_t i = native::sum_i8_head(qc + i0, n, sum); i < n; i++) sum += qc[i0 + i];
    ss[j] = sum;
  }
  qc[k] = 0;
  int8_t* q = a.q.data() + m * g.xlen();
  int64_t p = g.packing == FAST ? fast_order(qc, k, q) : 0;
  const int64_t* perm = g.perm.data();
  for (; p < g.xlen(); p++) q[p] = qc[perm[p] < 0 ? k : perm[p]];
}

// Rows [n0, n1) for tokens m0 .. m0 + T - 1 with q8k activations.
template <class O, int NV, int T>
void rows_q8k(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0) {
  const Geometry& g = L.g;
  const int64_t xlen = g.xlen(), nsteps = (int64_t)g.steps.size();
  const int8_t* xb[T];
  for (int t = 0; t < T; t++) xb[t] = a.q.data() + (m0 + t) * xlen;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* w = L.w + n * g.row_bytes;
    typename O::IA acc[T];
    float y[T];
    for (int t = 0; t < T; t++) acc[t] = O::izero(), y[t] = 0.f;
    for (int64_t s = 0; s < nsteps; s++) {
      const Step& st = g.steps[s];
      __builtin_prefetch(w + st.off + PREFETCH_BYTES);
      typename O::V c[NV];
      decode_step<O, NV>(w + st.off, st.valid, c);
      for (int t = 0; t < T; t++) O::template idot<NV>(acc[t], c, xb[t] + s * NV * 32);
      if (st.seg < 0) continue;
      const int64_t seg = st.seg, col = seg * g.seg_len;
      const float sc = L.scale(n, L.scale_kind == 2 ? col / g.group : 0);
      for (int t = 0; t < T; t++) {
        const int64_t m = m0 + t;
        const int32_t sumi = O::isum(acc[t]) - a.ssum[m * g.nseg + seg];
        y[t] += (float)sumi * (a.d8[m * g.nblocks8 + col / Q8K_BLOCK] * sc);
        acc[t] = O::izero();
      }
    }
    const float b = L.bias_at(n);
    for (int t = 0; t < T; t++) store_from_f32(L.out, L.out_dtype, (m0 + t) * g.n + n, y[t] + b);
  }
}


// ----------------------------------------------------------------------------------------------
// Many tokens, fast packing: tiles of 2 (or 4) rows x 4 tokens (ISAs with has_q8k_tile)
// ----------------------------------------------------------------------------------------------
//
// The same sums as rows_q8k, computed as a small integer GEMM: per 32-byte step each row's
// code vectors are decoded once and each activation vector is loaded once for all the rows;
// the 8 (row, token) accumulators of a pair of rows are reduced together at a segment's end
// (one vector, lane = pair) and the float32 epilogue y + float(sumi - ssum) * (d * s) runs
// lane by lane - the order and rounding of the scalar epilogue, so results are bit-identical
// to rows_q8k. ISAs with q8k_tile_pairs = 2 (32 vector registers) run two pairs at once.

template <class O, class = void>
struct HasQ8kTile : std::false_type {};
template <class O>
struct HasQ8kTile<O, std::void_t<decltype(O::has_q8k_tile)>> : std::true_type {};
// ISAs with an i8mm (SMMLA) tile of their own for the token tiles: arch/neon.h
template <class O, class = void>
struct HasMmla : std::false_type {};
template <class O>
struct HasMmla<O, std::void_t<decltype(O::has_mmla)>> : std::true_type {};

// The partial last step of rows w, w + row_bytes, ... (R of them), zero-padded into tail
// (32 bytes a row), so that the row loops read every step with whole-vector loads.
inline void copy_tails(const Geometry& g, const uint8_t* w, int R, uint8_t* tail) {
  const Step& last = g.steps.back();
  if (last.valid == 32) return;
  for (int r = 0; r < R; r++) {
    std::memset(tail + 32 * r, 0, 32);
    std::memcpy(tail + 32 * r, w + r * g.row_bytes + last.off, last.valid);
  }
}

// A tile's results for rows n, n + 1 (lanes 0-3 / 4-7 of y: tokens m0 .. m0 + 3) with their
// biases; the first `valid` tokens are stored.
template <class O>
inline void store_pair(const Layer& L, int64_t n, int64_t m0, int valid, typename O::FV y) {
  alignas(32) float out[8];
  O::fvstore(out, y);
  for (int r = 0; r < 2; r++) {
    const float b = L.bias_at(n + r);
    for (int t = 0; t < valid; t++)
      store_from_f32(L.out, L.out_dtype, (m0 + t) * L.g.n + n + r, out[Q8K_TILE_TOKENS * r + t] + b);
  }
}

// Rows [n0, n1) (a multiple of 2 RP) for tokens m0 .. m0 + valid - 1 (valid <= 4; a short
// tile repeats its last token in the unused lanes and stores nothing from them), RP pairs of
// rows at a time (RP = 2 where the ISA has the registers: 16 accumulators). `seg4` holds,
// per segment, the 4 lanes' segment sums and `d4` their block scales d; `sc` the float32
// scale of each row of [n0, ...) and segment (row-major, nseg a row).
template <class O, int RP>
void rows_q8k_tile(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0, int valid,
                   const int32_t* seg4, const float* d4, const float* sc, int64_t nsc) {
  constexpr int T = Q8K_TILE_TOKENS, R = 2 * RP;
  const Geometry& g = L.g;
  const int64_t xlen = g.xlen(), nsteps = (int64_t)g.steps.size(), rb = g.row_bytes;
  const int8_t* xb[T];
  for (int t = 0; t < T; t++) xb[t] = a.q.data() + (m0 + std::min(t, valid - 1)) * xlen;
  alignas(32) uint8_t tail[32 * R];
  for (int64_t n = n0; n + R <= n1; n += R) {
    const uint8_t* w = L.w + n * rb;
    const float* scn = sc + (n - n0) * nsc;
    copy_tails(g, w, R, tail);
    typename O::FV y[RP];
    for (int q = 0; q < RP; q++) y[q] = O::fvzero();
    // segment by segment: the accumulators live in registers for one segment's steps
    for (int64_t s = 0; s < nsteps;) {
      typename O::TA acc[RP][8];
#pragma GCC unroll 2
      for (int q = 0; q < RP; q++)
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) acc[q][i] = O::tzero();
      int64_t seg;
      for (;; s++) {
        const Step& st = g.steps[s];
        const uint8_t* p = w + st.off;
        int64_t stride = rb;
        if (st.valid != 32) {  // the rows' last step, zero-padded (no call in this loop)
          p = tail, stride = 32;
        } else {
          for (int r = 0; r < R; r++) __builtin_prefetch(p + r * rb + PREFETCH_BYTES);
        }
        typename O::V wr[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) wr[r] = O::load(p + r * stride);
        const int64_t off = s * 4 * 32;
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
          typename O::V c[R];
#pragma GCC unroll 4
          for (int r = 0; r < R; r++) c[r] = O::code(wr[r], v);
#pragma GCC unroll 4
          for (int t = 0; t < T; t++) {
            const typename O::V x = O::xload(xb[t] + off + 32 * v);
#pragma GCC unroll 2
            for (int q = 0; q < RP; q++) {
              O::tdot(acc[q][t], c[2 * q], x);
              O::tdot(acc[q][T + t], c[2 * q + 1], x);
            }
          }
        }
        if (st.seg >= 0) {  // the last step of a row always ends a segment
          seg = st.seg, s++;
          break;
        }
      }
#pragma GCC unroll 2
      for (int q = 0; q < RP; q++)
        y[q] = O::tstep(y[q], O::tsum8(acc[q]), seg4 + T * seg, d4 + T * g.seg_block[seg],
                        scn[2 * q * nsc + seg], scn[(2 * q + 1) * nsc + seg]);
    }
    for (int q = 0; q < RP; q++) store_pair<O>(L, n + 2 * q, m0, valid, y[q]);
  }
}

template <class O, class = void>
struct Q8kTilePairs : std::integral_constant<int, 1> {};
template <class O>
struct Q8kTilePairs<O, std::void_t<decltype(O::q8k_tile_pairs)>>
    : std::integral_constant<int, O::q8k_tile_pairs> {};

// ----------------------------------------------------------------------------------------------
// Many tokens on 16 vector registers: tiles of 1 row x 8 tokens (ISAs with q8k_tile_tokens)
// ----------------------------------------------------------------------------------------------
//
// The same sums once more, shaped for AVX2's 16 registers (ik_llama.cpp's AVX2 IQ2_BN kernel
// has this shape; from its q8k_panel_min_tokens on, rows of whole 256-column segments take
// the row panels below instead): a row's 4 code vectors of a step are decoded once for 8
// tokens, each activation vector is read once per row (an operand from L1, no register), and the 8
// accumulators, one per token, are reduced at a segment's end into one vector (lane t =
// token t) for the float32 epilogue y + float(sumi - ssum) * (d * s), lane by lane: the
// scalar epilogue's order and rounding, so the same bits as rows_q8k.

template <class O, class = void>
struct Q8kTileTokens : std::integral_constant<int, Q8K_TILE_TOKENS> {};
template <class O>
struct Q8kTileTokens<O, std::void_t<decltype(O::q8k_tile_tokens)>>
    : std::integral_constant<int, O::q8k_tile_tokens> {};

constexpr int Q8K_T8 = 8;
// Steps of a part of a row (rows_q8k_t8): 8 tokens x 16 steps x 128 bytes = 16 KB of activations
constexpr int64_t Q8K_T8_PART_STEPS = 16;

// Rows [n0, n1) for tokens m0 .. m0 + valid - 1 (valid <= 8; a short tile repeats its last
// token in the unused lanes and stores nothing from them). `seg8` holds, per segment, the 8
// lanes' segment sums, `d8` per block their scales d, `sc` the float32 scale of each row of
// [n0, ...) and segment (row-major, nsc a row).
template <class O>
void rows_q8k_t8(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0, int valid,
                 const int32_t* seg8, const float* d8, const float* sc, int64_t nsc) {
  constexpr int T = Q8K_T8;
  const Geometry& g = L.g;
  const int64_t xlen = g.xlen(), nsteps = (int64_t)g.steps.size();
  const Step* steps = g.steps.data();
  const int32_t* seg_block = g.seg_block.data();
  const int8_t* xb[T];
  for (int t = 0; t < T; t++) xb[t] = a.q.data() + (m0 + std::min(t, valid - 1)) * xlen;
  // Rows longer than Q8K_T8_PART_STEPS steps run in parts that end with a segment, every row
  // of the range one part after another (the sums of a row keep their order): the 8 tokens'
  // activations of a part stay in L1 for all the rows
  thread_local std::vector<float> ys_buf;  // the rows' 8 lanes between parts
  ys_buf.assign(T * (n1 - n0), 0.f);
  float* ys = ys_buf.data();
  alignas(32) uint8_t tail[32];
  for (int64_t s0 = 0; s0 < nsteps;) {
    int64_t s1 = s0;  // the part's steps [s0, s1)
    while (s1 < nsteps && (s1 - s0 < Q8K_T8_PART_STEPS || steps[s1 - 1].seg < 0)) s1++;
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* w = L.w + n * g.row_bytes;
      const float* scn = sc + (n - n0) * nsc;
      if (s1 == nsteps) copy_tails(g, w, 1, tail);
      typename O::FV y = O::fvload(ys + T * (n - n0));
      typename O::TA acc[T];
#pragma GCC unroll 8
      for (int t = 0; t < T; t++) acc[t] = O::tzero();
      for (int64_t s = s0; s < s1; s++) {
        const Step& st = steps[s];
        const uint8_t* p = st.valid == 32 ? w + st.off : tail;
        __builtin_prefetch(p + PREFETCH_BYTES);
        const typename O::V wr = O::load(p);
        const typename O::V c[4] = {O::code(wr, 0), O::code(wr, 1), O::code(wr, 2), O::code(wr, 3)};
        const int64_t off = s * 4 * 32;
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) O::tdot4(acc[t], c, xb[t] + off);
        if (st.seg < 0) continue;
        const int64_t seg = st.seg;  // a part's (and a row's) last step ends a segment
        typename O::TA red[T];  // a copy (tsum8 resets it): acc, never addressed, stays in registers
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) red[t] = acc[t], acc[t] = O::tzero();
        y = O::tstep_tokens(y, O::tsum8(red), seg8 + T * seg, d8 + T * seg_block[seg], scn[seg]);
      }
      O::fvstore(ys + T * (n - n0), y);
    }
    s0 = s1;
  }
  for (int64_t n = n0; n < n1; n++) {
    const float b = L.bias_at(n);
    for (int t = 0; t < valid; t++)
      store_from_f32(L.out, L.out_dtype, (m0 + t) * g.n + n, ys[T * (n - n0) + t] + b);
  }
}

// The tokens rows_q8k_tiled runs through rows_q8k_t8: whole tiles of 8, and a short one of
// 5-7 (fewer go through the 4-token tiles, wasting less); returns the first token left.
// `sc` as rows_q8k_t8's.
template <class O>
int64_t rows_q8k_tiled8(const Layer& L, const Acts& a, int64_t M, int64_t n0, int64_t n1,
                        const float* sc) {
  constexpr int T = Q8K_T8;
  const Geometry& g = L.g;
  const int64_t end = M % T > Q8K_TILE_TOKENS ? M : M / T * T;
  if (end == 0) return 0;
  thread_local std::vector<int32_t> seg8_buf;
  thread_local std::vector<float> d8_buf;
  seg8_buf.resize(T * g.nseg), d8_buf.resize(T * g.nblocks8);
  int32_t* seg8 = seg8_buf.data();
  float* d8 = d8_buf.data();
  for (int64_t m = 0; m < end; m += T) {
    const int valid = (int)std::min<int64_t>(T, end - m);
    for (int t = 0; t < T; t++) {
      const int64_t mt = m + std::min(t, valid - 1);
      for (int64_t j = 0; j < g.nseg; j++) seg8[T * j + t] = a.ssum[mt * g.nseg + j];
      for (int64_t j = 0; j < g.nblocks8; j++) d8[T * j + t] = a.d8[mt * g.nblocks8 + j];
    }
    rows_q8k_t8<O>(L, a, n0, n1, m, valid, seg8, d8, sc, g.nseg);
  }
  return end;
}

// ----------------------------------------------------------------------------------------------
// Few tokens (decode), fast packing: blocks of 8 rows per token (ISAs with has_q8k_tile)
// ----------------------------------------------------------------------------------------------
//
// One token against 8 rows at a time, with the tile's operations: one accumulator per row
// (lane r of the segment's reduction = row r), each activation vector loaded once for the 8
// rows. The row kernel's single accumulator is a chain of dependent dot products (with VNNI
// every vpdpbusd waits for the one before); 8 independent chains keep the multipliers busy,
// and the reductions and the float32 epilogue run for 8 rows at once. The epilogue is the
// scalar one's y + float(sumi - ssum) * (d * s) lane by lane (integer sums are exact in any
// order): the same bits as rows_q8k, whatever path the other tokens of the call take.

constexpr int Q8K_ROW_BLOCK = 8;

// The scales of rows n .. n + 7 for group gi (or their tensor / row scale) as float32, the
// values L.scale gives (float16 through F16C where this build has it: exact, and the
// software conversion where a half is NaN or infinite, for the same NaN bits).
inline void row_scales8(const Layer& L, int64_t n, int64_t gi, float* out) {
  if (L.scale_kind == 0) {
    const float s = L.scale(n, 0);
    for (int r = 0; r < Q8K_ROW_BLOCK; r++) out[r] = s;
    return;
  }
  const int64_t stride = L.scale_kind == 1 ? 1 : L.g.ngroups, base = L.scale_kind == 1 ? n : n * stride + gi;
  if (L.scale_dtype == F16) {
    const uint16_t* h = (const uint16_t*)L.scales + base;
    alignas(16) uint16_t v[8];
    for (int r = 0; r < 8; r++) v[r] = h[r * stride];
    if (native::f16x8_finite_to_f32(v, out)) return;
  }
  for (int r = 0; r < Q8K_ROW_BLOCK; r++) out[r] = load_as_f32(L.scales, L.scale_dtype, base + r * stride);
}

// The scales of rows n .. n + 7 for every segment of a row, segment-major (out + 8 j: the 8
// rows' scales of segment j, row_scales8's values), once per decode block instead of a
// strided gather per segment: float16 scales of one group a segment through the ISA's 8 x 8
// transposes, 8 segments at a time.
inline void block_scales8(const Layer& L, int64_t n, float* out) {
  const Geometry& g = L.g;
  int64_t j = 0;
  if (L.scale_kind == 2 && L.scale_dtype == F16 && g.seg_len == g.group) {
    const uint16_t* h = (const uint16_t*)L.scales + n * g.ngroups;
    for (; j + 8 <= g.nseg; j += 8)
      if (!native::f16x8x8_finite_to_f32(h + j, g.ngroups, out + 8 * j)) break;
    // the last segments through the 8 ending the row (values already there written again)
    if (j >= 8 && j < g.nseg && j + 8 > g.nseg &&
        native::f16x8x8_finite_to_f32(h + g.nseg - 8, g.ngroups, out + 8 * (g.nseg - 8)))
      j = g.nseg;
  }
  for (; j < g.nseg; j++) row_scales8(L, n, L.scale_kind == 2 ? g.seg_group[j] : 0, out + 8 * j);
}

// The 8-row decode blocks prefetch the block after next (2 blocks ahead: 8 KB for rows of
// 2048 columns), linearly, into L2: against the next block into L1 (into L2 for rows longer
// than 2048 columns) it measured 4-14 % faster on every layer shape of the 0.53 G llama
// (Zen 4, one thread, memory shared with other jobs: best of 8 interleaved rounds); the
// farther prefetch hides more of a loaded memory system's latency.
constexpr int R8_PREFETCH_BLOCKS = 2;

// `lines` cache lines from p on, into L2: the bytes of the block after next, read in step.
inline void prefetch_lines(const uint8_t* p, int lines) {
  for (int l = 0; l < lines; l++) __builtin_prefetch(p + 64 * l, 0, 2);
}

// Token m's outputs of rows n .. n + 7 (lane r of y = row r), with their biases.
template <class O>
inline void store_rows8(const Layer& L, int64_t m, int64_t n, typename O::FV y) {
  alignas(32) float out[Q8K_ROW_BLOCK];
  O::fvstore(out, y);
  for (int r = 0; r < Q8K_ROW_BLOCK; r++)
    store_from_f32(L.out, L.out_dtype, m * L.g.n + n + r, out[r] + L.bias_at(n + r));
}

// The 8-row decode blocks' loop, rows [n0, n1) for tokens m0 .. m1 - 1: a block of 8 rows
// against one token at a time (the block stays in L1 for the next token), one accumulator per
// row, each activation vector loaded once for the 8 rows, the block after next prefetched
// linearly (256 of its bytes a step), the rows' partial last step read from a zero-padded copy. The
// epilogue E is what differs between activations (Q8kRows8 below; per-token int8:
// ternary.h Int8Rows8), as static functions:
//   E::block(L, n, s8)                 the block's scales, 8 floats
//   E::token(L, a, m)                  a token's running state t
//   E::step(L, a, t, st, s, acc, n, s8)   after step s's dot products (it may reduce acc)
//   E::result(L, a, t, m, s8)          the token's 8 rows as one float vector (lane = row)
//   E::tail(L, a, n, n1, m)            the last n % 8 rows of the range, row by row
template <class O, class E>
void rows_r8(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  constexpr int R = Q8K_ROW_BLOCK;
  const Geometry& g = L.g;
  const int64_t xlen = g.xlen(), nsteps = (int64_t)g.steps.size(), rb = g.row_bytes;
  alignas(32) uint8_t tail[32 * R];
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const uint8_t* w = L.w + n * rb;
    copy_tails(g, w, R, tail);
    alignas(32) float s8[R];
    E::block(L, n, s8);
    for (int64_t m = m0; m < m1; m++) {
      const int8_t* x = a.q.data() + m * xlen;
      typename O::TA acc[R];
      for (auto& v : acc) v = O::tzero();
      auto t = E::token(L, a, m);
      for (int64_t s = 0; s < nsteps; s++) {
        const Step& st = g.steps[s];
        const uint8_t* p = w + st.off;
        int64_t stride = rb;
        if (st.valid != 32) {  // the rows' last step, zero-padded (copy_tails)
          p = tail, stride = 32;
        } else if (m == m0) {  // the block after next, linearly: 256 of its bytes a step
          prefetch_lines(w + R8_PREFETCH_BLOCKS * R * rb + s * 256, 4);
        }
        const int8_t* xs = x + s * 128;
        const typename O::V x0 = O::xload(xs), x1 = O::xload(xs + 32), x2 = O::xload(xs + 64),
                            x3 = O::xload(xs + 96);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
          const typename O::V wr = O::load(p + r * stride);
          O::tdot(acc[r], O::code(wr, 0), x0);
          O::tdot(acc[r], O::code(wr, 1), x1);
          O::tdot(acc[r], O::code(wr, 2), x2);
          O::tdot(acc[r], O::code(wr, 3), x3);
        }
        E::step(L, a, t, st, s, acc, n, s8);
      }
      store_rows8<O>(L, m, n, E::result(L, a, t, m, s8));
    }
  }
  if (n < n1)
    for (int64_t m = m0; m < m1; m++) E::tail(L, a, n, n1, m);
}

// q8k's epilogue of the 8-row blocks: at the step that ends a segment, the 8 rows' sums
// reduced into one vector and y + float(sumi - ssum) * (d * s) run lane by lane (the group's
// scales converted there); the tail rows through rows_q8k.
template <class O>
struct Q8kRows8 {
  struct Token {
    typename O::FV y;
    const int32_t* ss;
    const float* d8;
  };
  static void block(const Layer& L, int64_t n, float* s8) {
    if (L.scale_kind != 2) row_scales8(L, n, 0, s8);
  }
  static Token token(const Layer& L, const Acts& a, int64_t m) {
    return {O::fvzero(), a.ssum.data() + m * L.g.nseg, a.d8.data() + m * L.g.nblocks8};
  }
  static void step(const Layer& L, const Acts&, Token& t, const Step& st, int64_t,
                   typename O::TA* acc, int64_t n, float* s8) {
    if (st.seg < 0) return;
    const int64_t seg = st.seg;
    if (L.scale_kind == 2) row_scales8(L, n, L.g.seg_group[seg], s8);
    t.y = O::tstep_rows(t.y, O::tsum8(acc), t.ss[seg], t.d8[L.g.seg_block[seg]], s8);
  }
  static typename O::FV result(const Layer&, const Acts&, const Token& t, int64_t, const float*) {
    return t.y;
  }
  static void tail(const Layer& L, const Acts& a, int64_t n, int64_t n1, int64_t m) {
    rows_q8k<O, 4, 1>(L, a, n, n1, m);
  }
};

// ----------------------------------------------------------------------------------------------
// Decode, one row at a time (ISAs with q8k_seg: AVX2 without VNNI; rows with q8k_wide)
// ----------------------------------------------------------------------------------------------
//
// The 8-row blocks read 8 rows side by side, 32 bytes of each a step: 8 interleaved streams,
// which the hardware prefetcher follows poorly (one thread on the Zen 4: the blocks' sweep of
// the 0.53 G llama's layers took 17 ms without their software prefetch, 10 with it, 7.4 from
// cache). Here a block of 8 rows is read row after row, each from start to end - one linear
// stream, as the float16 output layer reads - and the lanes turn the other way: a segment's
// sum (O::q8k_seg, int16 lanes) is reduced with the next 7 of the block's run of segments
// (O::q8k_seg8, tsum8's sums: lane i = segment f0 + i, across the rows' ends; the pairs reduced
// as they come, which keeps the accumulators in registers) and their terms float(sumi - ssum)
// * (d * s) computed lane by lane (O::tterms) and stored; then the 8 rows' terms are
// transposed (lane = row) and added in segment order: the operations of tstep_rows in the
// same order, so the bits are rows_q8k's. (A q8k_wide row's segment j is its block j.)

template <class O, class = void>
struct HasQ8kLin : std::false_type {};
template <class O>
struct HasQ8kLin<O, std::void_t<decltype(O::has_q8k_lin)>> : std::true_type {};

// Segments of a row the kernel's buffers hold (16384 columns); longer rows take rows_r8.
constexpr int64_t Q8K_LIN_MAX_SEG = 64;

// The scales of a block's flat segments f0 .. f1 - 1 (flat segment f = segment f % nseg of
// row n + f / nseg), L.scale's values, into sc + f: float16 scales of one 256-column group a
// segment are the block's rows' scales side by side, converted 8 at a time through F16C where
// none of the 8 is NaN or infinite.
inline void flat_scales(const Layer& L, int64_t n, int64_t f0, int64_t f1, float* sc) {
  const Geometry& g = L.g;
  int64_t f = f0;
  if (L.scale_kind != 2) {  // a scale a row (or the tensor's), converted once a row
    // a whole block's 8 through row_scales8 (F16C: a software conversion a row was ~4 % of
    // the AVX2 decode's rows_q8k_lin)
    float s8[Q8K_ROW_BLOCK];
    const bool whole = f0 == 0 && f1 == Q8K_ROW_BLOCK * g.nseg;
    if (whole) row_scales8(L, n, 0, s8);
    for (int64_t r = f0 / g.nseg; r * g.nseg < f1; r++)
      std::fill(sc + std::max(f0, r * g.nseg), sc + std::min(f1, (r + 1) * g.nseg),
                whole ? s8[r] : L.scale(n + r, 0));
    return;
  }
  if (L.scale_dtype == F16 && g.ngroups == g.nseg) {
    const uint16_t* h = (const uint16_t*)L.scales + n * g.ngroups;
    for (; f + 8 <= f1; f += 8)
      if (!native::f16x8_finite_to_f32(h + f, sc + f)) break;
  }
  for (; f < f1; f++) {
    const int64_t j = f % g.nseg;
    sc[f] = L.scale(n + f / g.nseg, g.seg_group[j]);
  }
}

// Rows of whole 64-byte segments, contiguous (a q8k_wide row: segment j = bytes 64 j ..):
// a block of 8 rows is one run of 8 nseg segments, walked in 8s across the rows' ends, so
// no row leaves a partial group of 8 (BitNet 2B4T's rows of 10 and 27 segments left 2 and 3:
// a whole reduction and a padded copy for each).
inline bool q8k_lin_applies(const Geometry& g) {
  return g.q8k_wide && g.nseg <= Q8K_LIN_MAX_SEG && g.row_bytes == 64 * g.nseg &&
         g.nblocks8 == g.nseg;
}

template <class O>
void rows_q8k_lin(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  constexpr int R = Q8K_ROW_BLOCK;
  const Geometry& g = L.g;
  const int64_t xlen = g.xlen(), rb = g.row_bytes, nseg = g.nseg, nflat = R * nseg;
  const int64_t ntok = m1 - m0, span = nflat + 8;  // the tables' entries a token, padded
  // per flat segment f of a block: its activations' offset, and each token's sum and d
  // (segment f % nseg's; zeros in the padding)
  thread_local std::vector<int32_t> xo_buf, ss_buf;
  thread_local std::vector<float> d8_buf;
  // filled row by row, without a division an entry (a call a chunk of a layer's rows: ~1000
  // calls a decode step of the 0.53 G llama)
  xo_buf.resize(span), ss_buf.resize(ntok * span), d8_buf.resize(ntok * span);
  int32_t *xo = xo_buf.data(), *ssr = ss_buf.data();
  float* d8r = d8_buf.data();
  for (int64_t j = 0; j < nseg; j++) xo[j] = (int32_t)(256 * j);
  for (int r = 1; r < R; r++) std::copy(xo, xo + nseg, xo + r * nseg);
  std::fill(xo + nflat, xo + span, 0);
  for (int64_t t = 0; t < ntok; t++) {
    const int32_t* st = a.ssum.data() + (m0 + t) * nseg;
    const float* dt = a.d8.data() + (m0 + t) * nseg;
    int32_t* so = ssr + t * span;
    float* dout = d8r + t * span;
    for (int r = 0; r < R; r++)
      std::copy(st, st + nseg, so + r * nseg), std::copy(dt, dt + nseg, dout + r * nseg);
    std::fill(so + nflat, so + span, 0), std::fill(dout + nflat, dout + span, 0.f);
  }
  // tb[f]: flat segment f's term (row f / nseg's, segment f % nseg's); sc[f]: its scale.
  // Only what is read past a block's segments is zeroed, not 4 KB a call (~1 % of the AVX2
  // decode's time): lanes that are computed or transposed but never added. Two term
  // buffers: the terms of one (block, token) are added up and stored after the next one's
  // segments are issued, so that chain's latency overlaps their work (a layer of 8-segment
  // rows 1.04x as fast on the AVX2 build, Zen 4).
  alignas(32) float tbs[2][R * Q8K_LIN_MAX_SEG + 8], sc[R * Q8K_LIN_MAX_SEG + 8];
  struct Unit {
    int64_t n = 0, m = 0;
    int rows = 0;  // 0: none
  };
  // the terms added in segment order, 8 rows at once (lane = row; lanes past the rows and
  // columns past a row's segments are read but never added)
  auto finish = [&](const Unit& u, const float* tb) {
    typename O::FV y = O::fvzero();
    for (int64_t j0 = 0; j0 < nseg; j0 += 8) {
      typename O::FV c[8];
      O::ftranspose8(tb + j0, nseg, c);
      const int cnt = (int)std::min<int64_t>(8, nseg - j0);
      if (cnt == 8) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) y = O::fvadd(y, c[i]);
      } else {
        for (int i = 0; i < cnt; i++) y = O::fvadd(y, c[i]);
      }
    }
    alignas(32) float out[R];
    O::fvstore(out, y);
    for (int r = 0; r < u.rows; r++)
      store_from_f32(L.out, L.out_dtype, u.m * g.n + u.n + r, out[r] + L.bias_at(u.n + r));
  };
  Unit pend;
  int cur = 0;
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = (int)std::min<int64_t>(R, n1 - n);
    const int64_t nf = rows * nseg, nf8 = (nf + 7) / 8 * 8;
    const uint8_t* w = L.w + n * rb;
    flat_scales(L, n, 0, nf, sc);
    std::fill(sc + nf, sc + nf8, 0.f);
    for (int64_t m = m0; m < m1; m++) {
      float* tb = tbs[cur];
      std::fill(tb + nf8, tb + nflat + 8, 0.f);
      const int8_t* x = a.q.data() + m * xlen;
      const int32_t* ss = ssr + (m - m0) * span;
      const float* d8 = d8r + (m - m0) * span;
      // each group's terms computed and stored after the next group's segments are issued:
      // the reduction's latency at a group's end overlaps that work (1.07x as fast, Zen 4)
      auto sums8 = [&](int64_t f0) {
        return f0 + 8 <= nf ? O::q8k_seg8(w + 64 * f0, x, xo + f0) : [&] {
          typename O::TA acc[8];  // the last segments of a partial block
          for (int i = 0; i < 8; i++)
            acc[i] = f0 + i < nf ? O::q8k_seg(w + 64 * (f0 + i), x + xo[f0 + i]) : O::tzero();
          return O::tsum8(acc);
        }();
      };
      auto pending = sums8(0);
      for (int64_t f0 = 8; f0 < nf; f0 += 8) {
        const auto next = sums8(f0);
        const int64_t f = f0 - 8;
        O::fvstore(tb + f, O::tterms(pending, ss + f, d8 + f, sc + f));
        pending = next;
      }
      const int64_t fl = (nf - 1) / 8 * 8;
      O::fvstore(tb + fl, O::tterms(pending, ss + fl, d8 + fl, sc + fl));
      if (pend.rows) finish(pend, tbs[cur ^ 1]);
      pend = {n, m, rows};
      cur ^= 1;
    }
  }
  if (pend.rows) finish(pend, tbs[cur ^ 1]);
}

// Rows [n0, n1) for tokens m0 .. m1 - 1 with q8k activations, in blocks of 8 rows.
template <class O>
void rows_q8k_r8(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  rows_r8<O, Q8kRows8<O>>(L, a, n0, n1, m0, m1);
}

// ----------------------------------------------------------------------------------------------
// 512-bit windows (ISAs with has_q8k_wide, rows with q8k_wide)
// ----------------------------------------------------------------------------------------------
//
// The tiles above on windows of two steps: a segment is one window, so its sums are one
// vpdpbusd per (row, token, code) - half the instructions of the 256-bit tiles - and the
// accumulators are reduced at the segment's end (wsum8: lane i = the sum of accumulator i,
// as tsum8's) and scaled by the same tstep(_rows) as the tiles: the same integers, the same
// float32 epilogue in the same order, so the same bits as rows_q8k.

template <class O, class = void>
struct HasQ8kWide : std::false_type {};
template <class O>
struct HasQ8kWide<O, std::void_t<decltype(O::has_q8k_wide)>> : std::true_type {};

// Tiles of 4 rows x 4 tokens (rows_q8k_tile's contract with RP = 2; 16 accumulators).
template <class O>
void rows_q8k_wide_tile(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0,
                        int valid, const int32_t* seg4, const float* d4, const float* sc,
                        int64_t nsc) {
  constexpr int T = Q8K_TILE_TOKENS, R = 4;
  const Geometry& g = L.g;
  const int64_t xlen = g.xlen(), rb = g.row_bytes, nseg = g.nseg;
  const int8_t* xb[T];
  for (int t = 0; t < T; t++) xb[t] = a.q.data() + (m0 + std::min(t, valid - 1)) * xlen;
  for (int64_t n = n0; n + R <= n1; n += R) {
    const uint8_t* w = L.w + n * rb;
    const float* scn = sc + (n - n0) * nsc;
    typename O::FV y[2] = {O::fvzero(), O::fvzero()};
    for (int64_t j = 0; j < nseg; j++) {
      typename O::W acc[R][T], wr[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        const uint8_t* p = w + r * rb + 64 * j;
        __builtin_prefetch(p + PREFETCH_BYTES);
        wr[r] = O::wload(p);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = O::wzero();
      }
      const int64_t off = 256 * j;
#pragma GCC unroll 4
      for (int v = 0; v < 4; v++) {
        typename O::W c[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) c[r] = O::wcode(wr[r], v);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
          const typename O::W x = O::wxload(xb[t] + off + 32 * v);
#pragma GCC unroll 4
          for (int r = 0; r < R; r++) O::wdot(acc[r][t], c[r], x);
        }
      }
#pragma GCC unroll 2
      for (int q = 0; q < 2; q++) {
        typename O::W n8[8];  // row 2q's tokens, then row 2q + 1's
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) n8[t] = acc[2 * q][t], n8[T + t] = acc[2 * q + 1][t];
        y[q] = O::tstep(y[q], O::wsum8(n8), seg4 + T * j, d4 + T * g.seg_block[j],
                        scn[2 * q * nsc + j], scn[(2 * q + 1) * nsc + j]);
      }
    }
    for (int q = 0; q < 2; q++) store_pair<O>(L, n + 2 * q, m0, valid, y[q]);
  }
}

// rows_q8k_r8 on windows: one token against 8 rows; the last n % 8 rows through rows_q8k.
template <class O>
void rows_q8k_r8w(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  constexpr int R = Q8K_ROW_BLOCK;
  const Geometry& g = L.g;
  const int64_t xlen = g.xlen(), rb = g.row_bytes, nseg = g.nseg;
  const bool grouped = L.scale_kind == 2;
  thread_local std::vector<float> sc_buf;  // grouped: the block's scales, 8 a segment
  sc_buf.resize(R * nseg);
  float* sc = sc_buf.data();
  // the range's first blocks, which no block before them prefetched (a decode call's rows
  // come in chunks, a few hundred a chunk)
  prefetch_lines(L.w + n0 * rb, (int)(std::min<int64_t>(R8_PREFETCH_BLOCKS * R, n1 - n0) * rb / 64));
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const uint8_t* w = L.w + n * rb;
    if (grouped) block_scales8(L, n, sc);
    else row_scales8(L, n, 0, sc);
    for (int64_t m = m0; m < m1; m++) {
      const int8_t* x = a.q.data() + m * xlen;
      const int32_t* ss = a.ssum.data() + m * g.nseg;
      const float* d8 = a.d8.data() + m * g.nblocks8;
      typename O::FV y = O::fvzero();
      for (int64_t j = 0; j < nseg; j++) {
        if (m == m0) prefetch_lines(w + R8_PREFETCH_BLOCKS * R * rb + j * 512, 8);
        const int8_t* xs = x + 256 * j;
        const typename O::W x0 = O::wxload(xs), x1 = O::wxload(xs + 32),
                            x2 = O::wxload(xs + 64), x3 = O::wxload(xs + 96);
        typename O::W acc[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
          const typename O::W wr = O::wload(w + r * rb + 64 * j);
          acc[r] = O::wzero();
          O::wdot(acc[r], O::wcode(wr, 0), x0);
          O::wdot(acc[r], O::wcode(wr, 1), x1);
          O::wdot(acc[r], O::wcode(wr, 2), x2);
          O::wdot(acc[r], O::wcode(wr, 3), x3);
        }
        y = O::tstep_rows(y, O::wsum8(acc), ss[j], d8[g.seg_block[j]], grouped ? sc + R * j : sc);
      }
      store_rows8<O>(L, m, n, y);
    }
  }
  if (n < n1)
    for (int64_t m = m0; m < m1; m++) rows_q8k<O, 4, 1>(L, a, n, n1, m);
}

// ----------------------------------------------------------------------------------------------
// Many tokens, whole 256-column segments: panels of rows in the lanes (ISAs with has_q8k_panel)
// ----------------------------------------------------------------------------------------------
//
// The tiles above sum a (row, token) pair's segment across the lanes of a vector and reduce
// the lanes at the segment's end; here each 32-bit lane is one row of a panel (16 rows on
// AVX-512, 8 on AVX2: Q8kPanelRows), so a lane holds the whole segment sum and the epilogue
// runs on the panel's rows at once with no reduction. The panel's rows are gathered once per
// call into words of one dword per row - word (s, d): dword d of step s of each row, 16
// columns' codes - and code v of word (s, d) holds, in lane r's byte b, column 128 s + 16 d +
// 4 b + v of row r: the activations' positions 128 s + 32 v + 4 d .. + 3 (fast_order), one
// dword broadcast to all lanes. Per segment, per token: the integer sums of the panel's rows,
// then y + float(sumi - ssum) * (d * s) lane by lane - tstep_rows' operations in the same
// order, so each row's bits are rows_q8k's. AVX-512 sums in int32 (vpdpbusd); AVX2 adds its
// pmaddubsw pairs up in int16 over the whole segment and widens them at its end (pstep): a
// lane adds Q8K_PANEL_I16_TERMS pairs of two products |c q| <= 2 * 127 (codes 0-2, Q8_K's
// |q| <= 127), 32512 at most, so the wrapping int16 sums are exact.

template <class O, class = void>
struct HasQ8kPanel : std::false_type {};
template <class O>
struct HasQ8kPanel<O, std::void_t<decltype(O::has_q8k_panel)>> : std::true_type {};

constexpr int Q8K_PANEL_ROWS = 16, Q8K_PANEL_TOKENS = 8;
// From this many tokens on, the panels (prefill, and a decode step of 8 sequences or more);
// fewer take the tiles or the decode blocks; an ISA's q8k_panel_min_tokens where it has one
// (AVX2's 1 x 8 tiles serve 8 tokens better). At 8 tokens AVX-512's 4 x 4 tiles spend
// about as many instructions on their segments' reductions as on their vpdpbusds: an
// 8-sequence decode of the 0.53 G llama, 2 threads, Emerald Rapids, 1.06-1.12x the
// aggregate speed through the panels; AVX2's build 0.93x, 4 sequences 0.99x.
constexpr int64_t Q8K_PANEL_MIN_TOKENS = 8;
constexpr int Q8K_PANEL_PASS = 2;  // panels per pass over a token tile (32 accumulators' worth)
// pmaddubsw pairs an int16 lane of AVX2's panels adds up: a segment's 2 steps x 8 words x 4 codes
constexpr int Q8K_PANEL_I16_TERMS = 2 * 8 * 4;
static_assert(Q8K_PANEL_I16_TERMS * 2 * 2 * (int)Q8K_QMAX <= 32767, "AVX2 panel sums overflow");

// Rows of a panel and panels per pass: Q8K_PANEL_ROWS and Q8K_PANEL_PASS (AVX-512: 16 lanes,
// 32 registers), or an ISA's q8k_panel_rows / q8k_panel_pass (AVX2: 8 lanes, 16 registers)
template <class O, class = void>
struct Q8kPanelRows : std::integral_constant<int, Q8K_PANEL_ROWS> {};
template <class O>
struct Q8kPanelRows<O, std::void_t<decltype(O::q8k_panel_rows)>>
    : std::integral_constant<int, O::q8k_panel_rows> {};
template <class O, class = void>
struct Q8kPanelPass : std::integral_constant<int, Q8K_PANEL_PASS> {};
template <class O>
struct Q8kPanelPass<O, std::void_t<decltype(O::q8k_panel_pass)>>
    : std::integral_constant<int, O::q8k_panel_pass> {};

template <class O, class = void>
struct Q8kPanelMin : std::integral_constant<int64_t, Q8K_PANEL_MIN_TOKENS> {};
template <class O>
struct Q8kPanelMin<O, std::void_t<decltype(O::q8k_panel_min_tokens)>>
    : std::integral_constant<int64_t, O::q8k_panel_min_tokens> {};

// Whether rows_all runs M tokens of a layer through the panels (an ISA with has_q8k_panel).
template <class O = NativeOps>
inline bool q8k_panels_apply(const Geometry& g, bool q8k, int64_t M) {
  return q8k && g.q8k_wide && M >= Q8kPanelMin<O>::value;
}

// Rows per chunk of a call through the panels: up to 128 (each token tile's activations,
// read from L2 or L3, serve that many rows), about 4 chunks per thread, multiples of a pass.
template <class O = NativeOps>
int64_t q8k_panel_chunk(int64_t n, int threads) {
  constexpr int64_t pass = Q8kPanelRows<O>::value * Q8kPanelPass<O>::value;
  const int64_t want = ceil_div(ceil_div(n, 4 * (int64_t)threads), pass) * pass;
  return std::min<int64_t>(128, want);
}

// Row n's float32 scale of each segment (L.scale's values; float16 through F16C where this
// build has it, as row_scales8).
inline void seg_scales(const Layer& L, int64_t n, float* out) {
  const Geometry& g = L.g;
  int64_t j = 0;
  if (L.scale_kind == 2 && L.scale_dtype == F16 && g.seg_len == g.group) {
    const uint16_t* h = (const uint16_t*)L.scales + n * g.ngroups;
    for (; j + 8 <= g.nseg; j += 8)
      if (!native::f16x8_finite_to_f32(h + j, out + j)) break;
  }
  for (; j < g.nseg; j++) out[j] = L.scale(n, L.scale_kind == 2 ? g.seg_group[j] : 0);
}

// T tokens (x: their activations, ss / d8: their segment sums and block scales) against PR
// panels of P rows (wt: the first one's words, pbytes apart; scv: their rows' float32 scales,
// P per segment, (nseg + 1) * P apart); y: T x PR x P outputs.
template <class O, int PR, int T>
void q8k_panel_tile(const Geometry& g, const uint8_t* wt, int64_t pbytes, const float* scv,
                    const int8_t* const* x, const int32_t* const* ss, const float* const* d8,
                    float* y) {
  using W = typename O::W;
  using PF = typename O::PF;
  constexpr int P = Q8kPanelRows<O>::value;
  for (int i = 0; i < T * PR; i++) O::pstore(y + P * i, O::pzero());
  for (int64_t j = 0; j < g.nseg; j++) {
    W acc[PR][T];
#pragma GCC unroll 2
    for (int p = 0; p < PR; p++)
#pragma GCC unroll 8
      for (int t = 0; t < T; t++) acc[p][t] = O::wzero();
    for (int64_t s = 2 * j; s < 2 * j + 2; s++) {
      const uint8_t* ws = wt + 32 * P * s;
      const int64_t xo = 128 * s;
#pragma GCC unroll 1
      for (int d = 0; d < 8; d++) {
        W w[PR];
#pragma GCC unroll 2
        for (int p = 0; p < PR; p++) w[p] = O::pwload(ws + p * pbytes + 4 * P * d);
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
          W c[PR];
#pragma GCC unroll 2
          for (int p = 0; p < PR; p++) c[p] = O::wcode(w[p], v);
#pragma GCC unroll 8
          for (int t = 0; t < T; t++) {
            const W xv = O::pbcast(x[t] + xo + 32 * v + 4 * d);
#pragma GCC unroll 2
            for (int p = 0; p < PR; p++) O::wdot(acc[p][t], c[p], xv);
          }
        }
      }
    }
#pragma GCC unroll 2
    for (int p = 0; p < PR; p++) {
      const PF sc = O::pload(scv + p * (g.nseg + 1) * P + P * j);
#pragma GCC unroll 8
      for (int t = 0; t < T; t++) {
        float* yp = y + P * (PR * t + p);
        O::pstore(yp, O::pstep(O::pload(yp), acc[p][t], ss[t][j], d8[t][g.seg_block[j]], sc));
      }
    }
  }
}

// Rows [n0, n1) for all M tokens (rows with q8k_wide): the rows are gathered into panels
// (the last one padded with zero codes and scales), then for each tile of Q8K_PANEL_TOKENS
// tokens every panel in turn (the tile's activations stay in L1, the panels in L2). A short
// last tile repeats its last token and stores nothing from it.
template <class O>
void rows_q8k_panels(const Layer& L, const Acts& a, int64_t M, int64_t n0, int64_t n1) {
  constexpr int P = Q8kPanelRows<O>::value, T = Q8K_PANEL_TOKENS, PR = Q8kPanelPass<O>::value;
  const Geometry& g = L.g;
  const int64_t rb = g.row_bytes, nsteps = (int64_t)g.steps.size(), xlen = g.xlen();
  const int64_t npan = ceil_div(n1 - n0, P), pbytes = rb * P;
  thread_local std::vector<uint8_t> wt_buf;
  thread_local std::vector<float> sc_buf;
  // per panel: its rows' scales (nseg x P), then their biases (P)
  const int64_t pfloats = (g.nseg + 1) * P;
  wt_buf.resize(npan * pbytes + 64), sc_buf.resize(npan * pfloats + 16 + g.nseg);
  // 64-byte aligned (the panels' words and scale vectors are whole cache lines)
  uint8_t* wt = wt_buf.data() + (-(uintptr_t)wt_buf.data() & 63);
  float* scv = sc_buf.data() + ((-(uintptr_t)sc_buf.data() & 63) / 4);
  float* row_sc = scv + npan * pfloats;  // one row's scales
  auto gather = [&](int64_t p) {
    const int64_t r0 = n0 + p * P, rows = std::min<int64_t>(P, n1 - r0);
    uint8_t* dst = wt + p * pbytes;
    float* sp = scv + p * pfloats;
    if (rows == P) {
      for (int64_t s = 0; s < nsteps; s++)
        O::ptranspose(L.w + r0 * rb + 32 * s, rb, dst + 32 * P * s);
    } else {
      std::memset(dst, 0, pbytes);
      std::fill(sp, sp + pfloats, 0.f);
      for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < rb / 4; i++)
          std::memcpy(dst + 4 * P * i + 4 * r, L.w + (r0 + r) * rb + 4 * i, 4);
    }
    for (int64_t r = 0; r < rows; r++) {
      seg_scales(L, r0 + r, row_sc);
      for (int64_t j = 0; j < g.nseg; j++) sp[P * j + r] = row_sc[j];
      sp[P * g.nseg + r] = L.bias_at(r0 + r);
    }
  };
  // One token tile (a decode step of 8 sequences): each pass's panels are gathered just before
  // their tile, the next pass's rows prefetched first, so that their reads from memory overlap
  // this pass's arithmetic (8 sequences of the 0.53 G llama, Emerald Rapids, 2 threads: 1.045x
  // the aggregate decode, 1.04x of it the prefetch); more tiles gather every panel first.
  const bool one_tile = M <= T;
  if (!one_tile)
    for (int64_t p = 0; p < npan; p++) gather(p);
  alignas(64) float y[P * T * PR];
  for (int64_t m = 0; m < M; m += T) {
    const int valid = (int)std::min<int64_t>(T, M - m);
    const int8_t* x[T];
    const int32_t* ss[T];
    const float* d8[T];
    for (int t = 0; t < T; t++) {
      const int64_t mt = m + std::min(t, valid - 1);
      x[t] = a.q.data() + mt * xlen, ss[t] = a.ssum.data() + mt * g.nseg;
      d8[t] = a.d8.data() + mt * g.nblocks8;
    }
    for (int64_t p = 0; p < npan; p += PR) {
      const int pr = (int)std::min<int64_t>(PR, npan - p);
      if (one_tile) {
        const int64_t r1 = n0 + (p + PR) * P;  // the next pass's first row
        if (r1 < n1) {
          const uint8_t* next = L.w + r1 * rb;
          const int64_t ahead = std::min<int64_t>(PR * P, n1 - r1) * rb;
          for (int64_t b = 0; b < ahead; b += 64) __builtin_prefetch(next + b);
        }
        for (int q = 0; q < pr; q++) gather(p + q);
      }
      const uint8_t* wp = wt + p * pbytes;
      const float* sp = scv + p * pfloats;
      if (pr == PR) {
        if (valid > T / 2) q8k_panel_tile<O, PR, T>(g, wp, pbytes, sp, x, ss, d8, y);
        else q8k_panel_tile<O, PR, T / 2>(g, wp, pbytes, sp, x, ss, d8, y);
      } else {
        if (valid > T / 2) q8k_panel_tile<O, 1, T>(g, wp, pbytes, sp, x, ss, d8, y);
        else q8k_panel_tile<O, 1, T / 2>(g, wp, pbytes, sp, x, ss, d8, y);
      }
      for (int q = 0; q < pr; q++) {
        const int64_t r0 = n0 + (p + q) * P, rows = std::min<int64_t>(P, n1 - r0);
        const float* bias = scv + (p + q) * pfloats + P * g.nseg;
        for (int t = 0; t < valid; t++) {
          const float* yt = y + P * (pr * t + q);
          if (rows == P && L.out_dtype == F32)  // y + b, P rows at once
            O::pstoreu((float*)L.out + (m + t) * g.n + r0, O::padd(O::pload(yt), O::pload(bias)));
          else
            for (int r = 0; r < rows; r++)
              store_from_f32(L.out, L.out_dtype, (m + t) * g.n + r0 + r, yt[r] + bias[r]);
        }
      }
    }
  }
}

// One token (or a few) against rows [n0, n1): the windows where they apply.
template <class O>
void rows_q8k_few(const Layer& L, const Acts& a, int64_t n0, int64_t n1, int64_t m0, int64_t m1) {
  if constexpr (HasQ8kLin<O>::value)
    if (q8k_lin_applies(L.g)) return rows_q8k_lin<O>(L, a, n0, n1, m0, m1);
  if constexpr (HasQ8kWide<O>::value)
    if (L.g.q8k_wide) return rows_q8k_r8w<O>(L, a, n0, n1, m0, m1);
  rows_q8k_r8<O>(L, a, n0, n1, m0, m1);
}

// Rows [n0, n1) for all M tokens through the tiles: whole tiles, then a short one of 2 or 3
// tokens (the 512-bit windows where the rows have them); a last single token goes through
// rows_q8k_few, the odd row of the range through rows_q8k.
template <class O>
void rows_q8k_tiled(const Layer& L, const Acts& a, int64_t M, int64_t n0, int64_t n1) {
  constexpr int T = Q8K_TILE_TOKENS, RP = Q8kTilePairs<O>::value;
  const Geometry& g = L.g;
  thread_local std::vector<int32_t> seg4_buf;
  thread_local std::vector<float> d4_buf, sc_buf;
  seg4_buf.resize(T * g.nseg), d4_buf.resize(T * g.nblocks8), sc_buf.resize((n1 - n0) * g.nseg);
  // plain pointers: each use of a thread_local in a loop is a TLS lookup in a shared library
  int32_t* seg4 = seg4_buf.data();
  float *d4 = d4_buf.data(), *sc = sc_buf.data();
  const int32_t* ssum = a.ssum.data();
  const float* d8 = a.d8.data();
  // the rows' scales per segment, converted once for all the token tiles (seg_scales: one
  // software conversion a scale was ~5 % of an 8-sequence decode step on AVX-512)
  for (int64_t n = n0; n < n1; n++) seg_scales(L, n, sc + (n - n0) * g.nseg);
  const int64_t n4 = n0 + (n1 - n0) / (2 * RP) * (2 * RP), n2 = n0 + (n1 - n0) / 2 * 2;
  int64_t m0 = 0;
  if constexpr (Q8kTileTokens<O>::value == Q8K_T8) m0 = rows_q8k_tiled8<O>(L, a, M, n0, n1, sc);
  for (int64_t m = m0; m < M; m += T) {
    const int valid = (int)std::min<int64_t>(T, M - m);
    if (valid == 1) {
      rows_q8k_few<O>(L, a, n0, n1, m, m + 1);
      break;
    }
    for (int t = 0; t < T; t++) {
      const int64_t mt = m + std::min(t, valid - 1);
      for (int64_t j = 0; j < g.nseg; j++) seg4[T * j + t] = ssum[mt * g.nseg + j];
      for (int64_t j = 0; j < g.nblocks8; j++) d4[T * j + t] = d8[mt * g.nblocks8 + j];
    }
    bool done = false;  // an ISA's own tile ran
    if constexpr (HasMmla<O>::value) O::q8k_mmla_tile(L, a, n0, n4, m, valid, seg4, d4, sc, g.nseg), done = true;
    if constexpr (HasQ8kWide<O>::value && RP == 2)
      if (g.q8k_wide) rows_q8k_wide_tile<O>(L, a, n0, n4, m, valid, seg4, d4, sc, g.nseg), done = true;
    if (!done) rows_q8k_tile<O, RP>(L, a, n0, n4, m, valid, seg4, d4, sc, g.nseg);
    if (RP > 1 && n4 < n2)
      rows_q8k_tile<O, 1>(L, a, n4, n2, m, valid, seg4, d4, sc + (n4 - n0) * g.nseg, g.nseg);
    if (n2 == n1) continue;
    switch (valid) {
      case 4: rows_q8k<O, 4, 4>(L, a, n2, n1, m); break;
      case 3: rows_q8k<O, 4, 3>(L, a, n2, n1, m); break;
      default: rows_q8k<O, 4, 2>(L, a, n2, n1, m); break;
    }
  }
}

}  // namespace tk
