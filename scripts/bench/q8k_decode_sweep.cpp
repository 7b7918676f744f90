// One token through the 0.53 G llama's 84 ternary layers (12 x q, k, v, o, gate, up, down;
// distinct random weights, 136 MB: none cached between sweeps) outside MLX: the program
// scripts/bench/q8k_decode_sweep.sh builds from a source tree and runs, to compare two trees'
// decode kernels. A TQ2_0 tensor as written (fast packing, float16 scales per 256 columns),
// Q8_K activations prepared as the fused block does (one preparation for q/k/v, one for o,
// one for gate/up, one for down), rows cut as ops/ternary.h row_chunk cuts them, on the
// extension's pool (kernels/threadpool.h). Usage: q8k_decode_sweep THREADS REPS [cached].
// Prints the minimum time (wall; one thread: its CPU time) of a sweep, of its activation preparations, of each layer
// shape's calls (summed over the 12 layers), and a digest of the outputs' bits.
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "clock.h"
#include "kernels/threadpool.h"
#include "selfcheck.h"

static clockid_t CLOCK = CLOCK_MONOTONIC;  // one thread: its CPU time (a shared machine)
static double now() { return clock_seconds(CLOCK); }

int main(int argc, char** argv) {
  using namespace tk;
  if (argc < 3) return 2;
  const int threads = std::atoi(argv[1]), reps = std::atoi(argv[2]);
  const bool cached = argc > 3 && std::strcmp(argv[3], "cached") == 0;
  if (threads == 1) CLOCK = CLOCK_THREAD_CPUTIME_ID;
  const int64_t H = 2048, I = 5632, KV = 256, LAYERS = 12;
  struct Shape { const char* name; int64_t n, k; int prep; };
  // prep: 1 = a new activation preparation before this layer
  const Shape shapes[7] = {{"q", H, H, 1}, {"k", KV, H, 0}, {"v", KV, H, 0}, {"o", H, H, 1},
                           {"gate", I, H, 1}, {"up", I, H, 0}, {"down", H, I, 1}};
  std::mt19937 rng(1);
  // the weights 24 bytes past a cache line, where MLX's CPU allocator puts a large array's data
  struct W { Geometry g; std::vector<uint8_t, LineAllocator<uint8_t>> buf; uint8_t* w; std::vector<uint16_t> s; std::vector<float> y; };
  std::vector<W> ws;
  for (int l = 0; l < (cached ? 1 : LAYERS); l++)
    for (const Shape& sh : shapes) {
      W x{make_geometry(FAST, sh.n, sh.k, 256), {}, nullptr, {}, {}};
      x.buf.resize(x.g.n * x.g.row_bytes + 64);
      x.w = x.buf.data() + 24;
      for (int64_t i = 0; i < x.g.n * x.g.row_bytes; i++) {
        uint8_t b = 0;  // codes 0-2
        for (int f = 0; f < 4; f++) b |= (uint8_t)((rng() % 3) << (2 * f));
        x.w[i] = b;
      }
      x.s.resize(sh.n * x.g.ngroups);
      for (auto& v : x.s) v = f32_to_f16(0.5f + (rng() % 1000) / 1000.f);
      x.y.resize(sh.n);
      ws.push_back(std::move(x));
    }
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> xh(H), xi(I);
  for (auto& v : xh) v = normal(rng);
  for (auto& v : xi) v = normal(rng);
  Pool pool(threads);
  Acts a;
  std::vector<float> tmp(q8k_tmp_floats(I));
  double best = 1e9, best_prep = 1e9, best_shape[7];
  for (double& b : best_shape) b = 1e9;
  for (int r = 0; r < reps; r++) {
    double prep = 0, per[7] = {0};
    const double t0 = now();
    for (int l = 0; l < LAYERS; l++)
      for (int i = 0; i < 7; i++) {
        W& x = ws[cached ? i : 7 * l + i];
        const Shape& sh = shapes[i];
        const double ta = now();
        if (sh.prep) {
          a.q.resize(x.g.xlen()), a.d8.resize(x.g.nblocks8), a.ssum.resize(x.g.nseg);
          quantize_token_q8k(x.g, sh.k == H ? xh.data() : xi.data(), F32, 0, a, tmp.data());
        }
        const double tb = now();
        Layer L(x.g);
        L.w = x.w, L.scales = x.s.data(), L.scale_dtype = F16, L.scale_kind = 2;
        L.act_quant = L.q8k = true, L.out = x.y.data();
        const int64_t want = ceil_div(sh.n, 8 * (int64_t)threads);
        const int64_t chunk = std::max<int64_t>(16, ceil_div(want, 16) * 16);
        pool.parallel_for(ceil_div(sh.n, chunk), [&](int64_t c) {
          rows_dispatch<NativeOps>(L, a, 1, c * chunk, std::min(sh.n, (c + 1) * chunk));
        });
        const double tc = now();
        prep += tb - ta, per[i] += tc - tb;
      }
    const double t1 = now();
    best = std::min(best, t1 - t0), best_prep = std::min(best_prep, prep);
    for (int i = 0; i < 7; i++) best_shape[i] = std::min(best_shape[i], per[i]);
  }
  for (auto& x : ws) fold_digest(0, x.y);
  std::printf("%s %d thread(s)%s: sweep %.3f ms, prep %.3f", NativeOps::name, threads,
              cached ? " cached" : "", best * 1e3, best_prep * 1e3);
  for (int i = 0; i < 7; i++) std::printf(", %s %.3f", shapes[i].name, best_shape[i] * 1e3);
  std::printf(" ms, digest %016llx\n", (unsigned long long)int8_digests()[0]);
  return 0;
}
