// Scaled dot-product attention on the CPU, float32: out = softmax(scale * q k^T [+ causal]) v
// for q (B, Hq, Lq, D) and k, v (B, Hkv, Lk, D), Hq a multiple of Hkv (grouped-query
// attention), rows of D contiguous and any strides above. "causal" is MLX's: query i (of Lq)
// sees keys j <= i + Lk - Lq. MLX's CPU fallback for this runs matmuls on the reference BLAS
// the mlx[cpu] wheel links (~3 GFLOP/s) and costs half of a prefill; this is one pass of
// SIMD dot products per (query, key), a max-subtracted softmax (exp vectorized where AVX2 is:
// activation.h's, within 2 ulp), and a weighted sum of values.
// A boolean mask (mlx-lm's batches: causal and left padding; sliding windows) drops the keys it
// marks false: their scores are -inf, their weights exactly 0 and their values are never read,
// so a left-padded row of a batch gets its single sequence's output bit for bit; a row with no
// key left gets 0.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../arch/select.h"

namespace tk {

struct AttnShape {
  int64_t B, Hq, Hkv, Lq, Lk, D;
  int64_t qs[3], ks[3], vs[3];  // element strides of dims 0..2 (dim 3 has stride 1)
  float scale;
  bool causal;
  const bool* mask = nullptr;  // (B, Hq, Lq, Lk) at element strides ms (0 where broadcast)
  int64_t ms[4] = {0, 0, 0, 0};
};

// Queries [i0, i1) of head h in batch b; `scores` holds Lk floats.
template <class O>
void attention_rows(const AttnShape& s, const float* q, const float* k, const float* v,
                    float* out, int64_t b, int64_t h, int64_t i0, int64_t i1, float* scores) {
  using F8 = typename O::F8;
  const int64_t kvh = h / (s.Hq / s.Hkv), D = s.D, d8 = D / 8 * 8;
  const float* kb = k + b * s.ks[0] + kvh * s.ks[1];
  const float* vb = v + b * s.vs[0] + kvh * s.vs[1];
  for (int64_t i = i0; i < i1; i++) {
    const float* qi = q + b * s.qs[0] + h * s.qs[1] + i * s.qs[2];
    int64_t n = s.causal ? std::min(s.Lk, i + s.Lk - s.Lq + 1) : s.Lk;
    const bool* mi = s.mask ? s.mask + b * s.ms[0] + h * s.ms[1] + i * s.ms[2] : nullptr;
    float* oi = out + ((b * s.Hq + h) * s.Lq + i) * D;
    float mx = -INFINITY;
    int64_t j0 = 0;
    for (; j0 + 4 <= n; j0 += 4) {  // 4 keys at once: independent FMA chains, same sums
      const float* kj[4];
      F8 acc[4];
      for (int u = 0; u < 4; u++) kj[u] = kb + (j0 + u) * s.ks[2], acc[u] = O::f8zero();
      for (int64_t d = 0; d < d8; d += 8) {
        const F8 qv = O::f8load(qi + d);
        for (int u = 0; u < 4; u++) acc[u] = O::fma8(acc[u], qv, kj[u] + d);
      }
      for (int u = 0; u < 4; u++) {
        float dot = O::f8sum(acc[u]);
        for (int64_t d = d8; d < D; d++) dot += qi[d] * kj[u][d];
        const bool dropped = mi && !mi[(j0 + u) * s.ms[3]];
        scores[j0 + u] = dropped ? -INFINITY : dot * s.scale;
        mx = std::max(mx, scores[j0 + u]);
      }
    }
    for (int64_t j = j0; j < n; j++) {
      if (mi && !mi[j * s.ms[3]]) {
        scores[j] = -INFINITY;
        continue;
      }
      const float* kj = kb + j * s.ks[2];
      F8 acc = O::f8zero();
      for (int64_t d = 0; d < d8; d += 8) acc = O::fma8(acc, O::f8load(qi + d), kj + d);
      float dot = O::f8sum(acc);
      for (int64_t d = d8; d < D; d++) dot += qi[d] * kj[d];
      scores[j] = dot * s.scale;
      mx = std::max(mx, scores[j]);
    }
    if (mx == -INFINITY) {  // no key to attend to
      std::fill(oi, oi + D, 0.f);
      continue;
    }
    // ... and end at the last key kept: keys masked after it (a batch's causal mask in prefill)
    // would move keys between the vector head's lanes and the scalar tail (another exp, another
    // order of the sum), 1-3 ulp off the sequence alone.
    while (mi && scores[n - 1] == -INFINITY) n--;
    float sum = 0.f;
    int64_t j = 0;
    // Sum from the first key kept: a left-padded row then groups its keys into lanes as the
    // sequence alone does, and gets the same sum bit for bit.
    for (; mi && j < n && scores[j] == -INFINITY; j++) scores[j] = 0.f;
    j = native::softmax_exp_head(scores, j, n, mx, sum);
    for (; j < n; j++) sum += (scores[j] = std::exp(scores[j] - mx));
    const float inv = n > 0 ? 1.f / sum : 0.f;
    for (int64_t d0 = 0; d0 < d8; d0 += 64) {  // 8 accumulators: each value row read once
      const int nu = (int)std::min<int64_t>(8, (d8 - d0) / 8);
      F8 acc[8];
      for (int u = 0; u < 8; u++) acc[u] = O::f8zero();
      for (int64_t j = 0; j < n; j++) {
        if (mi && scores[j] == 0.f) continue;  // masked (or a weight of exactly 0: acc + 0)
        const F8 p = O::f8set(scores[j]);
        const float* vj = vb + j * s.vs[2] + d0;
        for (int u = 0; u < nu; u++) acc[u] = O::f8fma(acc[u], p, O::f8load(vj + 8 * u));
      }
      for (int u = 0; u < nu; u++) O::f8store(oi + d0 + 8 * u, O::f8mul(acc[u], inv));
    }
    for (int64_t d = d8; d < D; d++) {
      float acc = 0.f;
      for (int64_t j = 0; j < n; j++)
        if (!mi || scores[j] != 0.f) acc += scores[j] * vb[j * s.vs[2] + d];
      oi[d] = acc * inv;
    }
  }
}

}  // namespace tk
