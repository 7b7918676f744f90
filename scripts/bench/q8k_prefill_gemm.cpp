// One q8k layer's prefill on one thread, outside MLX: the program scripts/bench/q8k_prefill_gemm.sh
// builds from a source tree and runs, to compare two trees' kernels (docs/NATIVE.md "row panels").
// A TQ2_0 tensor as written (fast packing, float16 scales per 256 columns), random trits and
// activations; the rows in the chunks the extension would use with 2 threads (ops/ternary.h
// row_chunk). Usage: q8k_prefill_gemm N K M REPS. Prints the minimum thread CPU time of the
// Q8_K quantization of the M tokens and of the rows, G int8 MACs/s (N K M / rows' time) and a
// digest of the outputs' bits (the same for every tree and ISA).
#include <time.h>

#include <cstdio>
#include <cstdlib>

#include "clock.h"
#include "selfcheck.h"

static double cpu_seconds() { return clock_seconds(CLOCK_THREAD_CPUTIME_ID); }

int main(int argc, char** argv) {
  using namespace tk;
  if (argc != 5) return 2;
  const int64_t N = std::atoll(argv[1]), K = std::atoll(argv[2]), M = std::atoll(argv[3]);
  const int reps = std::atoi(argv[4]);
  const Geometry g = make_geometry(FAST, N, K, 256);
  if (!g.q8k_ok) return 2;
  std::mt19937 rng(1);
  std::vector<int8_t> t(N * K);
  for (auto& v : t) v = (int8_t)((int)(rng() % 3) - 1);
  const std::vector<uint8_t> w = pack_rows(t, g);
  std::vector<uint16_t> s(N * g.ngroups);
  for (auto& v : s) v = f32_to_f16(0.5f + (rng() % 1000) / 1000.f);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(M * K), y(M * N);
  for (auto& v : x) v = normal(rng);
  Layer L(g);
  L.w = w.data(), L.scales = s.data(), L.scale_dtype = F16, L.scale_kind = 2;
  L.act_quant = L.q8k = true, L.out = y.data();
  Acts a;
  a.q.resize(M * g.xlen()), a.d8.resize(M * g.nblocks8), a.ssum.resize(M * g.nseg);
  std::vector<float> tmp(q8k_tmp_floats(K));
  // ops/ternary.h row_chunk's rows for 2 threads (PANEL_CHUNK: a tree with the row panels)
  int64_t chunk = M >= TOKEN_TILE ? 16 : N;
#ifdef PANEL_CHUNK
  if (HasQ8kPanel<NativeOps>::value && q8k_panels_apply(g, true, M)) chunk = q8k_panel_chunk(N, 2);
#endif
  double best_q = 1e9, best_r = 1e9;
  for (int r = 0; r < reps; r++) {
    const double t0 = cpu_seconds();
    for (int64_t m = 0; m < M; m++) quantize_token_q8k(g, x.data(), F32, m, a, tmp.data());
    const double t1 = cpu_seconds();
    for (int64_t n0 = 0; n0 < N; n0 += chunk) rows_dispatch<NativeOps>(L, a, M, n0, std::min(N, n0 + chunk));
    const double t2 = cpu_seconds();
    best_q = std::min(best_q, t1 - t0), best_r = std::min(best_r, t2 - t1);
  }
  fold_digest(0, y);
  std::printf("%s %ld x %ld, %ld tokens: quantize %.3f ms, rows %.3f ms, %.1f G MACs/s, digest %016llx\n",
              NativeOps::name, (long)N, (long)K, (long)M, best_q * 1e3, best_r * 1e3,
              (double)N * K * M / best_r * 1e-9, (unsigned long long)int8_digests()[0]);
  return 0;
}
