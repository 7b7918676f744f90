// Scaled dot-product attention on the CPU: out = softmax(scale * q k^T [+ causal]) v for q
// (B, Hq, Lq, D) float32 and k, v (B, Hkv, Lk, D) float32 or float16 (the KV cache the fused
// block keeps in 16 bits), Hq a multiple of Hkv (grouped-query attention), rows of D
// contiguous and any strides above; the output at its own strides. "causal" is MLX's: query i
// (of Lq) sees keys j <= i + Lk - Lq. A boolean mask (mlx-lm's batches: causal and left
// padding; sliding windows) drops the keys it marks false; a row with no key left gets 0.
//
// Tiled, with the online softmax of flash attention, in float32:
// - A task is one batch row, one KV head and a run of query positions; its rows are the
//   query heads of the KV head's group at those positions (at most ATT_ROWS), so each K and V
//   row is read (and widened from float16) once per group and query tile, and no score
//   matrix exists beyond one tile of ATT_KEYS keys. Every row of a task that sees a key sees
//   the same first key (a new task starts where that changes: sliding windows, per-head masks).
// - Scores: one row against 8 keys at a time, an accumulator per key, the 8 reduced together
//   (f8tsum: a transpose and add, the same tree for each key), not a horizontal sum per key.
// - A tile that every row of the task sees whole (a decode step's, a prefill's below the
//   diagonal) skips the per-key tests, and its values run in register blocks of rows sharing
//   each V load; a decode task (one GQA group) reads V in place, widened in registers. The
//   same operations per row and key, so the same bits as the general path (for finite K
//   and V: a key of weight 0 adds +-0 there, where the general path may skip it).
// - The keys a task's rows see are cut into chunks of ATT_CHUNK from their first key, and a
//   chunk into tiles of ATT_KEYS. Each chunk's (max, sum of weights, weighted values) is
//   computed from scratch and the chunks are merged left to right; a decode step (few tasks,
//   long context) computes the chunks of a task on several threads and merges them in the
//   same order.
// - Within a chunk a row's running max moves only when a tile raises it (then the row's sum
//   and values are rescaled by exp(m - m')); keys a row does not see weigh exactly 0 (+ 0
//   leaves a sum as it was), a tile where it sees none leaves it untouched, and the vector exp
//   runs over whole blocks of 8 whatever the tile's length.
// So a row's float operations are those of its visible keys, counted from its first, in key
// order: the bits depend neither on the threads, nor on the batch, the padding or the rows it
// shares a task with. A left-padded row of a batch gets the bits of its sequence alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "../arch/select.h"
#include "layer.h"

namespace tk {

constexpr int ATT_KEYS = 32;    // keys a tile: 4 blocks of 8
constexpr int ATT_CHUNK = 256;  // keys a chunk (whole tiles)
constexpr int ATT_ROWS = 32;    // rows (query heads x positions) a task, at most
constexpr int ATT_SPLIT = 16;   // fewer tasks than this: their chunks run in parallel

struct AttnShape {
  int64_t B, Hq, Hkv, Lq, Lk, D;
  int64_t qs[3], ks[3], vs[3];  // element strides of dims 0..2 (dim 3 has stride 1)
  int64_t os[3];                // the output's strides of (b, h, i); d has stride 1
  float scale;
  bool causal;
  bool kv_half = false;        // k and v hold float16 bits
  const bool* mask = nullptr;  // (B, Hq, Lq, Lk) at element strides ms (0 where broadcast)
  int64_t ms[4] = {0, 0, 0, 0};

  int64_t group() const { return Hq / Hkv; }
  int64_t qtile() const { return std::max<int64_t>(1, ATT_ROWS / group()); }  // positions a task
};

// The rows of one task (one batch row b, one KV head g): their queries, masks, outputs (element
// offsets), the last key each sees, and the keys [first, end) they see. Every row that sees a
// key sees `first` first: the task's chunks and tiles start at each row's own first key.
struct AttnRows {
  int n = 0;
  int64_t b = 0, g = 0;
  const float* q[ATT_ROWS];
  const bool* mask[ATT_ROWS];
  int64_t out[ATT_ROWS];
  int64_t last[ATT_ROWS];
  int64_t first = -1, end = 0;  // first = -1: no row sees a key (yet)
  int64_t chunks() const { return first < 0 ? 0 : (end - first + ATT_CHUNK - 1) / ATT_CHUNK; }
};

// A chunk's (or the merged chunks') result for a task's rows: max, sum of weights, and the
// weighted values (rows x D at o).
struct AttnPartial {
  float m[ATT_ROWS], l[ATT_ROWS];
  float* o;
};

namespace attn_detail {

// Rows [j0, j0 + nk) of k or v (element stride `stride` from `base`) as float32 in dst (8 x D,
// rows past nk zero).
inline void widen(const AttnShape& s, const void* base, int64_t stride, int64_t j0, int nk,
                  float* dst) {
  const int64_t D = s.D;
  for (int u = 0; u < nk; u++) {
    float* out = dst + u * D;
    if (!s.kv_half) {
      std::memcpy(out, (const float*)base + (j0 + u) * stride, D * sizeof(float));
      continue;
    }
    // Unconditional F16C (or NEON) widening: a non-finite K or V makes its rows NaN or
    // infinite whichever conversion runs; only a signalling NaN's quiet bit can differ.
    const uint16_t* src = (const uint16_t*)base + (j0 + u) * stride;
    for (int64_t d = native::f16_widen_head(src, D, out); d < D; d++) out[d] = f16_to_f32(src[d]);
  }
  if (nk < 8) std::memset(dst + nk * D, 0, (8 - nk) * D * sizeof(float));
}

// Scores of every row against keys [j0, j0 + 8) (widened in kr, 8 x D) into sc (rows x
// ATT_KEYS, this block's columns); -inf where a row does not see the key.
template <class O>
inline void scores8(const AttnShape& s, const AttnRows& rows, const float* kr, int64_t j0, int nk,
                    float* sc) {
  using F8 = typename O::F8;
  const int64_t D = s.D, d8 = D / 8 * 8;
  for (int r = 0; r < rows.n; r++) {
    const float* q = rows.q[r];
    F8 acc[8];
    for (int u = 0; u < 8; u++) acc[u] = O::f8zero();
    for (int64_t d = 0; d < d8; d += 8) {
      const F8 qv = O::f8load(q + d);
      for (int u = 0; u < 8; u++) acc[u] = O::fma8(acc[u], qv, kr + u * D + d);
    }
    const F8 dots = O::f8tsum(acc);
    float* out = sc + r * ATT_KEYS;
    if (nk == 8 && d8 == D && !rows.mask[r] && j0 + 7 <= rows.last[r]) {  // every key seen
      O::f8store(out, O::f8mul(dots, s.scale));
      continue;
    }
    alignas(32) float t[8];
    O::f8store(t, dots);
    for (int u = 0; u < 8; u++) {
      const int64_t j = j0 + u;
      float dot = t[u];
      for (int64_t d = d8; d < D; d++) dot += q[d] * kr[u * D + d];
      const bool seen =
          u < nk && j <= rows.last[r] && (!rows.mask[r] || rows.mask[r][j * s.ms[3]]);
      out[u] = seen ? dot * s.scale : -INFINITY;
    }
  }
}

// o[i] += sum_t w[i][t] v[t] over d in [d0, d0 + 8 NU) for N rows (w: their weights of the
// tile, 0 where unseen), key by key in order: each value row is read once for the N rows. A
// key no row sees is skipped; one a row does not see adds 0 * v to it (exactly nothing).
template <class O, int N, int NU>
inline void add_values_block(const float* const* w, int nt, const float* vbuf, int64_t D,
                             int64_t d0, float* const* o) {
  using F8 = typename O::F8;
  F8 acc[N][NU];
  for (int i = 0; i < N; i++)
    for (int u = 0; u < NU; u++) acc[i][u] = O::f8load(o[i] + d0 + 8 * u);
  for (int t = 0; t < nt; t++) {
    bool any = false;
    for (int i = 0; i < N; i++) any |= w[i][t] != 0.f;
    if (!any) continue;
    const float* vr = vbuf + t * D + d0;
    for (int i = 0; i < N; i++) {
      const F8 p = O::f8set(w[i][t]);
      for (int u = 0; u < NU; u++) acc[i][u] = O::fma8(acc[i][u], p, vr + 8 * u);
    }
  }
  for (int i = 0; i < N; i++)
    for (int u = 0; u < NU; u++) O::f8store(o[i] + d0 + 8 * u, acc[i][u]);
}

// o[i] += sum_t w[i][t] v[t] for N rows (add_values_block over D, then a scalar tail).
template <class O, int N>
inline void add_values(const float* const* w, int nt, const float* vbuf, int64_t D,
                       float* const* o) {
  const int64_t d32 = D / 32 * 32, d8 = D / 8 * 8;
  int64_t d0 = 0;
  for (; d0 < d32; d0 += 32) add_values_block<O, N, 4>(w, nt, vbuf, D, d0, o);
  for (; d0 < d8; d0 += 8) add_values_block<O, N, 1>(w, nt, vbuf, D, d0, o);
  for (int i = 0; i < N; i++)
    for (int64_t d = d8; d < D; d++) {
      float a = o[i][d];
      for (int t = 0; t < nt; t++)
        if (w[i][t] != 0.f) a += w[i][t] * vbuf[t * D + d];
      o[i][d] = a;
    }
}

// The tiles where every row of the task sees every key (a whole tile of ATT_KEYS, no mask,
// no causal bound inside it, D a multiple of 8: a decode step's tiles, and a prefill's below
// the diagonal) take the loops below: the same operations per row and key in the same order
// as scores8 and add_values (the same bits), without their per-key tests, the values in
// register blocks of rows that share each V load. A task of at most one block of rows (a
// decode step's GQA group) reads V straight from the cache, widened in registers (each
// element once, no store and reload); larger ones read the tile widened once into vbuf.

// K or V rows as those loops read them: float32 rows (a widened tile, or a float32 cache) or
// float16 ones, at an element stride.
template <class O, bool HALF>
struct KvRows {
  const void* base;
  int64_t stride;
  typename O::F8 load(int64_t j, int64_t d) const {
    if constexpr (HALF) return O::f8loadh((const uint16_t*)base + j * stride + d);
    else return O::f8loadr((const float*)base + j * stride + d);
  }
};

// The values' register blocks: V_ROWS x V_VECS accumulators, V_VECS vectors of V and a weight
// (8 x 2 in AVX-512's 32 registers, 4 x 2 in 16).
template <class O>
struct AttBlocks {
  static constexpr int V_ROWS = O::f8regs >= 32 ? 8 : 4, V_VECS = 2;
};

// The scores of every row against the whole tile (kr: ATT_KEYS x D) into sc (rows x ATT_KEYS):
// scores8's loop, a row at a time (Zen 4: 2 or 3 rows sharing each K load in 32 registers ran
// at 0.8x and 0.95x of this; each row's 8 accumulators with K as memory operands keep both FMA
// pipes busy).
template <class O>
inline void scores_full(const AttnRows& rows, const float* kr, int64_t D, float scale,
                        float* sc) {
  using F8 = typename O::F8;
  for (int r = 0; r < rows.n; r++) {
    const float* q = rows.q[r];
    for (int b = 0; b < ATT_KEYS / 8; b++) {
      const float* k = kr + 8 * b * D;
      F8 acc[8];
      for (int u = 0; u < 8; u++) acc[u] = O::f8zero();
      for (int64_t d = 0; d < D; d += 8) {
        const F8 qv = O::f8load(q + d);
        for (int u = 0; u < 8; u++) acc[u] = O::fma8(acc[u], qv, k + u * D + d);
      }
      O::f8store(sc + r * ATT_KEYS + 8 * b, O::f8mul(O::f8tsum(acc), scale));
    }
  }
}

// o[i] += sum_t w[i][t] v[j0 + t] over d in [d0, d0 + 8 NU) for RB rows, every key of the
// tile in order (add_values_block's operations without its test: every row sees every key).
template <class O, int RB, int NU, class V>
inline void values_rows(const float* const* w, const V& v, int64_t j0, int64_t d0,
                        float* const* o) {
  using F8 = typename O::F8;
  F8 acc[RB][NU];
  for (int i = 0; i < RB; i++)
    for (int u = 0; u < NU; u++) acc[i][u] = O::f8load(o[i] + d0 + 8 * u);
  for (int t = 0; t < ATT_KEYS; t++) {
    F8 vv[NU];
    for (int u = 0; u < NU; u++) vv[u] = v.load(j0 + t, d0 + 8 * u);
    for (int i = 0; i < RB; i++) {
      const F8 p = O::f8set(w[i][t]);
      for (int u = 0; u < NU; u++) acc[i][u] = O::f8fma(acc[i][u], p, vv[u]);
    }
  }
  for (int i = 0; i < RB; i++)
    for (int u = 0; u < NU; u++) O::f8store(o[i] + d0 + 8 * u, acc[i][u]);
}

// Rows seen[i, i + RB) (weights in sc, outputs in po) over the whole tile and D.
template <class O, int RB, class V>
inline void values_block(const int* seen, int i, const float* sc, const V& v, int64_t j0,
                         int64_t D, float* po) {
  constexpr int NU = AttBlocks<O>::V_VECS;
  const float* w[RB];
  float* o[RB];
  for (int k = 0; k < RB; k++) w[k] = sc + seen[i + k] * ATT_KEYS, o[k] = po + seen[i + k] * D;
  int64_t d0 = 0;
  for (; d0 + 8 * NU <= D; d0 += 8 * NU) values_rows<O, RB, NU>(w, v, j0, d0, o);
  for (; d0 < D; d0 += 8) values_rows<O, RB, 1>(w, v, j0, d0, o);
}

// The weighted values of the rows seen[0, ns) over the tile [j0, j0 + ATT_KEYS) of v, rows in
// blocks of V_ROWS, then 4, 2, 1.
template <class O, class V>
inline void values_full(const int* seen, int ns, const float* sc, const V& v, int64_t j0,
                        int64_t D, float* po) {
  constexpr int RB = AttBlocks<O>::V_ROWS;
  int i = 0;
  for (; i + RB <= ns; i += RB) values_block<O, RB>(seen, i, sc, v, j0, D, po);
  if constexpr (RB > 4)
    if (i + 4 <= ns) values_block<O, 4>(seen, i, sc, v, j0, D, po), i += 4;
  if (i + 2 <= ns) values_block<O, 2>(seen, i, sc, v, j0, D, po), i += 2;
  if (i < ns) values_block<O, 1>(seen, i, sc, v, j0, D, po);
}

// The online softmax of one tile for each row that sees a key of it: sc (rows x ATT_KEYS, nt
// keys) goes from scores to weights, the row's max, sum and values (p) move on; the rows that
// see a key are listed in seen. Returns how many.
template <class O>
inline int tile_softmax(const AttnRows& rows, int64_t D, float* sc, int nt, AttnPartial& p,
                        int* seen) {
  using F8 = typename O::F8;
  const int64_t d8 = D / 8 * 8;
  const int nb = (nt + 7) / 8;
  int ns = 0;
  // In phases over the rows (their maxes, the rescales, the exps): the same operations per
  // row, but a row's unpredictable "the max moved" branch no longer sits between the exps of
  // the rows before and after it.
  float tmax[ATT_ROWS];
  for (int r = 0; r < rows.n; r++) {
    const float* w = sc + r * ATT_KEYS;
    F8 mx8 = O::f8load(w);
    for (int b = 1; b < nb; b++) mx8 = O::f8max(mx8, O::f8load(w + 8 * b));
    tmax[r] = O::f8hmax(mx8);
  }
  for (int r = 0; r < rows.n; r++) {
    if (tmax[r] == -INFINITY) continue;  // the row sees no key of this tile
    seen[ns++] = r;
    const float m = std::max(p.m[r], tmax[r]);
    if (m == p.m[r]) continue;
    // the max moved: rescale what the row has
    float* o = p.o + r * D;
    const float alpha = p.m[r] == -INFINITY ? 0.f : std::exp(p.m[r] - m);
    p.l[r] *= alpha;
    // + 0: a product that underflows to -0 becomes +0, so a later key of weight 0 adds
    // nothing whether it is skipped (add_values) or added (values_full)
    for (int64_t d = 0; d < d8; d += 8)
      O::f8store(o + d, O::f8add(O::f8mul(O::f8load(o + d), alpha), O::f8zero()));
    for (int64_t d = d8; d < D; d++) o[d] = o[d] * alpha + 0.f;
    p.m[r] = m;
  }
  for (int i = 0; i < ns; i++) {
    const int r = seen[i];
    float* w = sc + r * ATT_KEYS;
    const float m = p.m[r];
    // The vector exp runs over whole blocks of 8 (a block's keys past nt are -inf: weight 0,
    // and + 0 leaves the lanes' sums as they were), so a key never moves between the
    // vector exp and the scalar one with the tile's length, which the other rows set.
    float sum = 0.f;
    int t = (int)native::softmax_exp_head(w, 0, 8 * nb, m, sum);
    for (; t < nt; t++) sum += (w[t] = w[t] == -INFINITY ? 0.f : std::exp(w[t] - m));
    p.l[r] += sum;
  }
  return ns;
}

}  // namespace attn_detail

// One chunk, keys [c0, c1) of the task's K/V rows (kb, vb: its batch row and KV head), from
// scratch into p; kbuf and vbuf hold ATT_KEYS x D floats each.
template <class O>
void attention_chunk(const AttnShape& s, const AttnRows& rows, const void* kb, const void* vb,
                     int64_t c0, int64_t c1, AttnPartial& p, float* kbuf, float* vbuf) {
  using namespace attn_detail;
  const int64_t D = s.D, d8 = D / 8 * 8;
  alignas(64) float sc[ATT_ROWS * ATT_KEYS];
  for (int r = 0; r < rows.n; r++) p.m[r] = -INFINITY, p.l[r] = 0.f;
  std::memset(p.o, 0, sizeof(float) * rows.n * D);
  // every row sees every key of [c0, c1) but for masks and causal bounds inside it
  bool unmasked = d8 == D;
  int64_t lastmin = c1;
  for (int r = 0; r < rows.n; r++)
    unmasked = unmasked && !rows.mask[r], lastmin = std::min(lastmin, rows.last[r]);
  // a task of one block of rows (a decode step's GQA group) reads V in place
  const bool direct = rows.n <= AttBlocks<O>::V_ROWS;
  for (int64_t j0 = c0; j0 < c1; j0 += ATT_KEYS) {
    const int nt = (int)std::min<int64_t>(ATT_KEYS, c1 - j0), nb = (nt + 7) / 8;
    const bool full = unmasked && nt == ATT_KEYS && j0 + ATT_KEYS - 1 <= lastmin;
    for (int b = 0; b < nb; b++)
      widen(s, kb, s.ks[2], j0 + 8 * b, std::min(8, nt - 8 * b), kbuf + 8 * b * D);
    if (full) scores_full<O>(rows, kbuf, D, s.scale, sc);
    else
      for (int b = 0; b < nb; b++)
        scores8<O>(s, rows, kbuf + 8 * b * D, j0 + 8 * b, std::min(8, nt - 8 * b), sc + 8 * b);
    int seen[ATT_ROWS];
    const int ns = tile_softmax<O>(rows, D, sc, nt, p, seen);
    if (ns == 0) continue;
    if (full && direct && s.kv_half) {
      values_full<O>(seen, ns, sc, KvRows<O, true>{vb, s.vs[2]}, j0, D, p.o);
      continue;
    }
    if (full && direct) {
      values_full<O>(seen, ns, sc, KvRows<O, false>{vb, s.vs[2]}, j0, D, p.o);
      continue;
    }
    for (int b = 0; b < nb; b++)
      widen(s, vb, s.vs[2], j0 + 8 * b, std::min(8, nt - 8 * b), vbuf + 8 * b * D);
    if (full) {
      values_full<O>(seen, ns, sc, KvRows<O, false>{vbuf, D}, 0, D, p.o);
      continue;
    }
    // the values of the rows that see a key of the tile, two at a time
    int i = 0;
    for (; i + 2 <= ns; i += 2) {
      const float* w[2] = {sc + seen[i] * ATT_KEYS, sc + seen[i + 1] * ATT_KEYS};
      float* o[2] = {p.o + seen[i] * D, p.o + seen[i + 1] * D};
      add_values<O, 2>(w, nt, vbuf, D, o);
    }
    if (i < ns) {
      const float* w[1] = {sc + seen[i] * ATT_KEYS};
      float* o[1] = {p.o + seen[i] * D};
      add_values<O, 1>(w, nt, vbuf, D, o);
    }
  }
}

// Merge chunk partial b into the running a (rows x D), a on the left.
inline void attention_merge(AttnPartial& a, const AttnPartial& b, int n, int64_t D) {
  for (int r = 0; r < n; r++) {
    if (b.m[r] == -INFINITY) continue;
    float* ao = a.o + r * D;
    const float* bo = b.o + r * D;
    if (a.m[r] == -INFINITY) {
      a.m[r] = b.m[r], a.l[r] = b.l[r];
      std::memcpy(ao, bo, D * sizeof(float));
      continue;
    }
    const float m = std::max(a.m[r], b.m[r]);
    const float fa = std::exp(a.m[r] - m), fb = std::exp(b.m[r] - m);
    a.l[r] = a.l[r] * fa + b.l[r] * fb;
    for (int64_t d = 0; d < D; d++) ao[d] = ao[d] * fa + bo[d] * fb;
    a.m[r] = m;
  }
}

// The tasks of the attention: for each batch row and KV head, its rows (the group's query heads
// at each query position in turn) cut into runs of at most qtile() positions' rows, a new run
// wherever a row's first key is not the run's (a row that sees no key joins any run). So the
// chunks and tiles of a row start at its own first key whatever the batch, the padding and
// the other rows of its task.
inline std::vector<AttnRows> attention_tasks(const AttnShape& s, const float* q) {
  const int64_t G = s.group(), cap = s.qtile() * G;
  std::vector<AttnRows> tasks;
  for (int64_t b = 0; b < s.B; b++)
    for (int64_t g = 0; g < s.Hkv; g++) {
      AttnRows cur;
      cur.b = b, cur.g = g;
      const bool* prev = nullptr;  // the last mask row scanned, its causal bound and result
      int64_t pbound = 0, pfirst = 0, plast = -1;
      for (int64_t i = 0; i < s.Lq; i++)
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
          const bool* mk = s.mask ? s.mask + b * s.ms[0] + h * s.ms[1] + i * s.ms[2] : nullptr;
          int64_t first = 0, last = s.causal ? std::min(s.Lk - 1, i + s.Lk - s.Lq) : s.Lk - 1;
          if (mk && mk == prev && last == pbound) {
            first = pfirst, last = plast;
          } else if (mk) {
            prev = mk, pbound = last;
            while (first <= last && !mk[first * s.ms[3]]) first++;
            while (last >= first && !mk[last * s.ms[3]]) last--;
            pfirst = first, plast = last;
          }
          const bool sees = first <= last;
          if (cur.n == cap || (sees && cur.first >= 0 && first != cur.first)) {
            tasks.push_back(cur);
            cur = AttnRows{};
            cur.b = b, cur.g = g;
          }
          const int r = cur.n++;
          cur.q[r] = q + b * s.qs[0] + h * s.qs[1] + i * s.qs[2];
          cur.mask[r] = mk;
          cur.out[r] = b * s.os[0] + h * s.os[1] + i * s.os[2];
          cur.last[r] = sees ? last : -1;
          if (sees) cur.first = first, cur.end = std::max(cur.end, last + 1);
        }
      if (cur.n) tasks.push_back(cur);
    }
  return tasks;
}

// out = o / l for each row (0 for a row that sees no key).
inline void attention_store(const AttnShape& s, const AttnRows& rows, const AttnPartial& p,
                            float* out) {
  const int64_t D = s.D;
  for (int r = 0; r < rows.n; r++) {
    float* dst = out + rows.out[r];
    if (p.m[r] == -INFINITY) {
      std::fill(dst, dst + D, 0.f);
      continue;
    }
    const float inv = 1.f / p.l[r];
    for (int64_t d = 0; d < D; d++) dst[d] = p.o[r * D + d] * inv;
  }
}

// n floats of a thread's scratch `buf`, 64-byte aligned (a 16-byte aligned buffer had a
// quarter of the kernel's 32-byte loads, and every 64-byte store, split across cache lines:
// ~1.25x the time of a decode step).
inline float* att_scratch(std::vector<float>& buf, size_t n) {
  buf.resize(n + 16);
  return (float*)(((uintptr_t)buf.data() + 63) & ~(uintptr_t)63);
}

// The attention; run(n, f) calls f(i) for i in [0, n), in any order and on any threads
// (tk::Pool::parallel_for, or a loop).
template <class O, class Run>
void attention(const AttnShape& s, const float* q, const void* k, const void* v, float* out,
               const Run& run) {
  const int64_t D = s.D;
  const size_t esz = s.kv_half ? 2 : 4;
  const std::vector<AttnRows> all = attention_tasks(s, q);
  const int64_t tasks = (int64_t)all.size();
  int64_t most = 0;  // chunks of the task with the most
  for (auto& r : all) most = std::max(most, r.chunks());
  auto where = [&](int64_t t) {  // (K rows, V rows) of task t
    const int64_t b = all[t].b, g = all[t].g;
    return std::make_pair((const void*)((const char*)k + (b * s.ks[0] + g * s.ks[1]) * esz),
                          (const void*)((const char*)v + (b * s.vs[0] + g * s.vs[1]) * esz));
  };
  auto chunk = [&](int64_t t, int64_t c, AttnPartial& p, float* buf) {
    const AttnRows& rows = all[t];
    const auto [kb, vb] = where(t);
    const int64_t c0 = rows.first + c * ATT_CHUNK, c1 = std::min(rows.end, c0 + ATT_CHUNK);
    attention_chunk<O>(s, rows, kb, vb, c0, c1, p, buf, buf + ATT_KEYS * D);
  };
  auto empty = [](AttnPartial& p, int n) {
    for (int r = 0; r < n; r++) p.m[r] = -INFINITY, p.l[r] = 0.f;
  };
  if (tasks >= ATT_SPLIT || most <= 1) {  // a task's chunks in turn
    run(tasks, [&](int64_t t) {
      thread_local std::vector<float> keep;
      float* buf = att_scratch(keep, (2 * ATT_ROWS + 2 * ATT_KEYS) * D);
      AttnPartial acc{{}, {}, buf}, part{{}, {}, buf + ATT_ROWS * D};
      float* kv = buf + 2 * ATT_ROWS * D;
      empty(acc, all[t].n);
      for (int64_t c = 0; c < all[t].chunks(); c++) {
        chunk(t, c, c == 0 ? acc : part, kv);
        if (c > 0) attention_merge(acc, part, all[t].n, D);
      }
      attention_store(s, all[t], acc, out);
    });
    return;
  }
  // every (task, chunk) on its own; the thread that finishes a task's last chunk merges them
  // in order (one parallel run: a second had cost a decode step another wake-up and join)
  std::vector<int64_t> start{0};
  for (auto& r : all) start.push_back(start.back() + std::max<int64_t>(1, r.chunks()));
  int64_t nmax = 0;  // rows of the task with the most
  for (auto& r : all) nmax = std::max<int64_t>(nmax, r.n);
  // m, l, o of one partial, in steps of 64 bytes
  const int64_t stride = 2 * ATT_ROWS + (nmax * D + 15) / 16 * 16;
  thread_local std::vector<float> keep;  // the calling thread's, kept between calls
  float* parts = att_scratch(keep, start.back() * stride);
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[tasks]);
  for (int64_t t = 0; t < tasks; t++) left[t].store(start[t + 1] - start[t]);
  auto partial = [&](int64_t it) {  // its m and l at the start of its stride
    AttnPartial p{{}, {}, parts + it * stride + 2 * ATT_ROWS};
    std::memcpy(p.m, parts + it * stride, ATT_ROWS * sizeof(float));
    std::memcpy(p.l, parts + it * stride + ATT_ROWS, ATT_ROWS * sizeof(float));
    return p;
  };
  run(start.back(), [&](int64_t it) {
    thread_local std::vector<float> keep;
    float* buf = att_scratch(keep, 2 * ATT_KEYS * D);
    const int64_t t = std::upper_bound(start.begin(), start.end(), it) - start.begin() - 1;
    AttnPartial p{{}, {}, parts + it * stride + 2 * ATT_ROWS};
    if (all[t].chunks() == 0) empty(p, all[t].n);
    else chunk(t, it - start[t], p, buf);
    std::memcpy(parts + it * stride, p.m, ATT_ROWS * sizeof(float));
    std::memcpy(parts + it * stride + ATT_ROWS, p.l, ATT_ROWS * sizeof(float));
    if (left[t].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    AttnPartial acc = partial(start[t]);
    for (int64_t i = start[t] + 1; i < start[t + 1]; i++)
      attention_merge(acc, partial(i), all[t].n, D);
    attention_store(s, all[t], acc, out);
  });
}

}  // namespace tk
