// A decode step's ternary layers outside MLX: the program scripts/bench/decode_pool.sh builds
// from a source tree and runs, to compare two trees' decode blocks and pool (docs/NATIVE.md
// "Threads"). One token against every layer of a model shape in order - q, k, v, o, gate, up,
// down per layer, distinct random weights (TQ2_0 as written: fast packing, float16 scales per
// 256 columns, q8k activations) - each call as ops/ternary.h runs it: the token quantized on
// the calling thread, the rows in row_chunk's decode chunks through a tk::Pool of THREADS.
// GAP_US of busy work on the calling thread between calls stands for the norms, attention and
// MLX's other ops of a decode step. Usage: decode_pool SHAPE(b2b|small) THREADS REPS [hot].
// Prints the minimum over REPS of the calls' wall time (the gaps excluded), the GB/s of
// weights + scales it reads, the share of chunks the workers ran, and a digest of outputs.
// hot: one layer's weights for every layer (in cache: the kernels' own speed). ROW_SCALES=1:
// one float16 scale a row, as load() keeps a GGUF whose blocks of a row share one (both
// models of docs/NATIVE.md's peer tables). CPT=N: N decode chunks a thread (row_chunk: 8).
#include <time.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "clock.h"
#include "kernels/threadpool.h"
#include "selfcheck.h"

static double wall() { return clock_seconds(CLOCK_MONOTONIC); }

using namespace tk;

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  const bool b2b = !std::strcmp(argv[1], "b2b"), hot = argc > 4;
  const int threads = std::atoi(argv[2]), reps = std::atoi(argv[3]);
  const bool row_scales = getenv("ROW_SCALES") && std::atoi(getenv("ROW_SCALES"));
  const int64_t cpt = getenv("CPT") ? std::atoi(getenv("CPT")) : 8;
  const int layers = b2b ? 30 : 12, distinct = hot ? 1 : layers;
  const int64_t H = b2b ? 2560 : 2048, KV = b2b ? 640 : 256, F = b2b ? 6912 : 5632;
  const int64_t shapes[7][2] = {{H, H}, {KV, H}, {KV, H}, {H, H}, {F, H}, {F, H}, {H, F}};
  struct Weights {
    Geometry g;
    std::vector<uint8_t> w;
    std::vector<uint16_t> s;
  };
  std::vector<Weights> ws;
  ws.reserve(7 * distinct);
  std::mt19937 rng(1);
  double bytes = 0;
  for (int l = 0; l < distinct; l++)
    for (auto& sh : shapes) {
      Weights y{make_geometry(FAST, sh[0], sh[1], 256), {}, {}};
      y.w.resize(sh[0] * y.g.row_bytes);
      for (auto& b : y.w) b = (uint8_t)rng();
      y.s.resize(sh[0] * (row_scales ? 1 : y.g.ngroups));
      for (auto& v : y.s) v = f32_to_f16(0.5f + (rng() % 1000) / 1000.f);
      ws.push_back(std::move(y));
    }
  for (int l = 0; l < layers; l++)
    for (int i = 0; i < 7; i++) bytes += ws[7 * (l % distinct) + i].w.size() + 2.0 * ws[7 * (l % distinct) + i].s.size();
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(F), y(F);
  for (auto& v : x) v = normal(rng);
  const double gap = getenv("GAP_US") ? std::atof(getenv("GAP_US")) * 1e-6 : 0;
  Pool pool(threads);
  Acts a;
  std::vector<float> tmp(q8k_tmp_floats(F));
  std::atomic<long> worker_chunks{0}, chunks{0};
  const auto caller = std::this_thread::get_id();
  uint64_t digest = 0;
  double best = 1e9;
  for (int r = 0; r < reps; r++) {
    double spent = 0;
    for (int l = 0; l < layers; l++)
      for (int i = 0; i < 7; i++) {
        const Weights& wt = ws[7 * (l % distinct) + i];
        const Geometry& g = wt.g;
        Layer L(g);
        L.w = wt.w.data(), L.scales = wt.s.data(), L.scale_dtype = F16, L.scale_kind = row_scales ? 1 : 2;
        L.act_quant = L.q8k = true, L.out = y.data();
        const double t0 = wall();
        a.q.resize(g.xlen()), a.d8.resize(g.nblocks8), a.ssum.resize(g.nseg);
        quantize_token_q8k(g, x.data(), F32, 0, a, tmp.data());
        // ops/ternary.h row_chunk for one token
        const int64_t chunk = std::max<int64_t>(16, ceil_div(ceil_div(g.n, cpt * (int64_t)threads), 16) * 16);
        pool.parallel_for(ceil_div(g.n, chunk), [&](int64_t c) {
          rows_dispatch<NativeOps>(L, a, 1, c * chunk, std::min(g.n, (c + 1) * chunk));
          chunks++;
          if (std::this_thread::get_id() != caller) worker_chunks++;
        });
        spent += wall() - t0;
        digest = digest * 31 + (uint64_t)(y[0] * 1e6) + (uint64_t)(y[g.n - 1] * 1e6);
        for (const double end = wall() + gap; gap > 0 && wall() < end;) {
        }
      }
    best = std::min(best, spent);
  }
  std::printf("%s%s, %d threads, %g us between calls: %.2f ms (%.1f GB/s of %.0f MB), workers ran %.2f of the chunks, digest %016llx\n",
              argv[1], hot ? " hot" : "", threads, gap * 1e6, best * 1e3, bytes / best * 1e-9, bytes / 1e6,
              (double)worker_chunks / chunks, (unsigned long long)digest);
  return 0;
}
