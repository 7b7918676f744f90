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

#include "tkernels.h"

namespace tk {

constexpr int Q8K_BLOCK = 256;  // ggml's QK_K
constexpr float Q8K_QMAX = 127.f;

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
}

// Token m of x -> ggml's Q8_K codes at a.q[m] (permuted), d at a.d8[m], segment sums at
// a.ssum[m]; tmp holds K floats.
inline void quantize_token_q8k(const Geometry& g, const void* x, int dtype, int64_t m, Acts& a,
                               float* tmp) {
  const int64_t k = g.k;
  for (int64_t i = 0; i < k; i++) tmp[i] = load_as_f32(x, dtype, m * k + i);
  float* d = a.d8.data() + m * g.nblocks8;
  for (int64_t b = 0; b < g.nblocks8; b++) {
    const int64_t i0 = b * Q8K_BLOCK, i1 = std::min<int64_t>(k, i0 + Q8K_BLOCK);
    float amax = 0.f, top = 0.f;
    for (int64_t i = i0; i < i1; i++)
      if (std::fabs(tmp[i]) > amax) amax = std::fabs(tmp[i]), top = tmp[i];
    if (amax == 0.f) {
      d[b] = 0.f;
      std::fill(tmp + i0, tmp + i1, 0.f);
      continue;
    }
    const float iscale = -Q8K_QMAX / top;
    for (int64_t i = i0; i < i1; i++) tmp[i] = std::min(Q8K_QMAX, std::nearbyint(iscale * tmp[i]));
    d[b] = 1.f / iscale;
  }
  int8_t* q = a.q.data() + m * g.xlen();
  for (int64_t p = 0; p < g.xlen(); p++) {
    const int64_t c = g.perm[p];
    q[p] = c < 0 ? 0 : (int8_t)tmp[c];
  }
  int32_t* ss = a.ssum.data() + m * g.nseg;
  std::fill(ss, ss + g.nseg, 0);
  for (int64_t i = 0; i < k; i++) ss[i / g.seg_len] += (int32_t)tmp[i];
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

}  // namespace tk
